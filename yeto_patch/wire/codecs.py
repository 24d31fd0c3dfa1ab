"""Codecs for one flat float32 vector: ``f32``, ``bf16``, ``int8``, ``int4``, ``int4-log``, ``int1`` and the sparse
``topk:F+intB`` family (names: :mod:`.codec_names`; layout and kernels: :mod:`.sparse`).

Byte layouts (all little-endian; exact definitions in docs/protocol.md, section "Codecs"):

* ``f32``: ``numel`` float32.  ``bf16``: ``numel`` bfloat16 (upper 16 bits of the float32, rounded to
  nearest even).
* block codecs: ``nblocks = ceil(numel / block)`` float32 scales first, then the codes.  ``int8``: one
  int8 per value, ``q = rint(x * 127 / absmax)``, scale ``absmax / 127``.  ``int4``: ``ceil(numel / 2)``
  bytes, value ``2i`` in the low nibble of byte ``i`` and value ``2i+1`` in the high nibble, nibble
  ``q + 8`` with ``q = rint(x * 7 / absmax)`` in [-7, 7], scale ``absmax / 7``.  ``int4-log``: same
  packing, nibble ``sign << 3 | level``; level 0 is exactly zero, level ``L`` in 1..7 is
  ``absmax * 2**(L - 7)``; scale ``absmax``.  ``int1``: ``ceil(numel / 8)`` bytes, bit ``i % 8`` of byte
  ``i // 8`` set when value ``i`` is negative (padding bits zero), value ``(1 - 2 bit) * scale``; scale the
  block's mean ``|x|`` (summed exactly in integers: codec_kernels.int1_scales); the block a multiple of 8.

The work is done over cache-sized pieces (whole blocks) with preallocated per-thread scratch, optionally on
a small thread pool over disjoint pieces; results are bit-identical for any thread count.  The per-piece
kernels live in :mod:`.codec_kernels`; this module checks arguments and dispatches.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import codec_jit, codec_names, sparse
from .codec_kernels import BLOCK_ENCODERS, DECODERS, F32, LIMIT, enc_bf16, enc_f32, validate_plain
from .frames import CodecError
from .pieces import nblocks as _nblocks
from .pieces import run as _run
from .pieces import set_threads

__all__ = ["CODECS", "DEFAULT_BLOCK", "encoded_nbytes", "encode", "decode", "decode_accumulate", "decode_range",
           "residual", "set_threads", "check_codec", "check_encoded", "splice", "sparse_sumsq"]

CODECS = codec_names.DENSE   # the fixed names; the sparse family is codec_names.sparse(name)
DEFAULT_BLOCK = 256
MAX_BLOCK = 1 << 24
# the largest valid scale of each block codec (LIMIT: the largest |x| they encode; codec_kernels.py)
_MAX_SCALE = {"int8": np.float32(LIMIT / 127), "int4": np.float32(LIMIT / 7), "int4-log": np.float32(LIMIT),
              "int1": np.float32(LIMIT)}
_PER_BYTE = {"int8": 1, "int4": 2, "int4-log": 2, "int1": 8}   # values per code byte


# ---------------------------------------------------------------------------------------------- helpers
def check_codec(codec: str, block: int = DEFAULT_BLOCK) -> None:
    if not codec_names.known(codec):
        shown = repr(codec[:codec_names.MAX_NAME]) if isinstance(codec, str) else type(codec).__name__
        raise CodecError(f"unknown codec {shown} (known: {codec_names.describe()})")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not 1 <= block <= MAX_BLOCK:
        raise CodecError(f"block must be an integer in [1, {MAX_BLOCK}], got {block!r}")
    why = codec_names.block_refusal(codec, int(block))
    if why:
        raise CodecError(why)
    spec = codec_names.sparse(codec)
    if spec is not None:
        sparse.check_block(spec, int(block))


def _sparse_layout(codec: str, numel: int, block: int):
    spec = codec_names.sparse(codec)
    return None if spec is None else sparse.layout(spec, int(numel), int(block))


def encoded_nbytes(codec: str, numel: int, block: int = DEFAULT_BLOCK) -> int:
    """Exact size in bytes of ``encode(codec, x)`` for ``x`` of ``numel`` values."""
    check_codec(codec, block)
    if numel < 0:
        raise CodecError(f"numel must be >= 0, got {numel}")
    if codec == "f32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    lay = _sparse_layout(codec, numel, block)
    if lay is not None:
        return lay.nbytes
    per = _PER_BYTE[codec]
    return 4 * _nblocks(numel, block) + (numel + per - 1) // per


def _code_bytes(codec: str, lo: int, hi: int) -> slice:
    """The code bytes of values [lo, hi) (lo a multiple of the block, so of the values per byte)."""
    per = _PER_BYTE[codec]
    return slice(lo // per, (hi + per - 1) // per)


def _as_input(x, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise CodecError(f"{name}: expected a numpy float32 array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise CodecError(f"{name}: expected float32, got {x.dtype}")
    if x.ndim != 1:
        raise CodecError(f"{name}: expected a flat 1-D array, got shape {x.shape}")
    return np.ascontiguousarray(x)


def _as_bytes(buf) -> np.ndarray:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise CodecError(f"encoded data must be a bytes-like object, got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise CodecError("encoded data must be contiguous")
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)


# ----------------------------------------------------------------------------------------------- encode
def encode(codec: str, x: np.ndarray, block: int = DEFAULT_BLOCK, name: str = "tensor", *,
           out: Optional[np.ndarray] = None, threads: Optional[int] = None) -> np.ndarray:
    """Encode the flat float32 ``x``; returns (or fills ``out``, a uint8 array of ``encoded_nbytes``)."""
    check_codec(codec, block)
    x = _as_input(x, name)
    n = x.size
    nbytes = encoded_nbytes(codec, n, block)
    if out is None:
        out = np.empty(nbytes, np.uint8)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == (nbytes,)
              and out.flags.c_contiguous):
        raise CodecError(f"out must be a contiguous uint8 array of {nbytes} bytes")
    if n == 0:
        return out
    if codec == "f32":
        _run(n, block, lambda a, b: enc_f32(x, out, a, b, name), threads)
    elif codec == "bf16":
        _run(n, block, lambda a, b: enc_bf16(x, out, a, b, name), threads)
    elif codec_names.sparse(codec):
        lay = _sparse_layout(codec, n, block)
        _run(n, block, lambda a, b: sparse.encode_piece(lay, x, out, a, b, name), threads)
    else:
        nb = _nblocks(n, block)
        scales = out[: 4 * nb].view(F32)
        codes = out[4 * nb:]
        fn = codec_jit.encoder(codec) or BLOCK_ENCODERS[codec]
        _run(n, block, lambda a, b: fn(x, scales, codes, a, b, block, name), threads)
    return out


# ----------------------------------------------------------------------------------------------- decode
def _sized_bytes(codec, buf, numel, block):
    b = _as_bytes(buf)
    want = encoded_nbytes(codec, numel, block)
    if b.size != want:
        raise CodecError(f"{codec} data for {numel} values (block {block}) must be {want} bytes, got {b.size}")
    return b


def _check_decode_args(codec, buf, numel, block):
    check_codec(codec, block)
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
        raise CodecError(f"numel must be a non-negative integer, got {numel!r}")
    b = _sized_bytes(codec, buf, int(numel), block)
    scales = None
    lay = _sparse_layout(codec, numel, block)
    if lay is not None:   # scales, indices and padding, all checked here: data that passes decodes
        sparse.validate(lay, b)
        return b, lay
    if codec not in ("f32", "bf16"):
        nb = _nblocks(int(numel), block)
        raw = b[: 4 * nb]
        scales = raw.view(F32) if raw.ctypes.data % 4 == 0 else raw.copy().view(F32)
        ok = (scales >= 0) & (scales <= _MAX_SCALE[codec])  # False for NaN
        if nb and not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise CodecError(f"{codec} data has an invalid scale {scales[bad]!r} in block {bad} "
                             f"(scales must be finite, >= 0 and <= {float(_MAX_SCALE[codec]):.3e})",
                             code="nonfinite")
        b = b[4 * nb:]
        if codec == "int1" and numel % 8 and b[-1] >> (numel % 8):
            raise CodecError(f"int1 data has set padding bits after value {numel - 1} (they must be zero)")
    return b, scales


def check_encoded(codec: str, buf, numel: int, block: int = DEFAULT_BLOCK, *, threads: Optional[int] = None) -> None:
    """Validate encoded data without decoding it, exactly as the decoders do: length, scales (block codecs),
    finite values (f32/bf16). Raises :class:`CodecError`; data that passes decodes without error."""
    codes, _ = _check_decode_args(codec, buf, numel, block)
    if codec in ("f32", "bf16") and numel:
        _run(int(numel), block, lambda a, b: validate_plain(codec, codes, a, b), threads)


def decode(codec: str, buf, numel: int, block: int = DEFAULT_BLOCK, out: Optional[np.ndarray] = None, *,
           threads: Optional[int] = None) -> np.ndarray:
    """Decode ``buf`` into ``out`` (or a new float32 array of ``numel``); validates length and scales."""
    codes, scales = _check_decode_args(codec, buf, numel, block)
    numel = int(numel)
    if out is None:
        out = np.empty(numel, np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (numel,)
              and out.flags.c_contiguous and out.flags.writeable):
        raise CodecError(f"out must be a writeable contiguous float32 array of shape ({numel},)")
    if numel:
        fn = _decoder(codec)
        _run(numel, block, lambda a, b: fn(codes, scales, out, a, b, block, None, 1.0), threads)
    return out


def _decoder(codec: str):
    fused = codec_jit.decoder(codec)
    if fused is not None:
        return fused
    if codec in DECODERS:
        return DECODERS[codec]
    return lambda codes, lay, out, a, b, block, acc, w: sparse.decode_piece(lay, codes, out, a, b, acc, w)


def decode_range(codec: str, buf, numel: int, start: int, count: int, block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Values ``[start, start + count)`` of ``decode(codec, buf, numel, block)``, bit-identical, decoding only the
    blocks that cover them (bounded memory when a large encoded vector is consumed piece by piece)."""
    check_codec(codec, block)
    numel, start, count = int(numel), int(start), int(count)
    if start < 0 or count < 0 or start + count > numel:
        raise CodecError(f"range [{start}, {start + count}) is outside the {numel} encoded values")
    b = _sized_bytes(codec, buf, numel, block)
    if count == 0:
        return np.empty(0, np.float32)
    if codec in ("f32", "bf16"):
        w = 4 if codec == "f32" else 2
        return decode(codec, b[w * start: w * (start + count)], count, block)
    nb = _nblocks(numel, block)
    b0, b1 = start // block, _nblocks(start + count, block)
    lo, hi = b0 * block, min(b1 * block, numel)        # whole blocks (block is even for the nibble codecs)
    lay = _sparse_layout(codec, numel, block)
    if lay is not None:
        out = decode(codec, sparse.sub_buffer(lay, b, b0, b1), hi - lo, block)
        return out[start - lo: start - lo + count]
    sub = np.concatenate([b[4 * b0: 4 * b1], b[4 * nb:][_code_bytes(codec, lo, hi)]])
    out = decode(codec, sub, hi - lo, block)
    return out[start - lo: start - lo + count]


