"""The codecs' arithmetic on one piece of a flat float32 vector: the encoders and decoders that
``codecs.py`` runs over block-aligned pieces (``pieces.run``), with the block helpers and constants they share.

Separate from ``codecs.py``, which is the public API (argument and length checks, scale validation, dispatch):
these kernels trust their arguments and only refuse values (non-finite, out of range). Formats: codecs.py.
"""
from __future__ import annotations

import sys

import numpy as np

from .frames import CodecError
from .pieces import PIECE as _PIECE
from .pieces import nblocks as _nblocks
from .pieces import scratch as _scratch

if sys.byteorder != "little":  # the bit manipulations below assume a little-endian host
    raise ImportError("yeto_patch.wire.codecs requires a little-endian host")

__all__ = ["F32", "LIMIT", "TINY", "enc_f32", "enc_bf16", "BLOCK_ENCODERS", "DECODERS", "validate_plain",
           "int1_scales", "INT1_UNIT_EXP"]

F32 = np.dtype("<f4")
#: Largest |x| the block codecs accept (so that q * scale can never round to inf on decode).
LIMIT = float(np.float32(3e38))
_LIMIT_BITS = int(np.float32(LIMIT).view(np.int32))
_FLT_MAX = float(np.finfo(np.float32).max)
# Adding 1.5 * 2**23 to a float32 in [-2**22, 2**22] rounds it to the nearest integer (ties to even) and
# leaves that integer in the low mantissa bits: bits(v + MAGIC) - bits(MAGIC) == rint(v).
_MAGIC = np.float32(12582912.0)
# int4 (linear): nibble = q + 8, so add 8 before the magic rounding (exact: integers are exact there).
_MAGIC8 = np.float32(12582912.0 + 8.0)
_C120_U8 = np.full(_PIECE, 120, np.uint8)  # read-only constant operand (see _enc_int4log)
_C120_U8.flags.writeable = False


# ---------------------------------------------------------------------------------------------- helpers
def _nonfinite(x: np.ndarray, name: str, offset: int) -> CodecError:
    bad = np.flatnonzero(~np.isfinite(x))
    i = int(bad[0]) if bad.size else 0
    return CodecError(f"{name}: non-finite value {x[i]!r} at index {offset + i}; refusing to encode",
                      code="nonfinite")


def _blocks(a: np.ndarray, block: int):
    """Split 1-D ``a`` into a (nfull, block) view and a tail (possibly empty)."""
    nfull = a.size // block
    return a[: nfull * block].reshape(nfull, block), a[nfull * block:]


def _block_absmax_bits(absbits: np.ndarray, block: int, out: np.ndarray) -> None:
    """Per-block maximum of ``absbits`` (the int32 bit patterns of |x|: same order as the floats, and any
    NaN/inf compares above every finite value)."""
    full, tail = _blocks(absbits, block)
    if full.size:
        np.maximum.reduce(full, axis=1, out=out[: full.shape[0]])
    if tail.size:
        out[-1] = tail.max()


def _block_mul(a: np.ndarray, f: np.ndarray, block: int, out: np.ndarray) -> None:
    """``out = a * f[block index]`` (one factor per block; ``f`` has ``ceil(a.size / block)`` entries).

    The factors are expanded to one per element first so that the multiply runs on two contiguous operands:
    numpy's broadcast multiply over (nblocks, block) rows is ~2x slower, and ``np.repeat`` is ~2x faster
    than a broadcasting copy into scratch."""
    m = a.size
    e = np.repeat(f[: _nblocks(m, block)], block)
    np.multiply(a, e[:m], out=out)


def _tiny(k: float) -> np.float32:
    """Smallest absmax for which float32(k / absmax) is finite (absmax below it is clamped up to it)."""
    t = np.float32(k / _FLT_MAX * (1 + 2.0 ** -20))
    assert np.isfinite(np.float32(k) / t)
    return t


