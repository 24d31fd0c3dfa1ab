"""Fused codec kernels (numba): one pass per block for int8, int4, int4-log, int1 (here) and the sparse codecs (their
dispatch is in sparse.py), byte-equal to the numpy kernels
of :mod:`.codec_kernels` (the reference; tests/wire/test_codec_jit.py compares them on every layout).

A kernel reads a block once for its absolute maximum and the range check and once more, while the block is still
in L1, for its codes, instead of the dozen whole-piece numpy passes of the reference. The kernels release the GIL,
so ``pieces.run`` spreads them over its threads as before. numba is imported and the kernels compiled on first use
(about half a second for the import and one to three seconds per kernel, then cached in ``__pycache__``); when numba
is not installed, or after ``set_enabled(False)``, the numpy kernels run. A value the block codecs refuse
(non-finite, beyond ``LIMIT``) stops the kernel and the numpy kernel raises the error with its usual message.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .codec_kernels import TINY
from .codec_kernels import BLOCK_ENCODERS as _NP_ENCODERS
from .jit_gate import JitGate

__all__ = ["available", "enabled", "set_enabled", "encoder", "decoder", "kernels"]

_KIND = {"int8": (0, 127.0, 127.0), "int4": (1, 7.0, 7.0), "int4-log": (2, 4.0 / 3.0, 1.0)}
_GATE = JitGate(f"{__package__}.codec_jit_kernels")
available, enabled, set_enabled, kernels = _GATE.available, _GATE.enabled, _GATE.set_enabled, _GATE.kernels


def encoder(codec: str) -> Optional[Callable]:
    """The fused encoder of a piece (``codec_kernels.BLOCK_ENCODERS``' signature), or None (not a block codec,
    numba missing or disabled)."""
    if codec == "int1" and enabled():
        return _int1_encoder(kernels())
    if codec not in _KIND or not enabled():
        return None
    kind, k, div = _KIND[codec]
    tiny = np.float32(TINY[k])
    kern = kernels()

    def enc(x, scales, codes, a, b, block, name):
        bad = kern.enc_block(x, scales, codes, a, b, block, kind, k, div, tiny)
        if bad >= 0:   # the reference kernel raises the error, with its message
            lo = bad * block
            _NP_ENCODERS[codec](x, scales, codes, lo, min(b, lo + block), block, name)
            raise AssertionError("the fused encoder refused a block the reference accepted")
    return enc


def _int1_encoder(kern):
    def enc(x, scales, codes, a, b, block, name):
        bad = kern.enc_int1(x, scales, codes, a, b, block)
        if bad >= 0:
            lo = bad * block
            _NP_ENCODERS["int1"](x, scales, codes, lo, min(b, lo + block), block, name)
            raise AssertionError("the fused encoder refused a block the reference accepted")
    return enc


def decoder(codec: str) -> Optional[Callable]:
    """The fused decoder of a piece (``codec_kernels.DECODERS``' signature), or None."""
    if codec == "int1" and enabled():
        kern = kernels()
        return lambda codes, scales, out, a, b, block, acc, w: kern.dec_int1(
            codes, scales, out if acc is None else acc, a, b, block, float(w), acc is not None)
    if codec not in _KIND or not enabled():
        return None
    kind = _KIND[codec][0]
    kern = kernels()

    def dec(codes, scales, out, a, b, block, acc, w):
        dst, add = (out, False) if acc is None else (acc, True)
        if kind == 0:
            kern.dec_int8(codes, scales, dst, a, b, block, float(w), add)
        else:
            kern.dec_nib(codes, scales, dst, a, b, block, float(w), add, kind == 2)
    return dec
