import os
import pytest
import sys

_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _root not in sys.path:
    sys.path.insert(0, _root)

from tests.mcore.fixtures import mcore_pool  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _yeto_patch_log_reaches_caplog():
    """The hooks' runtime gives the "yeto_patch" logger its own handler and propagate=False (training processes
    print their lines once); a test in the same process that ran it first would hide the records from caplog."""
    import logging
    lg = logging.getLogger("yeto_patch")
    old, lg.propagate = lg.propagate, True
    yield
    lg.propagate = old
