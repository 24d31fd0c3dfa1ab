"""The sparse push dtype ``topk:F+intB``: names, golden bytes, byte-equality with a naive per-block reference,
decode / accumulate / range / guard figures, error feedback, and refusal of everything a peer controls."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from yeto_patch.island.boundary.push_encoder import PushEncoder
from yeto_patch.wire import codec_names, codecs, pieces, sparse
from yeto_patch.wire.frames import CodecError

NAMES = codec_names.examples()


# ------------------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("text,name", [("topk:0.02+int2", "topk:0.02+int2"), (" TopK : 0.020 + INT2 ", "topk:0.02+int2"),
                                       ("topk:.5+int8", "topk:0.5+int8"), ("topk:0.0010+int4", "topk:0.001+int4"),
                                       ("INT4", "int4"), ("int4-log", "int4-log")])
def test_canonical_names(text, name):
    assert codec_names.canonical(text) == name
    assert codec_names.known(name)


@pytest.mark.parametrize("text", ["topk:0.6+int2", "topk:0.0009+int2", "topk:0.02+int3", "topk:0.02+int16",
                                  "topk:1+int2", "topk:0.00001+int2", "topk:0+int2", "topk:+int2", "topk:0.02",
                                  "topk:2e-2+int2", "int3", "", "topk:0.12345+int2"])
def test_refused_names(text):
    assert codec_names.canonical(text) is None
    assert not codec_names.known(text)


@pytest.mark.parametrize("name", ["topk:0.020+int2", "TOPK:0.02+int2", "topk:0.02+int2 ", "topk:00.02+int2",
                                  "topk:0.02+int02", "topk:" + "1" * 40])
def test_peers_must_send_the_canonical_spelling(name):
    with pytest.raises(CodecError, match="unknown codec"):
        codecs.check_codec(name)


def test_per_block_count_is_integer_arithmetic():
    s = codec_names.sparse("topk:0.02+int2")
    assert [s.per_block(b) for b in (8, 25, 256, 1000, 4096, 65536)] == [1, 1, 5, 20, 82, 1311]
    assert codec_names.sparse("topk:0.5+int2").per_block(3) == 2   # 1.5 rounds half up
    with pytest.raises(CodecError, match="at most 65536"):
        codecs.check_codec("topk:0.02+int2", 1 << 17)


# ------------------------------------------------------------------------------------------------ golden bytes
def test_golden_bytes():
    # block 4, F 0.5: K = 2 per block; [3, -1, 0.5, -4 | 0, 0, 2, 0] then a partial block [1] (k_last 1)
    x = np.array([3, -1, 0.5, -4, 0, 0, 2, 0, 1], np.float32)
    enc = codecs.encode("topk:0.5+int4", x, 4)
    # scales: absmax 4, 2, 1; indices (uint8): 0 3 | 0 2 (block 2 is [0, 0, 2, 0]: 2, then the tie among the
    # zeros goes to the lowest index) | 0; values (int4: sign << 3 | rint(|x| * 7 / scale), first in the low
    # nibble): 3 -> 5 (5.25), -4 -> 8|7 = 15 | 0 -> 0, 2 -> 7 | 1 -> 7
    assert enc.tobytes().hex() == ("00008040" "00000040" "0000803f" "0003" "0002" "00" "f5" "70" "07")
    assert enc.size == codecs.encoded_nbytes("topk:0.5+int4", 9, 4) == 12 + 5 + 3
    np.testing.assert_array_equal(codecs.decode("topk:0.5+int4", enc, 9, 4),
                                  np.array([np.float32(5 / 7) * 4, 0, 0, -4, 0, 0, 2, 0, 1], np.float32))


def test_golden_int2_scale_is_the_mean_magnitude():
    x = np.array([1.0, -3.0, 0.1, 2.0], np.float32)
    enc = codecs.encode("topk:0.5+int2", x, 4)        # K = 2: -3 and 2; scale 2.5; both |x| >= 1.25 -> m = 1
    assert enc.tobytes().hex() == "00002040" "0103" "07"   # codes 2|1 = 3 (bits 0-1), then 1 (bits 2-3)
    np.testing.assert_array_equal(codecs.decode("topk:0.5+int2", enc, 4, 4), [0, -2.5, 0, 2.5])


# ---------------------------------------------------------------------------------------- the naive reference
def reference_encode(name: str, x: np.ndarray, block: int) -> bytes:
    """One block at a time, one value at a time: the format as docs/protocol.md states it."""
    spec = codec_names.sparse(name)
    k, bits = spec.per_block(block), spec.bits
    lm = (1 << (bits - 1)) - 1
    scales, idx, vals = [], [], []
    for s0 in range(0, x.size, block):
        xb = x[s0:s0 + block]
        kb = min(k, xb.size)
        order = sorted(range(xb.size), key=lambda i: (-abs(float(xb[i])), i))[:kb]
        keep = sorted(order)
        mags = [np.float32(abs(xb[i])) for i in keep]
        if bits == 2:
            nz = sum(1 for m in mags if m != 0)
            tot = 0.0
            for m in mags:   # float64, in index order
                tot += float(m)
            scale = np.float32(tot / max(nz, 1))
        else:
            scale = np.float32(max(mags)) if mags else np.float32(0)
        tiny = np.float32(lm / float(np.finfo(np.float32).max) * (1 + 2.0 ** -20))
        inv = np.float32(lm) / max(scale, tiny)
        codes = []
        for i, m in zip(keep, mags):
            q = min(int(np.rint(np.float32(m * inv))), lm)
            codes.append(q | ((1 << (bits - 1)) if (np.signbit(xb[i]) and q) else 0))
        word = 0
        for j, c in enumerate(codes):
            word |= c << (j * bits)
        scales.append(scale)
        idx += keep
        vals.append(word.to_bytes((kb * bits + 7) // 8, "little"))
    width = "<u1" if block <= 256 else "<u2"
    return (np.array(scales, "<f4").tobytes() + np.array(idx, width).tobytes() + b"".join(vals))


def reference_decode(name, data, numel, block):
    spec = codec_names.sparse(name)
    lay = sparse.layout(spec, numel, block)
    lm = (1 << (spec.bits - 1)) - 1
    out = np.zeros(numel, np.float32)
    d = np.frombuffer(data, np.uint8)
    scales = d[:4 * lay.nb].view("<f4")
    pos_i, pos_v = lay.off_idx, lay.off_val
    for j in range(lay.nb):
        kb, vb = (lay.k, lay.vb) if j < lay.nfull else (lay.k_last, lay.vb_last)
        idx = np.frombuffer(d[pos_i:pos_i + lay.width * kb].tobytes(), "<u1" if lay.width == 1 else "<u2")
        word = int.from_bytes(d[pos_v:pos_v + vb].tobytes(), "little")
        for t, i in enumerate(idx):
            c = (word >> (t * spec.bits)) & ((1 << spec.bits) - 1)
            m, neg = c & lm, c >> (spec.bits - 1)
            f = np.float32(m / lm)
            out[j * block + int(i)] = (-f if neg and m else f) * scales[j]
        pos_i += lay.width * kb
        pos_v += vb
    return out


def _sample(rng, n, kind):
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "ties":   # many equal magnitudes and zeros: the tie rule decides
        return (rng.integers(-2, 3, n) * 0.5).astype(np.float32)
    if kind == "sparse":
        x = np.zeros(n, np.float32)
        x[rng.integers(0, max(n, 1), max(n // 50, 1))] = rng.standard_normal(max(n // 50, 1))
        return x
    return (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)   # wide range


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block", [8, 63, 256, 300])
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "wide"])
def test_byte_equal_to_the_naive_reference(name, block, kind):
    rng = np.random.default_rng(block + len(name) + len(kind))
    n = 3 * block + block // 3 + 1
    x = _sample(rng, n, kind)
    enc = codecs.encode(name, x, block)
    assert enc.tobytes() == reference_encode(name, x, block)
    np.testing.assert_array_equal(codecs.decode(name, enc, n, block), reference_decode(name, enc.tobytes(), n, block))


# ------------------------------------------------------------------------------------------- decode and friends
finite = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=float(np.float32(-1e30)),
                   max_value=float(np.float32(1e30)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=st.integers(0, 600).flatmap(lambda n: hnp.arrays(np.float32, n, elements=finite)),
       block=st.sampled_from([8, 16, 100, 256, 512]), name=st.sampled_from(NAMES),
       w=st.sampled_from([1.0, 0.5, -2.0]))
def test_decode_accumulate_range_and_residual(x, block, name, w):
    n = x.size
    enc = codecs.encode(name, x, block)
    assert enc.size == codecs.encoded_nbytes(name, n, block)
    d = codecs.decode(name, enc, n, block)
    spec = codec_names.sparse(name)
    # at most K values per block are non-zero, each one of the kept positions, never larger than its block's scale
    lay = sparse.layout(spec, n, block)
    for j in range(lay.nb):
        blk = d[j * block:(j + 1) * block]
        assert np.count_nonzero(blk) <= (lay.k if j < lay.nfull else lay.k_last)
    acc = np.linspace(-1, 1, n).astype(np.float32)
    want = acc + np.float32(w) * d if w == 1.0 else None
    got = codecs.decode_accumulate(name, enc, n, w, acc.copy(), block)
    if want is not None:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, acc + w * d.astype(np.float64), rtol=1e-6, atol=1e-30)
    for a, c in ((0, n), (n // 3, n // 2), (max(n - 5, 0), min(5, n))):
        np.testing.assert_array_equal(codecs.decode_range(name, enc, n, a, c, block), d[a:a + c])
    r = codecs.residual(name, x, block)
    np.testing.assert_array_equal(r, x - d)
    if n:
        total, top = codecs.sparse_sumsq(name, enc, n, block)
        assert total == pytest.approx(float(np.dot(d.astype(np.float64), d)), rel=1e-6, abs=1e-300)


def test_error_feedback_sends_everything_eventually():
    # a constant delta pushed again and again with the residual carried: the running sum of what was sent tracks
    # the running sum of the deltas (the residual stays bounded), though each push sends 2% of the values
    rng = np.random.default_rng(3)
    x = rng.standard_normal(4096).astype(np.float32)
    res = np.zeros_like(x)
    sent = np.zeros(x.size, np.float64)
    errs = []
    for t in range(1, 401):
        y = x + res
        enc = codecs.encode("topk:0.02+int2", y, 256)
        d = codecs.decode("topk:0.02+int2", enc, y.size, 256)
        res = y - d
        sent += d
        if t % 100 == 0:
            errs.append(np.linalg.norm(sent - t * x.astype(np.float64)) / np.linalg.norm(t * x))
    # the residual stays bounded (about what 50 pushes of 2% leave behind), so the relative error falls as 1/t
    assert errs[-1] < 0.07 and errs[-1] < 0.3 * errs[0], errs


def test_bit_identical_across_thread_counts_and_pieces():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(3 * pieces.PIECE + 1000).astype(np.float32)
    for name in ("topk:0.02+int2", "topk:0.1+int8"):
        one = codecs.encode(name, x, 256, threads=1)
        assert np.array_equal(one, codecs.encode(name, x, 256, threads=4))
        acc1 = codecs.decode_accumulate(name, one, x.size, 0.3, np.zeros_like(x), 256, threads=1)
        acc4 = codecs.decode_accumulate(name, one, x.size, 0.3, np.zeros_like(x), 256, threads=4)
        assert np.array_equal(acc1, acc4)
        # the island's push encoder, fed in uneven chunks and encoding in pieces, lays out the same bytes
        pe = PushEncoder(name, 256, x.size, piece_elems=5000)
        for a in range(0, x.size, 7777):
            pe.feed(x[a:a + 7777])
        assert np.array_equal(pe.finish().view(np.ndarray), one)


def test_zero_and_empty():
    for name in NAMES:
        assert codecs.encode(name, np.zeros(0, np.float32)).size == 0
        z = codecs.encode(name, np.zeros(1000, np.float32))
        assert not codecs.decode(name, z, 1000).any()


def test_encoder_refuses_non_finite_and_out_of_range():
    x = np.ones(600, np.float32)
    x[300] = np.nan
    with pytest.raises(CodecError, match=r"w: non-finite value .*nan.* at index 300") as e:
        codecs.encode("topk:0.02+int2", x, 256, name="w")
    assert e.value.code == "nonfinite"
    x[300] = 3.1e38
    with pytest.raises(CodecError, match="beyond the block codecs' range"):
        codecs.encode("topk:0.02+int2", x, 256)


# ----------------------------------------------------------------------------------------- hostile encodings
def _good(name="topk:0.05+int2", n=700, block=256):
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    return codecs.encode(name, x, block).tobytes(), sparse.layout(codec_names.sparse(name), n, block)


def _corrupt(how):
    b, lay = _good()
    b = bytearray(b)
    i0 = lay.off_idx
    if how == "unsorted":
        b[i0], b[i0 + 1] = b[i0 + 1], b[i0]
    elif how == "repeat":
        b[i0 + 1] = b[i0]
    elif how == "range":   # the partial last block has 188 values
        b[lay.off_idx + 2 * lay.k + lay.k_last - 1] = 200
    elif how == "padding":   # K = 13 two-bit codes use 26 of 32 bits
        b[lay.off_val + lay.vb - 1] |= 0x40
    elif how == "nan-scale":
        b[0:4] = np.float32(np.nan).tobytes()
    elif how == "negative-scale":
        b[4:8] = np.float32(-1).tobytes()
    elif how == "huge-scale":
        b[8:12] = np.float32(3.3e38).tobytes()
    return bytes(b), lay


@pytest.mark.parametrize("how", ["unsorted", "repeat", "range", "padding", "nan-scale", "negative-scale",
                                 "huge-scale"])
def test_hostile_bodies_are_refused_and_acc_unchanged(how):
    b, lay = _corrupt(how)
    name, n = lay.spec.name, lay.numel
    acc = np.arange(n, dtype=np.float32)
    for call in (lambda: codecs.check_encoded(name, b, n), lambda: codecs.decode(name, b, n),
                 lambda: codecs.decode_accumulate(name, b, n, 1.0, acc), lambda: codecs.sparse_sumsq(name, b, n)):
        with pytest.raises(CodecError) as e:
            call()
        assert e.value.code == ("nonfinite" if how.endswith("scale") else "bad-data")
    assert np.array_equal(acc, np.arange(n, dtype=np.float32))


def test_wide_indices_are_checked_too():
    name, block, n = "topk:0.01+int4", 1024, 2500
    enc = bytearray(codecs.encode(name, np.random.default_rng(2).standard_normal(n).astype(np.float32), block))
    lay = sparse.layout(codec_names.sparse(name), n, block)
    assert lay.width == 2
    enc[lay.off_idx: lay.off_idx + 2] = np.uint16(1024).tobytes()   # the first index of block 0: >= the next
    with pytest.raises(CodecError, match="block 0"):
        codecs.check_encoded(name, bytes(enc), n, block)
    enc[lay.off_idx: lay.off_idx + 2] = np.uint16(0).tobytes()
    last = lay.off_idx + 2 * (2 * lay.k + lay.k_last) - 2    # the partial last block has 452 values
    enc[last:last + 2] = np.uint16(452).tobytes()
    with pytest.raises(CodecError, match="block 2"):
        codecs.check_encoded(name, bytes(enc), n, block)


def test_lengths_are_exact():
    b, lay = _good()
    for bad in (b[:-1], b + b"\0", b""):
        with pytest.raises(CodecError, match="must be"):
            codecs.check_encoded(lay.spec.name, bad, lay.numel)