TINY = {k: _tiny(k) for k in (127.0, 7.0, 4.0 / 3.0)}


# ----------------------------------------------------------------------------------------------- encode
def enc_f32(x, out, a, b, name):
    xs = x[a:b]
    if not np.isfinite(xs).all():
        raise _nonfinite(xs, name, a)
    out[4 * a: 4 * b].view(F32)[:] = xs


_BF16_OVERFLOW = 0x7F7F8000  # |bits| >= this rounds to inf (or is inf / nan)


def enc_bf16(x, out, a, b, name):
    xs = x[a:b]
    m = b - a
    bits = xs.view(np.uint32)
    t = _scratch("u32a", m, np.uint32)
    np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=t)
    if t.max() >= _BF16_OVERFLOW:
        if not np.isfinite(xs).all():
            raise _nonfinite(xs, name, a)
        i = int(np.flatnonzero(t >= _BF16_OVERFLOW)[0])
        raise CodecError(f"{name}: value {xs[i]!r} at index {a + i} overflows bfloat16; refusing to encode")
    # round to nearest even: bits + 0x7FFF + ((bits >> 16) & 1), keep the upper half
    np.right_shift(bits, np.uint32(16), out=t)
    np.bitwise_and(t, np.uint32(1), out=t)
    t += np.uint32(0x7FFF)
    t += bits
    t >>= np.uint32(16)
    np.copyto(out[2 * a: 2 * b].view(np.uint16), t, casting="unsafe")


def _checked_absmax(x, a, b, block, name):
    """(xs = x[a:b], |xs| in a float32 scratch, each block's absmax in a float32 scratch), refusing a non-finite
    value or one beyond LIMIT with the block codecs' message."""
    xs = x[a:b]
    ab = _scratch("f32a", b - a, np.float32)
    abits = ab.view(np.int32)
    np.bitwise_and(xs.view(np.int32), np.int32(0x7FFFFFFF), out=abits)
    amax = _scratch("amax", _nblocks(b - a, block), np.float32)
    _block_absmax_bits(abits, block, amax.view(np.int32))
    if amax.view(np.int32).max() > _LIMIT_BITS:
        if not np.isfinite(xs).all():
            raise _nonfinite(xs, name, a)
        i = int(np.flatnonzero(np.abs(xs) > LIMIT)[0])
        raise CodecError(f"{name}: value {xs[i]!r} at index {a + i} is beyond the block codecs' range "
                         f"(|x| <= {LIMIT:.1e}); refusing to encode")
    return xs, ab, amax


def _enc_prologue(x, scales, a, b, block, name, k, scale_div):
    """Per-block absmax of x[a:b]; writes scales (absmax / scale_div) and returns
    (xs, |xs| in a float32 scratch, inv = float32(k / max(absmax, tiny)))."""
    xs, ab, amax = _checked_absmax(x, a, b, block, name)
    nb = amax.size
    j = a // block
    np.divide(amax, np.float32(scale_div), out=scales[j: j + nb])
    kf = np.float32(k)
    inv = _scratch("inv", nb, np.float32)
    np.maximum(amax, TINY[k], out=inv)
    np.divide(kf, inv, out=inv)
    return xs, ab, inv


def _enc_int8(x, scales, codes, a, b, block, name):
    xs, t, inv = _enc_prologue(x, scales, a, b, block, name, 127.0, 127.0)
    _block_mul(xs, inv, block, t)  # t = x * 127 / absmax, in [-127, 127]
    t += _MAGIC
    ti = t.view(np.int32)
    np.copyto(codes[a:b].view(np.int8), ti, casting="unsafe")  # low byte of bits = rint(v) (two's complement)