def decode_accumulate(codec: str, buf, numel: int, weight: float, acc: np.ndarray, block: int = DEFAULT_BLOCK,
                      *, threads: Optional[int] = None) -> np.ndarray:
    """``acc += weight * decode(buf)``, piece by piece (no full-size temporary). Returns ``acc``.

    All data is validated before ``acc`` is touched, so a bad buffer leaves ``acc`` unchanged."""
    codes, scales = _check_decode_args(codec, buf, numel, block)
    numel = int(numel)
    if not (isinstance(acc, np.ndarray) and acc.dtype == np.float32 and acc.shape == (numel,)
            and acc.flags.c_contiguous and acc.flags.writeable):
        raise CodecError(f"acc must be a writeable contiguous float32 array of shape ({numel},)")
    w = float(weight)
    if not np.isfinite(w):
        raise CodecError(f"weight must be finite, got {weight!r}", code="nonfinite")
    if numel:
        if codec in ("f32", "bf16"):  # no scales were checked: validate the values first (acc unchanged)
            _run(numel, block, lambda a, b: validate_plain(codec, codes, a, b), threads)
        fn = _decoder(codec)
        _run(numel, block, lambda a, b: fn(codes, scales, None, a, b, block, acc, w), threads)
    return acc


def residual(codec: str, x: np.ndarray, block: int = DEFAULT_BLOCK, name: str = "tensor", *,
             out: Optional[np.ndarray] = None, threads: Optional[int] = None) -> np.ndarray:
    """Error feedback: ``x - decode(encode(x))`` (what the wire lost), to carry into the next push."""
    enc = encode(codec, x, block, name, threads=threads)
    x = _as_input(x, name)
    out = decode(codec, enc, x.size, block, out=out, threads=threads)
    np.subtract(x, out, out=out)
    return out


