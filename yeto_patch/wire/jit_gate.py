"""Whether a module's numba kernels run, and its kernels' module: one gate per kernels module.

numba is optional (requirements pin it; a site may leave it out): a gate says whether it is installed (found, not
imported: importing numba costs about half a second, paid only by a process that runs a kernel), whether the
kernels are switched on (``set_enabled``: tests compare them with the numpy reference kernels), and imports the
kernels' module, compiling or loading its kernels, on first use, once, under a lock (the codecs run on several
threads). Used by wire/codec_jit.py and syncer/model/outer_jit.py.
"""
from __future__ import annotations

import importlib
import importlib.util
import threading
from types import ModuleType
from typing import Optional

__all__ = ["JitGate"]

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None


class JitGate:
    """The gate of the numba kernels in module ``kernels_module`` (a dotted name)."""
    __slots__ = ("kernels_module", "_enabled", "_module", "_lock")

    def __init__(self, kernels_module: str):
        self.kernels_module = kernels_module
        self._enabled = True
        self._module: Optional[ModuleType] = None
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        """Whether numba is installed (the kernels can run)."""
        return _HAVE_NUMBA

    def enabled(self) -> bool:
        """Whether the kernels run: numba installed and not switched off."""
        return self._enabled and _HAVE_NUMBA

    def set_enabled(self, on: bool) -> None:
        """Run the kernels (the default when numba is installed) or the numpy reference kernels."""
        self._enabled = bool(on)

    def kernels(self) -> ModuleType:
        """The kernels' module (imported, and numba with it, on the first call)."""
        if self._module is None:
            with self._lock:
                if self._module is None:
                    self._module = importlib.import_module(self.kernels_module)
        return self._module
