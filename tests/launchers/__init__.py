"""Tests of the real launchers (ms-swift `megatron sft`, Megatron-Bridge `pretrain()`), run in the py312-launchers
environment (scripts/venv.sh py312-launchers; scripts/test.sh runs only these there). Elsewhere they skip."""
import importlib.util

import pytest


def need(*packages):
    """Skip marker unless every package is installed (found without importing it: importing ms-swift's Megatron
    side needs the test-only import shims that the launched islands install)."""
    def found(name):
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    missing = [p for p in packages if not found(p)]
    return pytest.mark.skipif(bool(missing), reason=f"not installed here: {', '.join(missing)} "
                                                    f"(the py312-launchers environment has them)")
