"""The numba kernels of :mod:`.codec_jit` (imported on first use: importing numba costs about half a second, which
a process that never encodes a block codec should not pay). Formats: docs/protocol.md; the numpy reference:
codec_kernels.py.

Every kernel makes one pass over a block's float32 values in memory (a second one, if any, reads the block from L1)
and prefetches the values ``_AHEAD`` floats ahead (streaming from memory, the hardware prefetcher alone left the
encoders 30% slower). Float bits are read and written with a bit cast (``_f2i``, ``_i2f``), so the int4-log levels
are built from exponent bits in the same loop as the codes (no scratch array, no log/exp)."""
from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from .codec_kernels import INT1_UNIT_EXP as _INT1_UNIT_EXP
from .codec_kernels import LIMIT

_LIMIT_BITS = int(np.float32(LIMIT).view(np.int32))
_MAGIC = np.float32(12582912.0)
_AHEAD = 1024   # floats (4 KiB): measured best of 256 / 1024 / 4096 / 16384 on the 2-core VM
_jit = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=False, error_model="numpy")


@intrinsic
def _f2i(typingctx, x):
    """The bits of a float32, as int32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def _i2f(typingctx, x):
    """The float32 of the low 32 bits of an integer."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if x.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif x.bitwidth < 32:
            v = builder.sext(v, ir.IntType(32)) if x.signed else builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(x), codegen


@intrinsic
def _prefetch(typingctx, arr, idx):
    """A read prefetch of arr[idx] into all cache levels (a hint: no fault, whatever the address)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i = args[1] if sig.args[1].bitwidth == 64 else builder.sext(args[1], ir.IntType(64))
        p8 = builder.bitcast(builder.gep(ary.data, [i]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [p8.type],
                                              ir.FunctionType(ir.VoidType(), [p8.type, i32, i32, i32]))
        builder.call(fn, [p8, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@_jit
def prefetch_range(x, lo, hi):
    """Prefetch the cache lines of x[lo:hi] (clamped to x)."""
    hi = min(hi, x.size)
    for i in range(lo, hi, 16):
        _prefetch(x, i)


# Loops index slices with their own range variable: numba then knows the index is not negative and LLVM
# vectorizes the loop (an index like lo + i keeps a negative-index wraparound test that prevents it).
@_jit
def absmax_bits(xb):
    """The largest |x| bit pattern (int32) of xb (any NaN/inf compares above every finite value)."""
    m = np.int32(0)
    for i in range(xb.size):
        m = max(m, xb[i] & np.int32(0x7FFFFFFF))
    return m


@_jit
def _q4(v, inv):
    """int4 nibble: rint(v * inv) + 8, by the reference's magic-number rounding kept in float32."""
    return np.int32((v * inv + _MAGIC) - _MAGIC) + 8


@_jit
def _qlog(v, inv):
    """int4-log nibble: level = clamp(exponent of |v| * inv - 120, 0, 7), the sign on non-zero levels."""
    lvl = min(max((_f2i(abs(v) * inv) >> 23) - 120, 0), 7)
    return lvl | ((np.int32(_f2i(v) < 0) & np.int32(lvl > 0)) << 3)


@_jit
def _enc8(xb, cb, inv):
    for i in range(xb.size):
        cb[i] = np.uint8(np.int32((xb[i] * inv + _MAGIC) - _MAGIC) & 0xFF)


@_jit
def _enc4(xb, cb, inv):
    m = xb.size
    pairs = m >> 1
    for p in range(pairs):
        q = np.uint64(2 * p)
        cb[p] = np.uint8(_q4(xb[q], inv) | (_q4(xb[q + np.uint64(1)], inv) << 4))
    if m & 1:
        cb[pairs] = np.uint8(_q4(xb[m - 1], inv))


@_jit
def _enclog(xb, cb, inv):
    m = xb.size
    pairs = m >> 1
    for p in range(pairs):
        q = np.uint64(2 * p)
        cb[p] = np.uint8(_qlog(xb[q], inv) | (_qlog(xb[q + np.uint64(1)], inv) << 4))
    if m & 1:
        cb[pairs] = np.uint8(_qlog(xb[m - 1], inv))