def _pack_nibbles(u: np.ndarray, dst: np.ndarray) -> None:
    """dst[i] = u[2i] | u[2i+1] << 4 for uint8 nibbles 0..15 (odd length: the last high nibble is 0)."""
    m = u.size
    even = m - (m & 1)
    v = u[:even].view(np.uint16)  # little-endian: low byte = value 2i, high byte = value 2i+1
    w = _scratch("pk16", even // 2, np.uint16)
    np.right_shift(v, 4, out=w)  # high value's nibble lands in bits 4..7 (the low value, <= 15, shifts out)
    w |= v
    np.copyto(dst[: even // 2], w, casting="unsafe")  # keeps the low byte
    if m & 1:
        dst[even // 2] = u[m - 1]


def _enc_int4(x, scales, codes, a, b, block, name):
    xs, t, inv = _enc_prologue(x, scales, a, b, block, name, 7.0, 7.0)
    _block_mul(xs, inv, block, t)  # in [-7, 7]
    t += _MAGIC8  # low byte of the bits = rint(v) + 8 (the magic's low byte is 0)
    u = _scratch("pk8", t.size, np.uint8)
    np.copyto(u, t.view(np.int32), casting="unsafe")
    _pack_nibbles(u, codes[a // 2: (b + 1) // 2])


def _enc_int4log(x, scales, codes, a, b, block, name):
    # level = clamp(floor(log2(4/3 * |x| / absmax)) + 7, 0, 7): value levels absmax * 2**(L-7), L >= 1,
    # with thresholds at 3/4 of each level (nearest level in linear distance between neighbours).
    xs, t, inv = _enc_prologue(x, scales, a, b, block, name, 4.0 / 3.0, 1.0)
    m = xs.size
    _block_mul(t, inv, block, t)
    ti = t.view(np.int32)
    ti >>= 23  # biased exponent E (t >= 0); t <= 4/3 (1 + eps) so E <= 127: fits a byte
    e = _scratch("pk8", m, np.uint8)
    np.copyto(e, ti, casting="unsafe")
    # the rest on bytes (4x less traffic); array operands: numpy's scalar maximum is several times slower
    np.maximum(e, _C120_U8[:m] if m <= _C120_U8.size else np.uint8(120), out=e)
    e -= np.uint8(113)  # level + 7: 7..14; bit 3 set iff level >= 1
    sg = _scratch("sgn", m, np.bool_).view(np.uint8)
    np.signbit(xs, out=sg.view(np.bool_))
    np.multiply(sg, np.uint8(8), out=sg)  # sign << 3 (numpy's uint8 shift is not vectorized; multiply is)
    sg &= e  # keep the sign only on non-zero levels
    e -= np.uint8(7)
    e |= sg
    _pack_nibbles(e, codes[a // 2: (b + 1) // 2])


#: int1 sums magnitudes as integers in units of 2**(E - INT1_UNIT_EXP), E the biased exponent of the block's
#: largest |x| (at least 1): each |x| keeps its top 31 bits below that binade's top, truncated
INT1_UNIT_EXP = 127 + 23 + 7


def int1_scales(abits: np.ndarray, amax_bits: np.ndarray, block: int) -> np.ndarray:
    """int1's scales: per block, its mean |x| (``abits``: the int32 bits of |x|; ``amax_bits``: each block's
    largest), computed exactly in integers so that any order of summing (numpy, numba, threads) gives the same
    bits. Each |x| = mant * 2**(e - 150) (mant with its implicit bit; e >= 1) counts as the integer
    ``(mant << 7) >> min(31, E - e)``, below 2**31; the block's int64 sum, times 2**(E - 157) (exact in float64),
    divided by the block's size (float64) and rounded once to float32 is the scale."""
    m = abits.size
    nb = amax_bits.size
    e_blk = np.maximum(amax_bits >> 23, 1)
    ex = abits >> 23
    mant = (abits & np.int32(0x7FFFFF)) | ((ex > 0).astype(np.int32) << 23)
    shift = np.minimum(np.repeat(e_blk, block)[:m] - np.maximum(ex, 1), 31)
    q = np.right_shift(mant << 7, shift)
    starts = np.arange(0, m, block)
    sums = np.add.reduceat(q.astype(np.int64), starts) if m else np.zeros(0, np.int64)
    sizes = np.full(nb, float(block))
    sizes[-1] = m - block * (nb - 1)
    unit = np.ldexp(1.0, e_blk.astype(np.int64) - INT1_UNIT_EXP)
    return (sums.astype(np.float64) * unit / sizes).astype(np.float32)


def _enc_int1(x, scales, codes, a, b, block, name):
    # scale = the block's mean |x| (int1_scales: exact integer sums), the least squared error for the sign
    # pattern; bit i of byte i // 8 (LSB first) = sign of value i
    xs, ab, amax = _checked_absmax(x, a, b, block, name)
    m, nb = b - a, amax.size
    j = a // block
    scales[j: j + nb] = int1_scales(ab.view(np.int32), amax.view(np.int32), block)
    sg = _scratch("sgn", m, np.bool_)
    np.signbit(xs, out=sg)
    codes[a // 8: (b + 7) // 8] = np.packbits(sg, bitorder="little")


BLOCK_ENCODERS = {"int8": _enc_int8, "int4": _enc_int4, "int4-log": _enc_int4log, "int1": _enc_int1}


# ----------------------------------------------------------------------------------------------- decode
def _lut_pairs(values16: np.ndarray) -> np.ndarray:
    """256-entry table: byte -> the two float32 values of its low and high nibble, as one uint64."""
    lo = np.tile(values16.astype(np.float32), 16)
    hi = np.repeat(values16.astype(np.float32), 16)
    pair = np.empty((256, 2), np.float32)
    pair[:, 0], pair[:, 1] = lo, hi
    return pair.view(np.uint64).reshape(256)


_LOG_LEVELS = np.array([0.0] + [2.0 ** (k - 7) for k in range(1, 8)], np.float32)
_LUT_INT4LOG = _lut_pairs(np.concatenate([_LOG_LEVELS, -_LOG_LEVELS]))
_LUT_INT4LOG_F = _LUT_INT4LOG.view(np.float32).reshape(256, 2)


def validate_plain(codec, codes, a, b):
    """Refuse a non-finite value among values [a, b) of f32 or bf16 ``codes`` (CodecError "nonfinite")."""
    if codec == "f32":
        v = codes[4 * a: 4 * b].view(F32)
        if not np.isfinite(v).all():
            i = int(np.flatnonzero(~np.isfinite(v))[0])
            raise CodecError(f"f32 data has a non-finite value at index {a + i}", code="nonfinite")
    else:
        u = codes[2 * a: 2 * b].view(np.uint16)
        t = _scratch("u16", u.size, np.uint16)
        np.bitwise_and(u, np.uint16(0x7F80), out=t)
        if t.max() == 0x7F80:
            i = int(np.flatnonzero(t == 0x7F80)[0])
            raise CodecError(f"bf16 data has a non-finite value at index {a + i}", code="nonfinite")


def _finish(dst, a, b, acc, w, scratch_used):
    """Accumulate a decoded piece held in ``dst`` into acc (when accumulating)."""
    if acc is not None:
        np.add(acc[a:b], dst, out=acc[a:b])


def _target(out, a, b, acc):
    return out[a:b] if acc is None else _scratch("dec", b - a, np.float32)


def _dec_f32(codes, scales, out, a, b, block, acc, w):
    v = codes[4 * a: 4 * b].view(F32)
    if acc is not None:
        if w == 1.0:
            np.add(acc[a:b], v, out=acc[a:b])
        else:
            d = _scratch("dec", b - a, np.float32)
            np.multiply(v, np.float32(w), out=d)
            np.add(acc[a:b], d, out=acc[a:b])
        return
    if not np.isfinite(v).all():
        i = int(np.flatnonzero(~np.isfinite(v))[0])
        raise CodecError(f"f32 data has a non-finite value at index {a + i}", code="nonfinite")
    out[a:b] = v


def _dec_bf16(codes, scales, out, a, b, block, acc, w):
    u = codes[2 * a: 2 * b].view(np.uint16)
    if acc is None:
        t = _scratch("u16", u.size, np.uint16)
        np.bitwise_and(u, np.uint16(0x7F80), out=t)
        if t.max() == 0x7F80:
            i = int(np.flatnonzero(t == 0x7F80)[0])
            raise CodecError(f"bf16 data has a non-finite value at index {a + i}", code="nonfinite")
    d = _target(out, a, b, acc)
    di = d.view(np.uint32)
    np.copyto(di, u, casting="unsafe")
    di <<= np.uint32(16)
    if acc is not None:
        if w != 1.0:
            d *= np.float32(w)
        np.add(acc[a:b], d, out=acc[a:b])


def _piece_scales(scales, a, b, block, w):
    j = a // block
    s = scales[j: j + _nblocks(b - a, block)]
    if w != 1.0:
        t = _scratch("ws", s.size, np.float32)
        np.multiply(s, np.float32(w), out=t)
        s = t
    return s


def _dec_int8(codes, scales, out, a, b, block, acc, w):
    d = _target(out, a, b, acc)
    np.copyto(d, codes[a:b].view(np.int8), casting="unsafe")
    _block_mul(d, _piece_scales(scales, a, b, block, w), block, d)
    _finish(d, a, b, acc, w, True)


def _dec_nibbles(lut_u64, lut_f, codes, scales, out, a, b, block, acc, w):
    d = _target(out, a, b, acc)
    m = b - a
    even = m - (m & 1)
    src = codes[a // 2: (b + 1) // 2]
    np.take(lut_u64, src[: even // 2], out=d[:even].view(np.uint64), mode="clip")  # uint8: in range
    if m & 1:
        d[-1] = lut_f[src[-1], 0]
    _block_mul(d, _piece_scales(scales, a, b, block, w), block, d)
    _finish(d, a, b, acc, w, True)


def _dec_int4(codes, scales, out, a, b, block, acc, w):
    # unpack on 16-bit words (byte -> its two nibbles in two bytes), widen, subtract 8, scale:
    # cheaper than the 256-entry pair table used for int4-log
    d = _target(out, a, b, acc)
    m = b - a
    src = codes[a // 2: (b + 1) // 2]
    u = _scratch("up16a", src.size, np.uint16)
    v = _scratch("up16b", src.size, np.uint16)
    np.copyto(u, src)
    np.multiply(u, np.uint16(16), out=v)  # u << 4 (a multiply vectorizes, a 16-bit shift does not)
    v |= u
    v &= np.uint16(0x0F0F)  # little-endian: low byte = low nibble (value 2i), high byte = value 2i+1
    np.copyto(d, v.view(np.uint8)[:m])
    d -= np.float32(8)
    _block_mul(d, _piece_scales(scales, a, b, block, w), block, d)
    _finish(d, a, b, acc, w, True)


def _dec_int4log(codes, scales, out, a, b, block, acc, w):
    _dec_nibbles(_LUT_INT4LOG, _LUT_INT4LOG_F, codes, scales, out, a, b, block, acc, w)


def _dec_int1(codes, scales, out, a, b, block, acc, w):
    d = _target(out, a, b, acc)
    m = b - a
    bits = np.unpackbits(codes[a // 8: (b + 7) // 8], count=m, bitorder="little")
    np.multiply(bits, np.float32(-2.0), out=d)
    d += np.float32(1.0)   # +1 or -1, exactly
    _block_mul(d, _piece_scales(scales, a, b, block, w), block, d)
    _finish(d, a, b, acc, w, True)


DECODERS = {"f32": _dec_f32, "bf16": _dec_bf16, "int8": _dec_int8, "int4": _dec_int4, "int4-log": _dec_int4log,
            "int1": _dec_int1}
