"""The numba kernels of :mod:`.codec_jit` (imported on first use: importing numba costs about half a second, which
a process that never encodes a block codec should not pay). Formats: docs/protocol.md; the numpy reference:
codec_kernels.py."""
from __future__ import annotations

import numba
import numpy as np

from .codec_kernels import LIMIT

_LIMIT_BITS = int(np.float32(LIMIT).view(np.int32))
_MAGIC = np.float32(12582912.0)
_jit = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=False, error_model="numpy")


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
def pack(nib, cb):
    """cb[p] = nib[2p] | nib[2p+1] << 4 (nib holds one more zero when its count is odd)."""
    for p in range(cb.size):
        q = np.uint64(2 * p)
        cb[p] = np.uint8(nib[q] | (nib[q + np.uint64(1)] << 4))

@_jit
def enc_block(x, scales, codes, a, b, block, kind, k, div, tiny):
    """kind 0: int8, 1: int4, 2: int4-log, over blocks of x[a:b]; returns -1, or the first block holding a
    value the codecs refuse (nothing of that block written). ``(v + MAGIC) - MAGIC`` is the reference's
    magic-number rounding (round half to even) kept in float32. Branch-free inner loops over one
    block, then the nibbles are packed from a block-sized scratch."""
    xi = x.view(np.int32)
    one = np.empty(1, np.int32)
    onef = one.view(np.float32)
    nib = np.empty(block + 1, np.int32)
    kf = np.float32(k)
    dv = np.float32(div)
    nb = (b - a + block - 1) // block
    j0 = a // block
    for jb in range(nb):
        lo = a + jb * block
        hi = min(b, lo + block)
        m = hi - lo
        xb = x[lo:hi]
        one[0] = absmax_bits(xi[lo:hi])
        if one[0] > _LIMIT_BITS:
            return j0 + jb
        amax = onef[0]
        scales[j0 + jb] = amax / dv
        inv = kf / max(amax, tiny)
        if kind == 0:
            cb = codes[lo:hi]
            for i in range(m):
                cb[i] = np.uint8(np.int32((xb[i] * inv + _MAGIC) - _MAGIC) & 0xFF)
            continue
        nb_ = nib[:m]
        if kind == 1:
            for i in range(m):
                nb_[i] = np.int32((xb[i] * inv + _MAGIC) - _MAGIC) + 8
        else:   # the reference's arithmetic: the exponent field of t = |x| * inv, through a float32 view
            xib = xi[lo:hi]
            tf = nb_.view(np.float32)
            for i in range(m):
                tf[i] = abs(xb[i]) * inv
            for i in range(m):
                lvl = min(max((nb_[i] >> 23) - 120, 0), 7)
                nb_[i] = lvl | ((np.int32(xib[i] < 0) & np.int32(lvl > 0)) << 3)
        nib[m] = 0
        pack(nib, codes[lo >> 1:(lo >> 1) + ((m + 1) >> 1)])
    return -1

