"""One-pass kernels for the outer step (numba), bit-identical to the numpy kernels of outer.py.

The outer step reads the merged accumulator twice: pass 1 checks it (finite, max |g|, ||g||^2) before anything
is written, pass 2 updates momentum and base. In numpy each pass is several whole-chunk passes (max, min and a
float64 einsum; then a divide, two multiplies and adds, a scale and a subtract through scratch arrays); here each
is one loop over the chunk, so the step moves about the bytes it must (acc read twice, base and momentum read and
written once). The commit gives the same bits as numpy; the sum of squares is summed in float64 in another order
(8 interleaved partial sums per chunk), so the norm can differ from numpy's in its last bits, and is the same for
any thread count. numba is imported, and the kernels compiled, on first use (then cached in ``__pycache__``); when
numba is not installed, or after ``set_enabled(False)``, outer.py runs its numpy kernels.
"""
from __future__ import annotations

import numpy as np

from ...wire.jit_gate import JitGate

__all__ = ["available", "enabled", "set_enabled", "warm", "scan", "commit"]

_GATE = JitGate(f"{__package__}.outer_kernels")
available, enabled, set_enabled = _GATE.available, _GATE.enabled, _GATE.set_enabled
_EMPTY = np.empty(0, np.float32)


def warm() -> None:
    """Compile (or load from the cache) both kernels now, on tiny arrays: the syncer calls it before it listens,
    so its first merge does not pay numba's compilation (seconds on a machine without the cache: a syncer killed
    within them, as tests/syncer/test_checkpoint_crash.py does, never merged nor cached anything)."""
    if not enabled():
        return
    x = np.zeros(8, np.float32)
    _k().scan(x)
    _k().commit(x.copy(), x.copy(), x.copy(), x.copy(), np.float32(1), np.float32(1), np.float32(0),
                np.float32(1), True, True, True)


def _k():
    return _GATE.kernels()


def scan(x: np.ndarray) -> tuple:
    """(finite, max |x|, sum of x^2 as float64) of a float32 chunk, in one pass."""
    if x.size == 0:
        return True, 0.0, 0.0
    ok, bits, sq = _k().scan(x)
    if not ok:
        return False, 0.0, 0.0
    return True, float(np.int32(bits).view(np.float32)), float(sq)


def commit(p, acc: np.ndarray, divided: bool, a: int, b: int) -> None:
    """outer.py's ``_commit`` of elements a:b in one pass (``p``: its _StepPlan)."""
    m = p.m[a:b] if p.use_m else _EMPTY
    d = p.d[a:b] if p.dn else _EMPTY
    _k().commit(acc[a:b], p.base[a:b], m, d, np.float32(p.W), np.float32(p.lr), np.float32(p.mu),
                np.float32(p.invN), bool(p.use_m), bool(p.dn), bool(divided))