@_jit
def enc_block(x, scales, codes, a, b, block, kind, k, div, tiny):
    """kind 0: int8, 1: int4, 2: int4-log, over blocks of x[a:b]; returns -1, or the first block holding a
    value the codecs refuse (nothing of that block written). One loop per block for the absolute maximum and the
    range check, one (over L1) for the codes, two nibbles packed per iteration."""
    xi = x.view(np.int32)
    kf = np.float32(k)
    dv = np.float32(div)
    nb = (b - a + block - 1) // block
    j0 = a // block
    for jb in range(nb):
        lo = a + jb * block
        hi = min(b, lo + block)
        prefetch_range(x, lo + _AHEAD, hi + _AHEAD)
        m = hi - lo
        xb = x[lo:hi]
        bits = absmax_bits(xi[lo:hi])
        if bits > _LIMIT_BITS:
            return j0 + jb
        amax = _i2f(bits)
        scales[j0 + jb] = amax / dv
        inv = kf / max(amax, tiny)
        if kind == 0:
            _enc8(xb, codes[lo:hi], inv)
            continue
        cb = codes[lo >> 1:(lo >> 1) + ((m + 1) >> 1)]
        if kind == 1:
            _enc4(xb, cb, inv)
        else:
            _enclog(xb, cb, inv)
    return -1


@_jit
def _block_scale(scales, j, w, wf):
    """Block j's scale, times the weight w (float32 wf) of an accumulating decode unless w is 1."""
    s = scales[j]
    if w != 1.0:
        s = s * wf
    return s


