"""The numba kernels of :mod:`.outer_jit` (imported on first use: importing numba costs about half a second).

Each kernel makes one pass over a chunk, doing in registers what the numpy kernels of outer.py do in several
passes over scratch arrays, with the same float32 operations in the same order (no fused multiply-add: numba
without fastmath does not contract), so the bits are the same."""
from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=False, error_model="numpy")
_ABS = np.int32(0x7FFFFFFF)
_INF = np.int32(0x7F800000)


@_jit
def scan(x):
    """(finite, largest |x| as int32 bits, sum of x^2 in float64 over 8 interleaved partial sums)."""
    xb = x.view(np.int32)
    n = x.size
    m = np.int32(0)
    for i in range(n):   # (vectorizes: an integer max)
        m = max(m, xb[i] & _ABS)
    if m >= _INF:
        return False, m, 0.0
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    k = n // 8
    for j in range(k):
        i = 8 * j
        a0 = np.float64(x[i])
        a1 = np.float64(x[i + 1])
        a2 = np.float64(x[i + 2])
        a3 = np.float64(x[i + 3])
        a4 = np.float64(x[i + 4])
        a5 = np.float64(x[i + 5])
        a6 = np.float64(x[i + 6])
        a7 = np.float64(x[i + 7])
        s0 += a0 * a0
        s1 += a1 * a1
        s2 += a2 * a2
        s3 += a3 * a3
        s4 += a4 * a4
        s5 += a5 * a5
        s6 += a6 * a6
        s7 += a7 * a7
    for i in range(8 * k, n):
        a = np.float64(x[i])
        s0 += a * a
    return True, m, ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@_jit
def commit(acc, base, m, d, W, lr, mu, invN, use_m, dn, divided):
    """outer.py's ``_commit`` of one chunk (arrays already sliced; ``m``/``d`` empty when absent)."""
    for i in range(base.size):
        g = acc[i]
        if not divided and W != 0:
            g = g / W
        if use_m:
            if dn:
                s = (d[i] + g) * invN
                d[i] = np.float32(0.0)
                nm = m[i] * mu + s
            else:
                nm = m[i] * mu + g
            m[i] = nm
            s = nm * mu + g
        else:
            if dn:
                d[i] = d[i] + g
            s = g
        base[i] = base[i] - s * lr
