"""The sparse codec family ``topk:F+intB``: layout, per-piece encoder and decoder, validation, and the per-block
figures the syncer's norm guard needs. ``codecs.py`` is the public API and dispatches here.

Layout of ``numel`` values in ``nb = ceil(numel / block)`` blocks, ``K = per_block(block)`` kept values per full
block and ``k_last = min(K, size of the last block)`` in the last one (all little-endian; docs/protocol.md):

* ``nb`` float32 scales;
* the indices, block after block: ``K`` (``k_last``) positions inside the block, strictly increasing, each an
  unsigned integer of ``W`` bytes (``W = 1`` when ``block <= 256``, else 2);
* the values, block after block: ``ceil(K * B / 8)`` bytes each, value ``j`` in bits ``[j*B, j*B + B)`` (LSB
  first), unused bits zero. A code is ``sign << (B-1) | m`` with ``m`` in ``[0, 2**(B-1) - 1]``; it decodes to
  ``(-1)**sign * float32(m / (2**(B-1) - 1)) * scale`` (``m = 0`` is +0 whatever the sign bit).

Encoder (the reference the tests compare with): the ``K`` largest ``|x|`` of the block, ties to the lower index;
``scale`` = the block's absmax for ``B >= 4`` (``m = rint(|x| * L / scale)``, ``L = 2**(B-1) - 1``), and for
``B = 2`` (sign or zero) the mean magnitude of the kept non-zero values (their float64 sum in index order, over
their count, as float32; ``m = 1`` when ``|x| >= scale / 2``).
What is not sent is carried by the island's error feedback (``codecs.residual``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import codec_jit, codec_names
from .codec_kernels import F32, LIMIT
from .frames import CodecError

__all__ = ["Layout", "layout", "check_block", "encode_piece", "decode_piece", "validate", "block_sumsq",
           "sub_buffer", "splice"]

_FLT_MAX = float(np.finfo(np.float32).max)
# per bits: the smallest scale for which float32(L / scale) is finite (a smaller one, zero included, is raised to it)
_TINY = {b: np.float32(((1 << (b - 1)) - 1) / _FLT_MAX * (1 + 2.0 ** -20)) for b in codec_names.SPARSE_BITS}


class Layout(NamedTuple):
    spec: codec_names.Sparse
    numel: int
    block: int
    nb: int
    nfull: int        # full blocks
    tail: int         # size of the last block when it is partial (0: none)
    k: int            # kept per full block
    k_last: int       # kept in the partial last block (0: none)
    width: int        # bytes per index
    vb: int           # value bytes per full block
    vb_last: int      # value bytes of the partial last block
    off_idx: int
    off_val: int
    nbytes: int


def check_block(spec: codec_names.Sparse, block: int) -> None:
    if block > codec_names.SPARSE_MAX_BLOCK:
        raise CodecError(f"codec {spec.name} needs a block of at most {codec_names.SPARSE_MAX_BLOCK}, got {block}")


def layout(spec: codec_names.Sparse, numel: int, block: int) -> Layout:
    nb = -(-numel // block)
    nfull = numel // block
    tail = numel - nfull * block
    k = spec.per_block(block)
    k_last = min(k, tail)
    width = 1 if block <= 256 else 2
    vb, vb_last = (k * spec.bits + 7) // 8, (k_last * spec.bits + 7) // 8
    ktot = nfull * k + k_last
    off_idx = 4 * nb
    off_val = off_idx + width * ktot
    return Layout(spec, numel, block, nb, nfull, tail, k, k_last, width, vb, vb_last, off_idx, off_val,
                  off_val + nfull * vb + vb_last)


# ------------------------------------------------------------------------------------------------ code tables
def _levels(bits: int) -> np.ndarray:
    """code -> float32 factor of the scale (2**bits entries)."""
    lm = (1 << (bits - 1)) - 1
    m = np.arange(1 << (bits - 1))
    pos = (m / lm).astype(np.float32)
    return np.concatenate([pos, -pos]).astype(np.float32) + np.float32(0.0)   # -0.0 + 0.0 = +0.0


_LEVELS = {b: _levels(b) for b in codec_names.SPARSE_BITS}


def _byte_sumsq(bits: int) -> np.ndarray:
    """code byte -> the sum of its codes' squared factors (float64), for the guard's per-block figures."""
    lv = _LEVELS[bits].astype(np.float64) ** 2
    per = 8 // bits
    b = np.arange(256)
    out = np.zeros(256)
    for j in range(per):
        out += lv[(b >> (j * bits)) & ((1 << bits) - 1)]
    return out


_BYTE_SUMSQ = {b: _byte_sumsq(b) for b in codec_names.SPARSE_BITS}


def _pack(codes: np.ndarray, bits: int, nbytes: int) -> np.ndarray:
    """(rows, k) uint8 codes -> (rows, nbytes) bytes, value j in bits [j*bits, j*bits+bits) (LSB first)."""
    if bits == 8:
        return codes
    per = 8 // bits
    rows, k = codes.shape
    c = np.zeros((rows, nbytes * per), np.uint8)
    c[:, :k] = codes
    c = c.reshape(rows, nbytes, per)
    out = c[:, :, 0].copy()
    for j in range(1, per):
        out |= c[:, :, j] << np.uint8(j * bits)
    return out


def _unpack(data: np.ndarray, bits: int, k: int) -> np.ndarray:
    """(rows, nbytes) bytes -> (rows, k) uint8 codes."""
    if bits == 8:
        return data[:, :k]
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    rows, nbytes = data.shape
    out = np.empty((rows, nbytes, per), np.uint8)
    for j in range(per):
        np.bitwise_and(data >> np.uint8(j * bits), mask, out=out[:, :, j])
    return out.reshape(rows, nbytes * per)[:, :k]


# ------------------------------------------------------------------------------------------------------ encode
def _select(a: np.ndarray, k: int) -> np.ndarray:
    """(rows, n) magnitudes -> (rows, k) column indices of the k largest per row, ties to the lower index,
    increasing."""
    rows, n = a.shape
    if k == n:
        return np.broadcast_to(np.arange(n), (rows, n))
    t = np.partition(a, n - k, axis=1)[:, n - k: n - k + 1]    # the k-th largest of each row
    gt = a > t
    eq = a == t
    need = k - gt.sum(axis=1, keepdims=True)
    sel = gt | (eq & (np.cumsum(eq, axis=1) <= need))
    return np.nonzero(sel)[1].reshape(rows, k)


def _encode_rows(xr: np.ndarray, k: int, bits: int):
    """(rows, n) float32 -> (scales, indices (rows, k), codes (rows, k) uint8)."""
    a = np.abs(xr)
    cols = _select(a, k)
    kept = np.take_along_axis(xr, cols, axis=1)
    ak = np.abs(kept)
    lm = (1 << (bits - 1)) - 1
    if bits == 2:
        nz = np.count_nonzero(ak, axis=1)
        # (a float64 sum in index order: cumsum is sequential where sum is pairwise)
        tot = np.cumsum(ak, axis=1, dtype=np.float64)[:, -1] if ak.shape[1] else np.zeros(ak.shape[0])
        s = (tot / np.maximum(nz, 1)).astype(np.float32)
    else:
        s = ak.max(axis=1) if ak.shape[1] else np.zeros(ak.shape[0], np.float32)
    inv = np.float32(lm) / np.maximum(s, _TINY[bits])
    q = np.rint(ak * inv[:, None])
    m = np.minimum(q, np.float32(lm)).astype(np.uint8)
    sign = (np.signbit(kept) & (m > 0)).astype(np.uint8) << np.uint8(bits - 1)
    return s.astype(F32), cols, m | sign


def _refuse(xs: np.ndarray, name: str, offset: int) -> None:
    bad = ~(np.abs(xs) <= LIMIT)   # NaN fails the comparison
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        if not np.isfinite(xs[i]):
            raise CodecError(f"{name}: non-finite value {xs[i]!r} at index {offset + i}; refusing to encode",
                             code="nonfinite")
        raise CodecError(f"{name}: value {xs[i]!r} at index {offset + i} is beyond the block codecs' range "
                         f"(|x| <= {LIMIT:.1e}); refusing to encode")


def encode_piece(lay: Layout, x: np.ndarray, out: np.ndarray, a: int, b: int, name: str) -> None:
    """Encode values [a, b) (block-aligned; only the last piece may end in a partial block) into ``out``."""
    xs = x[a:b]
    blk, bits = lay.block, lay.spec.bits
    if codec_jit.enabled():   # the fused kernel (byte-equal; tests/wire/test_codec_jit.py)
        bad = codec_jit.kernels().sparse_enc(x, out, a, b, blk, lay.k, lay.k_last, lay.width, lay.vb, lay.vb_last,
                                             lay.off_idx, lay.off_val, bits, _TINY[bits])
        if bad < 0:
            return
    _refuse(xs, name, a)
    j0 = a // blk
    pf = (b - a) // blk
    scales = out[: 4 * lay.nb].view(F32)
    parts = [(xs[: pf * blk].reshape(pf, blk), j0, lay.k, lay.vb)] if pf else []
    if (b - a) % blk:
        parts.append((xs[pf * blk:].reshape(1, -1), j0 + pf, lay.k_last, lay.vb_last))
    for xr, j, k, vb in parts:
        s, cols, codes = _encode_rows(xr, k, bits)
        rows = xr.shape[0]
        scales[j: j + rows] = s
        i0 = lay.off_idx + lay.width * j * lay.k
        idx = out[i0: i0 + lay.width * rows * k]
        if lay.width == 1:
            idx[:] = cols.reshape(-1)
        else:
            idx.view("<u2")[:] = cols.reshape(-1)
        v0 = lay.off_val + j * lay.vb
        out[v0: v0 + rows * vb] = _pack(codes, bits, vb).reshape(-1)


# ------------------------------------------------------------------------------------------------------ decode
def _blocks_of(lay: Layout, data: np.ndarray, j0: int, rows: int, partial: bool):
    """(scales, indices (rows, k), value bytes (rows, vb)) of blocks [j0, j0 + rows)."""
    k, vb = (lay.k_last, lay.vb_last) if partial else (lay.k, lay.vb)
    scales = data[4 * j0: 4 * (j0 + rows)]
    scales = scales.view(F32) if scales.ctypes.data % 4 == 0 else scales.copy().view(F32)
    i0 = lay.off_idx + lay.width * j0 * lay.k
    idx = data[i0: i0 + lay.width * rows * k]
    if lay.width == 1:
        idx = idx.reshape(rows, k)
    else:
        idx = (idx.view("<u2") if idx.ctypes.data % 2 == 0 else idx.copy().view("<u2")).reshape(rows, k)
    v0 = lay.off_val + j0 * lay.vb
    return scales, idx, data[v0: v0 + rows * vb].reshape(rows, vb)


def _parts(lay: Layout, a: int, b: int):
    blk = lay.block
    j0, pf = a // blk, (b - a) // blk
    if pf:
        yield j0, pf, False, a
    if (b - a) % blk:
        yield j0 + pf, 1, True, a + pf * blk


def decode_piece(lay: Layout, data: np.ndarray, out, a: int, b: int, acc, w: float) -> None:
    """Values [a, b) of validated ``data`` into ``out[a:b]`` (dense), or ``acc[a:b] += w * values`` touching
    only the kept positions."""
    if codec_jit.enabled():
        codec_jit.kernels().sparse_dec(data, out if acc is None else acc, a, b, lay.block, lay.k, lay.k_last,
                                       lay.width, lay.vb, lay.vb_last, lay.off_idx, lay.off_val, lay.spec.bits,
                                       float(w), acc is not None, _LEVELS[lay.spec.bits])
        return
    if acc is None:
        out[a:b] = 0.0
    dst = out if acc is None else acc
    lv = _LEVELS[lay.spec.bits]
    for j, rows, partial, start in _parts(lay, a, b):
        s, idx, vals = _blocks_of(lay, data, j, rows, partial)
        k = idx.shape[1]
        if not k:
            continue
        if w != 1.0:
            s = s * np.float32(w)
        v = lv[_unpack(vals, lay.spec.bits, k)] * s[:, None]
        pos = idx.astype(np.int64) + (start + lay.block * np.arange(rows, dtype=np.int64))[:, None]
        if acc is None:
            dst[pos] = v
        else:
            dst[pos] += v   # positions are unique (validated), so the fancy add is exact


def validate(lay: Layout, data: np.ndarray) -> None:
    """Refuse (CodecError) scales out of range, indices not strictly increasing or outside their block, and
    set bits where a block's values end: everything a peer controls. ``data`` has the right length. (The fused
    kernel checks the same in one pass; on a fault this numpy pass finds it and raises.)"""
    if codec_jit.enabled() and codec_jit.kernels().sparse_valid(
            data, lay.nb, lay.block, lay.numel, lay.k, lay.k_last, lay.width, lay.vb, lay.vb_last, lay.off_idx,
            lay.off_val, lay.spec.bits, np.float32(LIMIT)):
        return
    scales = data[: 4 * lay.nb]
    scales = scales.view(F32) if scales.ctypes.data % 4 == 0 else scales.copy().view(F32)
    ok = (scales >= 0) & (scales <= np.float32(LIMIT))
    if lay.nb and not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise CodecError(f"{lay.spec.name} data has an invalid scale {scales[bad]!r} in block {bad} (scales must "
                         f"be finite, >= 0 and <= {LIMIT:.3e})", code="nonfinite")
    for j, rows, partial, _ in _parts(lay, 0, lay.numel):
        _, idx, vals = _blocks_of(lay, data, j, rows, partial)
        size = lay.tail if partial else lay.block
        if idx.shape[1] == 0:
            continue
        wrong = idx[:, -1] >= size
        if idx.shape[1] > 1:
            wrong |= (np.diff(idx.astype(np.int32), axis=1) <= 0).any(axis=1)
        if wrong.any():
            r = j + int(np.flatnonzero(wrong)[0])
            raise CodecError(f"{lay.spec.name} data: the indices of block {r} are not strictly increasing "
                             f"positions below {size}")
        used = (idx.shape[1] * lay.spec.bits) % 8
        if used and (vals[:, -1] >> np.uint8(used)).any():
            r = j + int(np.flatnonzero(vals[:, -1] >> np.uint8(used))[0])
            raise CodecError(f"{lay.spec.name} data: unused value bits are set in block {r}")


def block_sumsq(lay: Layout, data: np.ndarray, rows_per_step: int = 4096) -> tuple:
    """(sum of squares, largest block mean square) of validated ``data``, from the scales and a table of
    squared codes (no decode)."""
    tab = _BYTE_SUMSQ[lay.spec.bits]
    total, top = 0.0, 0.0
    for j, rows, partial, _ in _parts(lay, 0, lay.numel):
        size = lay.tail if partial else lay.block
        for r0 in range(0, rows, rows_per_step):
            r1 = min(rows, r0 + rows_per_step)
            s, _, vals = _blocks_of(lay, data, j + r0, r1 - r0, partial)
            s = s.astype(np.float64)
            sq = s * s * np.take(tab, vals).sum(axis=1)
            if sq.size:
                total += float(sq.sum())
                top = max(top, float(sq.max()) / size)
    return total, top


def sub_buffer(lay: Layout, data: np.ndarray, b0: int, b1: int) -> np.ndarray:
    """The encoding of blocks [b0, b1) alone (as ``encode`` would give for their values)."""
    last = b1 == lay.nb and lay.tail
    nfull = (b1 - b0) - (1 if last else 0)
    i0 = lay.off_idx + lay.width * b0 * lay.k
    i1 = i0 + lay.width * (nfull * lay.k + (lay.k_last if last else 0))
    v0 = lay.off_val + b0 * lay.vb
    v1 = v0 + nfull * lay.vb + (lay.vb_last if last else 0)
    return np.concatenate([data[4 * b0: 4 * b1], data[i0:i1], data[v0:v1]])


def splice(lay: Layout, body: np.ndarray, enc: np.ndarray, pos: int, n: int) -> None:
    """Copy ``enc`` (the encoding of values [pos, pos + n), block-aligned) to its places in ``body``."""
    sub = layout(lay.spec, n, lay.block)
    b0 = pos // lay.block
    body[4 * b0: 4 * (b0 + sub.nb)] = enc[: 4 * sub.nb]
    i0 = lay.off_idx + lay.width * b0 * lay.k
    body[i0: i0 + sub.off_val - sub.off_idx] = enc[sub.off_idx: sub.off_val]
    v0 = lay.off_val + b0 * lay.vb
    body[v0: v0 + sub.nbytes - sub.off_val] = enc[sub.off_val:]