@_jit
def dec_int8(codes, scales, dst, a, b, block, w, add):
    ci = codes.view(np.int8)
    wf = np.float32(w)
    j0 = a // block
    for jb in range((b - a + block - 1) // block):
        lo = a + jb * block
        hi = min(b, lo + block)
        s = _block_scale(scales, j0 + jb, w, wf)
        cb = ci[lo:hi]
        db = dst[lo:hi]
        if add:
            for i in range(hi - lo):
                db[i] = db[i] + np.float32(cb[i]) * s
        else:
            for i in range(hi - lo):
                db[i] = np.float32(cb[i]) * s
    return 0


@_jit
def _lin4(c):
    """int4: the factor of nibble c (nibble - 8), exactly, from float bits: 2**23 + nibble minus 2**23 + 8 (numba
    computes the nibble in int64, whose conversion to float32 is not vectorized)."""
    return _i2f(np.int32(0x4B000000) | (c & 15)) - np.float32(8388616.0)


@_jit
def _log4(c):
    """int4-log: the factor of nibble c built from its bits: sign bit 3, level L = c & 7 -> 2**(L-7) (L >= 1),
    +-0 (L = 0): the reference's table entry exactly (its nibble 8, never produced, is -0 there and here)."""
    lvl = c & 7
    return _i2f(((c & 8) << 28) | (np.int32(lvl > 0) * ((120 + lvl) << 23)))


# The per-block loops are functions of their own: inside the block loop of one big kernel LLVM left them scalar
# (measured: int4 decode 3.8x slower in cache).
@_jit
def _dec_lin_set(cb, db, s):
    for i in range(db.size):
        db[i] = _lin4(np.int32(cb[i >> 1]) >> ((i & 1) << 2)) * s


@_jit
def _dec_lin_add(cb, db, s):
    for i in range(db.size):
        db[i] = db[i] + _lin4(np.int32(cb[i >> 1]) >> ((i & 1) << 2)) * s


@_jit
def _dec_log_set(cb, db, s):
    for i in range(db.size):
        db[i] = _log4(np.int32(cb[i >> 1]) >> ((i & 1) << 2)) * s


@_jit
def _dec_log_add(cb, db, s):
    for i in range(db.size):
        db[i] = db[i] + _log4(np.int32(cb[i >> 1]) >> ((i & 1) << 2)) * s


@_jit
def dec_nib(codes, scales, dst, a, b, block, w, add, logbits):
    """int4 and int4-log (logbits): value i of a block from nibble ``i & 1`` of its byte ``i >> 1``, one loop."""
    wf = np.float32(w)
    j0 = a // block
    for jb in range((b - a + block - 1) // block):
        lo = a + jb * block
        hi = min(b, lo + block)
        s = _block_scale(scales, j0 + jb, w, wf)
        m = hi - lo
        cb = codes[lo >> 1:(lo >> 1) + ((m + 1) >> 1)]
        db = dst[lo:hi]
        if logbits:
            if add:
                _dec_log_add(cb, db, s)
            else:
                _dec_log_set(cb, db, s)
        elif add:
            _dec_lin_add(cb, db, s)
        else:
            _dec_lin_set(cb, db, s)
    return 0


# ------------------------------------------------------------------------------------------------------ int1
@_jit
def _int1_sum(xi, e_blk):
    """codec_kernels.int1_scales' integer sum of the |x| of one block (``xi``: its int32 bits; ``e_blk``: the
    biased exponent of its largest |x|, at least 1). Exact, so any order of summing gives the same bits."""
    t = np.int64(0)
    for i in range(xi.size):
        a = xi[i] & np.int32(0x7FFFFFFF)
        ex = a >> 23
        mant = (a & np.int32(0x7FFFFF)) | (np.int32(ex > 0) << 23)
        t += np.int64((mant << 7) >> min(e_blk - max(ex, 1), 31))
    return t


@_jit
def _enc1(xi, cb):
    """Sign bits, value i -> bit i % 8 of byte i // 8 (LSB first); the last byte's padding bits zero."""
    m = xi.size
    full = m >> 3
    u = xi.view(np.uint32)
    for p in range(full):
        q = 8 * p
        v = np.uint32(0)
        for j in range(8):
            v |= (u[q + j] >> np.uint32(31)) << np.uint32(j)
        cb[p] = np.uint8(v)
    if m & 7:
        v = np.uint32(0)
        for j in range(m & 7):
            v |= (u[8 * full + j] >> np.uint32(31)) << np.uint32(j)
        cb[full] = np.uint8(v)


@_jit
def enc_int1(x, scales, codes, a, b, block):
    """int1 over blocks of x[a:b] (block a multiple of 8): per block one loop for the absolute maximum and the range
    check, then (over L1) one for the integer sum of the magnitudes and one for the sign bits. Returns -1, or the
    first block holding a value the codecs refuse."""
    xi = x.view(np.int32)
    nb = (b - a + block - 1) // block
    j0 = a // block
    for jb in range(nb):
        lo = a + jb * block
        hi = min(b, lo + block)
        prefetch_range(x, lo + _AHEAD, hi + _AHEAD)
        bits = absmax_bits(xi[lo:hi])
        if bits > _LIMIT_BITS:
            return j0 + jb
        e_blk = max(bits >> 23, 1)
        total = _int1_sum(xi[lo:hi], e_blk)
        unit = math.ldexp(1.0, e_blk - _INT1_UNIT_EXP)
        scales[j0 + jb] = np.float32(np.float64(total) * unit / np.float64(hi - lo))
        _enc1(xi[lo:hi], codes[lo >> 3:(lo >> 3) + ((hi - lo + 7) >> 3)])
    return -1


@_jit
def _dec1_set(cb, db, sb):
    for i in range(db.size):
        db[i] = _i2f(sb ^ (((np.int32(cb[i >> 3]) >> (i & 7)) & 1) << 31))


@_jit
def _dec1_add(cb, db, sb):
    for i in range(db.size):
        db[i] = db[i] + _i2f(sb ^ (((np.int32(cb[i >> 3]) >> (i & 7)) & 1) << 31))


@_jit
def dec_int1(codes, scales, dst, a, b, block, w, add):
    """int1: value i of a block is its scale (times w) with the sign bit of bit i % 8 of byte i // 8."""
    wf = np.float32(w)
    j0 = a // block
    for jb in range((b - a + block - 1) // block):
        lo = a + jb * block
        hi = min(b, lo + block)
        s = _block_scale(scales, j0 + jb, w, wf)
        cb = codes[lo >> 3:(lo >> 3) + ((hi - lo + 7) >> 3)]
        if add:
            _dec1_add(cb, dst[lo:hi], np.int64(_f2i(s)))
        else:
            _dec1_set(cb, dst[lo:hi], np.int64(_f2i(s)))
    return 0


# --------------------------------------------------------------------------------------------- sparse (topk)
@_jit
def _kth_largest(s, kth):
    """The kth largest (1-based) of the int32 values s (reordered in place): a quickselect."""
    lo, hi = 0, s.size - 1
    want = s.size - kth          # its position in ascending order
    while lo < hi:
        p = s[(lo + hi) >> 1]
        i, j = lo, hi
        while i <= j:
            while s[i] < p:
                i += 1
            while s[j] > p:
                j -= 1
            if i <= j:
                t = s[i]
                s[i] = s[j]
                s[j] = t
                i += 1
                j -= 1
        if want <= j:
            hi = j
        elif want >= i:
            lo = i
        else:
            return s[want]
    return s[want]


@_jit
def _kth_largest_few(v, kth, top):
    """The kth largest of v when kth is small: the kth largest so far kept sorted ascending in top[:kth]; a value
    enters only when it beats the smallest of them (rare after the first values), so this is about one compare
    per value."""
    for i in range(kth):   # insertion sort of the first kth values
        x = v[i]
        j = i
        while j > 0 and top[j - 1] > x:
            top[j] = top[j - 1]
            j -= 1
        top[j] = x
    floor = top[0]
    for i in range(kth, v.size):
        x = v[i]
        if x > floor:
            j = 0
            while j + 1 < kth and top[j + 1] < x:
                top[j] = top[j + 1]
                j += 1
            top[j] = x
            floor = top[0]
    return floor


@_jit
def _kth(v, kth, work):
    """The kth largest of v (v unchanged; work: scratch of v's size)."""
    if kth <= 8:
        return _kth_largest_few(v, kth, work)
    w = work[:v.size]
    for i in range(v.size):
        w[i] = v[i]
    return _kth_largest(w, kth)


@intrinsic
def _popcount(typingctx, x):
    """The set bits of a uint64."""
    if x != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)])
        return builder.call(fn, [args[0]])
    return types.uint64(types.uint64), codegen