@_jit
def dec_int8(codes, scales, dst, a, b, block, w, add):
    ci = codes.view(np.int8)
    wf = np.float32(w)
    j0 = a // block
    for jb in range((b - a + block - 1) // block):
        lo = a + jb * block
        hi = min(b, lo + block)
        s = scales[j0 + jb]
        if w != 1.0:
            s = s * wf
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
def dec_nib(codes, scales, dst, a, b, block, w, add, lut, linear, logbits):
    """int4 (linear) and int4-log (logbits; lut: nibble -> factor of the scale, for an odd last value)."""
    wf = np.float32(w)
    tmp = np.empty(block + 1, np.int32)
    j0 = a // block
    for jb in range((b - a + block - 1) // block):
        lo = a + jb * block
        hi = min(b, lo + block)
        s = scales[j0 + jb]
        if w != 1.0:
            s = s * wf
        m = hi - lo
        pairs = m >> 1
        cb = codes[lo >> 1:(lo >> 1) + ((m + 1) >> 1)]
        db = dst[lo:hi]
        if linear:   # int4: (nibble - 8) * scale, arithmetic rather than a table
            if add:
                for p in range(pairs):
                    c = np.int32(cb[p])
                    q = np.uint64(2 * p)
                    db[q] = db[q] + (np.float32(c & 15) - np.float32(8.0)) * s
                    db[q + np.uint64(1)] = db[q + np.uint64(1)] + (np.float32(c >> 4) - np.float32(8.0)) * s
            else:
                for p in range(pairs):
                    c = np.int32(cb[p])
                    q = np.uint64(2 * p)
                    db[q] = (np.float32(c & 15) - np.float32(8.0)) * s
                    db[q + np.uint64(1)] = (np.float32(c >> 4) - np.float32(8.0)) * s
        elif logbits:   # int4-log: the level's float32 built from its bits, then scaled (no table lookup)
            tb = tmp[:2 * pairs]
            for p in range(pairs):
                c = np.int32(cb[p])
                q = np.uint64(2 * p)
                lo4 = c & 7
                hi4 = (c >> 4) & 7
                tb[q] = ((c & 8) << 28) | (np.int32(lo4 > 0) * ((120 + lo4) << 23))
                tb[q + np.uint64(1)] = ((c & 128) << 24) | (np.int32(hi4 > 0) * ((120 + hi4) << 23))
            tf = tb.view(np.float32)
            if add:
                for i in range(2 * pairs):
                    db[i] = db[i] + tf[i] * s
            else:
                for i in range(2 * pairs):
                    db[i] = tf[i] * s
        elif add:
            for p in range(pairs):
                c = np.int32(cb[p])
                q = np.uint64(2 * p)
                db[q] = db[q] + lut[c & 15] * s
                db[q + np.uint64(1)] = db[q + np.uint64(1)] + lut[c >> 4] * s
        else:
            for p in range(pairs):
                c = np.int32(cb[p])
                q = np.uint64(2 * p)
                db[q] = lut[c & 15] * s
                db[q + np.uint64(1)] = lut[c >> 4] * s
        if m & 1:
            v = lut[np.int32(cb[pairs]) & 15] * s
            db[m - 1] = db[m - 1] + v if add else v
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
def _kth_largest_cut(v, kth, cand, top):
    """The kth largest of v: every one of kth chunks has its maximum at or above the smallest of those maxima, so
    the kth largest is too; only the values at or above it (a few more than kth, found by a vectorized pass) go
    through the exact selection."""
    n = v.size
    cs = n // kth
    floor = np.int32(0x7FFFFFFF)
    for c in range(kth):
        lo = c * cs
        hi = n if c == kth - 1 else lo + cs
        m = np.int32(-1)
        for i in range(lo, hi):
            m = max(m, v[i])
        floor = min(floor, m)
    nc = 0
    for i in range(n):
        if v[i] >= floor:
            cand[nc] = v[i]
            nc += 1
    return _kth_largest_few(cand[:nc], kth, top)


@_jit
def sparse_enc(x, out, a, b, block, k, k_last, width, vb, vb_last, off_idx, off_val, bits, tiny):
    """Blocks of x[a:b] into ``out`` (the whole encoding; sparse.py's layout and reference rules); returns -1 or
    the first block holding a value the codecs refuse."""
    xi = x.view(np.int32)
    ab = np.empty(block, np.int32)
    abf = ab.view(np.float32)
    sel = np.empty(block, np.int32)
    work = np.empty(block, np.int32)
    one = np.empty(1, np.float32)
    onei = one.view(np.int32)
    lm = (1 << (bits - 1)) - 1
    lmf = np.float32(lm)
    nb = (b - a + block - 1) // block
    j0 = a // block
    for jb in range(nb):
        j = j0 + jb
        lo = a + jb * block
        hi = min(b, lo + block)
        n = hi - lo
        kk = k if n == block else k_last
        vbb = vb if n == block else vb_last
        xb = xi[lo:hi]
        m = np.int32(0)
        for i in range(n):
            v = xb[i] & np.int32(0x7FFFFFFF)
            ab[i] = v
            m = max(m, v)
        if m > _LIMIT_BITS:
            return j
        # the kk largest magnitudes, ties to the lower index, in index order
        if kk == n:
            for i in range(n):
                sel[i] = i
        else:
            if kk * 8 <= n:
                t = _kth_largest_cut(ab[:n], kk, sel, work)   # (sel and work: scratch until t is known)
            else:
                for i in range(n):
                    work[i] = ab[i]
                t = _kth_largest(work[:n], kk)
            gt = 0
            for i in range(n):   # the values above t, in index order (rare: a well-predicted branch)
                if ab[i] > t:
                    sel[gt] = i
                    gt += 1
            need = kk - gt
            if need > 0:   # and the first `need` values equal to t, merged in index order
                c = kk - 1
                g = gt - 1
                ties = 0
                for i in range(n):
                    if ab[i] == t:
                        work[ties] = i
                        ties += 1
                        if ties == need:
                            break
                e = need - 1
                while e >= 0:   # merge from the back: sel[:gt] and work[:need], both increasing
                    if g >= 0 and sel[g] > work[e]:
                        sel[c] = sel[g]
                        g -= 1
                    else:
                        sel[c] = work[e]
                        e -= 1
                    c -= 1
        # scale
        if bits == 2:
            tot = 0.0
            nz = 0
            for c in range(kk):
                f = abf[sel[c]]
                tot += np.float64(f)
                nz += 1 if f != 0 else 0
            s = np.float32(tot / max(nz, 1))
        else:
            s = np.float32(0.0)
            for c in range(kk):
                s = max(s, abf[sel[c]])
        one[0] = s
        p4 = 4 * j
        si = onei[0]
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
            q = np.float32(np.float32(abf[i] * inv + _MAGIC) - _MAGIC)
            mm = np.int32(min(q, lmf))
            code = mm | ((np.int32(xb[i] < 0) & np.int32(mm > 0)) << (bits - 1))
            bit = c * bits
            out[vbase + (bit >> 3)] |= np.uint8(code << (bit & 7))
    return -1


@_jit
def sparse_dec(data, dst, a, b, block, k, k_last, width, vb, vb_last, off_idx, off_val, bits, w, add, lut):
    """Values [a, b) of validated sparse ``data``: dst[lo + index] = lut[code] * scale (dst[a:b] zeroed first), or
    dst[lo + index] += lut[code] * (scale * w) when accumulating."""
    wf = np.float32(w)
    mask = (1 << bits) - 1
    if not add:
        for i in range(a, b):
            dst[i] = np.float32(0.0)
    nb = (b - a + block - 1) // block
    j0 = a // block
    one = np.empty(4, np.uint8)
    onef = one.view(np.float32)
    for jb in range(nb):
        j = j0 + jb
        lo = a + jb * block
        n = min(b, lo + block) - lo
        kk = k if n == block else k_last
        for q in range(4):
            one[q] = data[4 * j + q]
        s = onef[0]
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
                dst[lo + i] = dst[lo + i] + v
            else:
                dst[lo + i] = v
    return 0