def splice(codec: str, body: np.ndarray, enc: np.ndarray, pos: int, n: int, numel: int,
           block: int = DEFAULT_BLOCK) -> None:
    """Copy ``enc``, the encoding of values ``[pos, pos + n)`` of a vector of ``numel`` (``pos`` a multiple of the
    block, and of 2 for the plain codecs), to its places in ``body``, the encoding of the whole vector: a vector
    can be encoded piece by piece into its final layout, bit-identical to encoding it at once."""
    check_codec(codec, block)
    enc = enc.view(np.uint8)
    if enc.size != encoded_nbytes(codec, n, block) or body.size != encoded_nbytes(codec, numel, block) \
            or pos < 0 or pos + n > numel or (codec_names.is_blockwise(codec) and pos % block):
        raise CodecError(f"{codec}: cannot place {enc.size} bytes of values [{pos}, {pos + n}) in the encoding "
                         f"of {numel} values (block {block})")
    if codec in ("f32", "bf16"):
        w = 4 if codec == "f32" else 2
        body[w * pos: w * pos + enc.size] = enc
        return
    lay = _sparse_layout(codec, numel, block)
    if lay is not None:
        sparse.splice(lay, body, enc, pos, n)
        return
    nb, nbp, b0 = _nblocks(numel, block), _nblocks(n, block), pos // block
    body[4 * b0: 4 * (b0 + nbp)] = enc[: 4 * nbp]
    body[4 * nb:][_code_bytes(codec, pos, pos + n)] = enc[4 * nbp:]

def sparse_sumsq(codec: str, buf, numel: int, block: int = DEFAULT_BLOCK) -> tuple:
    """(sum of squares, largest block mean square) of a sparse-codec body, validated first, from its scales and
    a table of squared codes (no decode): the syncer's norm guard."""
    b, lay = _check_decode_args(codec, buf, numel, block)
    if lay is None or not isinstance(lay, sparse.Layout):
        raise CodecError(f"{codec} is not a sparse codec")
    return sparse.block_sumsq(lay, b)