@_jit
def _mask64(seg, g):
    """Bit i set where seg[i] >= g (64 values: a vectorized loop of constant length)."""
    mk = np.uint64(0)
    for i in range(64):
        mk |= np.uint64(seg[i] >= g) << np.uint64(i)
    return mk


@_jit
def _mask_tail(seg, g):
    mk = np.uint64(0)
    for i in range(seg.size):
        mk |= np.uint64(seg[i] >= g) << np.uint64(i)
    return mk


@_jit
def _masks(ab, g, masks):
    """masks[w] = the values of ab[64 w: 64 w + 64] at or above g; returns their count."""
    n = ab.size
    full = n >> 6
    c = np.uint64(0)
    for w in range(full):
        mk = _mask64(ab[w << 6:(w + 1) << 6], g)
        masks[w] = mk
        c += _popcount(mk)
    if n & 63:
        mk = _mask_tail(ab[full << 6:], g)
        masks[full] = mk
        c += _popcount(mk)
    return np.int64(c)


@_jit
def _rank_all(cv, rank, nc):
    """rank[a] = how many of cv rank above cv[a], a < nc: larger, or equal at a lower position. cv's length is 16,
    32 or 64 (padded with -1, which ranks below every value). O(nc * p) compares: the bulk of the sparse encoder's
    time (docs/benchmarks.md)."""
    p = cv.size
    for a in range(nc):
        v = cv[a]
        r = np.int32(0)
        for b in range(p):
            r += np.int32(cv[b] > v) | (np.int32(cv[b] == v) & np.int32(b < a))
        rank[a] = r


_RANKED = 64   # up to this many candidates, the selection ranks them all (branch-free); above, a quickselect


@_jit
def _select(ab, kk, g, top, sel, cidx, cval, masks, best, work):
    """sel[:kk] = the positions of the kk largest of ``ab``, ties to the lower index, increasing; returns the
    kk-th largest. ``g`` is a guess of a value at or below it, ``top`` the largest value (any guess gives the same
    selection; a close one is faster): the values at or above the guess are the candidates, found with 64-bit
    masks. While they are fewer than kk the guess is lowered; while they are more than about 2 kk (and at most
    three times) it is raised half way to ``top`` if that keeps kk. A candidate is kept when fewer than kk
    candidates rank above it."""
    n = ab.size
    if kk == n:
        t = np.int32(0x7FFFFFFF)
        for i in range(n):
            sel[i] = i
            t = min(t, ab[i])
        return t
    nw = (n + 63) >> 6
    c = _masks(ab, g, masks)
    tries = 0
    while c < kk:   # ends: g = 0 takes every value
        tries += 1
        g = np.int32(0) if tries >= 8 else _f2i(_i2f(g) * np.float32(0.8))
        c = _masks(ab, g, masks)
    cap = 16 if kk <= 8 else 32 if kk <= 16 else 64
    for w in range(nw):
        best[w] = masks[w]
    for _ in range(3):
        if c <= cap:
            break
        g2 = _f2i((_i2f(g) + _i2f(top)) * np.float32(0.5))
        if g2 <= g:
            break
        c2 = _masks(ab, g2, masks)
        if c2 < kk:
            break
        g, c = g2, c2
        for w in range(nw):
            best[w] = masks[w]
    nc = 0
    for w in range(nw):
        mk = best[w]
        while mk:
            i = (w << 6) + trailing_zeros(mk)
            cidx[nc] = i
            cval[nc] = ab[i]
            nc += 1
            mk &= mk - np.uint64(1)
    if nc <= _RANKED:
        p = 16 if nc <= 16 else 32 if nc <= 32 else 64
        for a in range(nc, p):
            cval[a] = -1
        rank = work[:p]
        _rank_all(cval[:p], rank, nc)
        o = 0
        t = np.int32(0x7FFFFFFF)
        for a in range(nc):
            if rank[a] < kk:
                sel[o] = cidx[a]
                o += 1
                t = min(t, cval[a])
        return t
    cv = cval[:nc]
    t = _kth(cv, kk, work)
    gt = 0
    for a in range(nc):
        gt += np.int32(cv[a] > t)
    need = kk - gt   # the first `need` values equal to t join the values above it
    o = 0
    for a in range(nc):
        v = cv[a]
        if v > t or (v == t and need > 0):
            if v == t:
                need -= 1
            sel[o] = cidx[a]
            o += 1
    return t


@_jit
def sparse_enc(x, out, a, b, block, k, k_last, width, vb, vb_last, off_idx, off_val, bits, tiny):
    """Blocks of x[a:b] into ``out`` (the whole encoding; sparse.py's layout and reference rules); returns -1 or
    the first block holding a value the codecs refuse."""
    xi = x.view(np.int32)
    ab = np.empty(block, np.int32)
    sel = np.empty(block, np.int32)
    cidx = np.empty(block, np.int32)
    cval = np.empty(max(block, 64), np.int32)
    work = np.empty(max(block, 64), np.int32)
    masks = np.empty((block + 63) >> 6, np.uint64)
    best = np.empty((block + 63) >> 6, np.uint64)
    ratio = np.float32(0.5)   # the guess of the next block's kk-th largest over its largest (speed only)
    lm = (1 << (bits - 1)) - 1
    lmf = np.float32(lm)
    nb = (b - a + block - 1) // block
    j0 = a // block
    for jb in range(nb):
        j = j0 + jb
        lo = a + jb * block
        hi = min(b, lo + block)
        prefetch_range(x, lo + _AHEAD, hi + _AHEAD)
        n = hi - lo
        kk = k if n == block else k_last
        vbb = vb if n == block else vb_last
        xb = xi[lo:hi]
        abn = ab[:n]
        m = np.int32(0)
        for i in range(n):
            v = xb[i] & np.int32(0x7FFFFFFF)
            abn[i] = v
            m = max(m, v)
        if m > _LIMIT_BITS:
            return j
        t = _select(abn, kk, _f2i(_i2f(m) * ratio), m, sel, cidx, cval, masks, best, work)
        if m > 0:
            ratio = max(np.float32(_i2f(t) / _i2f(m)) * np.float32(0.8), np.float32(1e-6))
        if bits == 2:   # scale: the mean kept non-zero magnitude (float64 sum in index order)
            tot = 0.0
            nz = 0
            for c in range(kk):
                f = _i2f(abn[sel[c]])
                tot += np.float64(f)
                nz += 1 if f != 0 else 0
            s = np.float32(tot / max(nz, 1))
        else:           # the kept absmax
            s = np.float32(0.0)
            for c in range(kk):
                s = max(s, _i2f(abn[sel[c]]))
        p4 = 4 * j
        si = _f2i(s)
        out[p4] = np.uint8(si & 0xFF)
        out[p4 + 1] = np.uint8((si >> 8) & 0xFF)
        out[p4 + 2] = np.uint8((si >> 16) & 0xFF)
        out[p4 + 3] = np.uint8((si >> 24) & 0xFF)
        inv = lmf / max(s, tiny)
        ib = off_idx + width * j * k
        vbase = off_val + j * vb
        for q in range(vbb):
            out[vbase + q] = 0
        for c in range(kk):
            i = sel[c]
            if width == 1:
                out[ib + c] = np.uint8(i)
            else:
                out[ib + 2 * c] = np.uint8(i & 0xFF)
                out[ib + 2 * c + 1] = np.uint8(i >> 8)
            q = np.float32(np.float32(_i2f(abn[i]) * inv + _MAGIC) - _MAGIC)
            mm = np.int32(min(q, lmf))
            code = mm | ((np.int32(xb[i] < 0) & np.int32(mm > 0)) << (bits - 1))
            bit = c * bits
            out[vbase + (bit >> 3)] |= np.uint8(code << (bit & 7))
    return -1


@_jit
def _zero(db):
    """db[:] = 0 (a function of its own, so that LLVM makes it a vector store loop)."""
    for i in range(db.size):
        db[i] = np.float32(0.0)


@_jit
def sparse_dec(data, dst, a, b, block, k, k_last, width, vb, vb_last, off_idx, off_val, bits, w, add, lut):
    """Values [a, b) of validated sparse ``data``: block by block, dst[lo:hi] zeroed and dst[lo + index] =
    lut[code] * scale, or dst[lo + index] += lut[code] * (scale * w) when accumulating."""
    wf = np.float32(w)
    mask = (1 << bits) - 1
    nb = (b - a + block - 1) // block
    j0 = a // block
    for jb in range(nb):
        j = j0 + jb
        lo = a + jb * block
        hi = min(b, lo + block)
        n = hi - lo
        db = dst[lo:hi]
        if not add:
            _zero(db)
        kk = k if n == block else k_last
        p4 = 4 * j
        s = _i2f(np.int32(data[p4]) | (np.int32(data[p4 + 1]) << 8) | (np.int32(data[p4 + 2]) << 16)
                 | (np.int32(data[p4 + 3]) << 24))
        if w != 1.0:
            s = s * wf
        ib = off_idx + width * j * k
        vbase = off_val + j * vb
        for c in range(kk):
            if width == 1:
                i = np.int64(data[ib + c])
            else:
                i = np.int64(data[ib + 2 * c]) | (np.int64(data[ib + 2 * c + 1]) << 8)
            bit = c * bits
            code = (np.int32(data[vbase + (bit >> 3)]) >> (bit & 7)) & mask
            v = lut[code] * s
            if add:
                db[i] = db[i] + v
            else:
                db[i] = v
    return 0


@_jit
def sparse_valid(data, nb, block, numel, k, k_last, width, vb, vb_last, off_idx, off_val, bits, limit):
    """Whether sparse ``data`` passes sparse.validate (scales finite, >= 0 and <= limit; each block's indices
    strictly increasing and below its size; no set bit after a block's last value): one pass, no temporaries.
    False: sparse.validate finds the first fault and raises with its message."""
    for j in range(nb):
        p4 = 4 * j
        s = _i2f(np.int32(data[p4]) | (np.int32(data[p4 + 1]) << 8) | (np.int32(data[p4 + 2]) << 16)
                 | (np.int32(data[p4 + 3]) << 24))
        if not (s >= np.float32(0.0) and s <= limit):
            return False
        lo = j * block
        size = min(numel, lo + block) - lo
        kk = k if size == block else k_last
        if kk == 0:
            continue
        ib = off_idx + width * j * k
        prev = -1
        for c in range(kk):
            if width == 1:
                i = np.int64(data[ib + c])
            else:
                i = np.int64(data[ib + 2 * c]) | (np.int64(data[ib + 2 * c + 1]) << 8)
            if i <= prev:
                return False
            prev = i
        if prev >= size:
            return False
        used = (kk * bits) & 7
        if used:
            vbb = vb if size == block else vb_last
            if data[off_val + j * vb + vbb - 1] >> used:
                return False
    return True
