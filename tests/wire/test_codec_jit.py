"""The fused (numba) codec kernels against the numpy reference kernels: byte-equal encodings, bit-equal decodes
and accumulations, the same refusals, on every layout (block sizes, odd tails, pieces, threads)."""
import numpy as np
import pytest

from yeto_patch.wire import codec_jit, codecs, pieces
from yeto_patch.wire.frames import CodecError

pytestmark = pytest.mark.skipif(not codec_jit.available(), reason="numba is not installed")
BLOCK_CODECS = ("int8", "int4", "int4-log", "int1")
INT1_BLOCK = {2: 8, 6: 24}   # int1 packs 8 values a byte: its blocks are multiples of 8


@pytest.fixture
def reference():
    """Run the body with the numpy kernels, then restore the fused ones."""
    def run(fn):
        codec_jit.set_enabled(False)
        try:
            return fn()
        finally:
            codec_jit.set_enabled(True)
    return run


def _data(rng, n, kind):
    if kind == "wide":
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))).astype(np.float32)
    elif kind == "grid":   # exact ties at .5 steps of the quantization grid, zeros and negative zeros
        x = (rng.integers(-16, 17, n) * 0.5).astype(np.float32)
        x[::7] = -0.0
    elif kind == "tiny":   # subnormal blocks: the clamp of absmax to tiny_k
        x = (rng.standard_normal(n) * 1e-42).astype(np.float32)
    elif kind == "blocks":   # runs of 50 values (across block edges) of unlike shapes: the sparse encoder guesses
        # each block's threshold from the previous one; zero and constant runs (every value a candidate, ties),
        # one spike in zeros, scales 1e-30 .. 1e30, heavy tails
        x = rng.standard_normal(n).astype(np.float32)
        for r0 in range(0, n, 50):
            seg = x[r0:r0 + 50]
            shape = r0 // 50 % 6
            if shape == 0:
                seg[:] = 0.0
            elif shape == 1:
                seg[:] = np.float32(-3.5)
            elif shape == 2:
                seg[:] = 0.0
                seg[len(seg) // 2] = 1.0
            elif shape == 3:
                seg *= np.float32(10.0 ** rng.integers(-30, 31))
            elif shape == 4:
                seg[:] = (rng.standard_cauchy(len(seg)) * 1e3).astype(np.float32)
    else:
        x = rng.standard_normal(n).astype(np.float32)
    return x


@pytest.mark.parametrize("codec", BLOCK_CODECS)
@pytest.mark.parametrize("block", [2, 6, 64, 256, 1000])
@pytest.mark.parametrize("kind", ["normal", "wide", "grid", "tiny", "blocks"])
def test_byte_equal_to_the_reference(codec, block, kind, reference):
    if codec == "int1":
        block = INT1_BLOCK.get(block, block)
    rng = np.random.default_rng(block * 7 + len(kind) + len(codec))
    for n in (1, 5, block - 1, block, 3 * block + 1, 2 * pieces.PIECE + 3):
        if n < 1:
            continue
        x = _data(rng, n, kind)
        want = reference(lambda: codecs.encode(codec, x, block))
        got = codecs.encode(codec, x, block)
        assert got.tobytes() == want.tobytes(), (codec, block, kind, n)
        acc0 = rng.standard_normal(n).astype(np.float32)
        for w in (1.0, 0.3, -2.0):
            r = reference(lambda: codecs.decode_accumulate(codec, want, n, w, acc0.copy(), block))
            assert codecs.decode_accumulate(codec, want, n, w, acc0.copy(), block).tobytes() == r.tobytes()
        r = reference(lambda: codecs.decode(codec, want, n, block))
        assert codecs.decode(codec, want, n, block).tobytes() == r.tobytes()


@pytest.mark.parametrize("codec", BLOCK_CODECS)
def test_codes_never_produced_decode_alike(codec, reference):
    """int8 -128, int4 nibble 0, int4-log nibble 8 (a sign without a level): accepted and decoded as the reference
    decodes them."""
    n, block = 512, 256
    body = codecs.encode(codec, np.random.default_rng(1).standard_normal(n).astype(np.float32), block).copy()
    body[8:] = np.random.default_rng(2).integers(0, 256, body.size - 8, dtype=np.uint8)
    want = reference(lambda: codecs.decode(codec, body, n, block))
    assert codecs.decode(codec, body, n, block).tobytes() == want.tobytes()


@pytest.mark.parametrize("codec", BLOCK_CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3.1e38])
def test_refusals_are_the_reference_s(codec, bad, reference):
    x = np.ones(3000, np.float32)
    x[1234] = bad

    def message():
        with pytest.raises(CodecError) as e:
            codecs.encode(codec, x, 256, name="w")
        return str(e.value), e.value.code
    assert message() == reference(message)


def test_threads_do_not_change_the_bytes():
    x = _data(np.random.default_rng(9), 3 * pieces.PIECE + 5, "wide")
    for codec in BLOCK_CODECS:
        one = codecs.encode(codec, x, 256, threads=1)
        assert one.tobytes() == codecs.encode(codec, x, 256, threads=3).tobytes()
        a = codecs.decode_accumulate(codec, one, x.size, 0.7, np.zeros_like(x), 256, threads=1)
        assert a.tobytes() == codecs.decode_accumulate(codec, one, x.size, 0.7, np.zeros_like(x), 256,
                                                       threads=3).tobytes()


SPARSE = ("topk:0.02+int2", "topk:0.05+int4", "topk:0.1+int8", "topk:0.5+int2")


@pytest.mark.parametrize("codec", SPARSE)
@pytest.mark.parametrize("block", [8, 63, 256, 1024])
@pytest.mark.parametrize("kind", ["normal", "wide", "grid", "tiny", "blocks"])
def test_sparse_byte_equal_to_the_reference(codec, block, kind, reference):
    rng = np.random.default_rng(block * 3 + len(kind) + len(codec))
    for n in (1, block - 1, 3 * block + 5, pieces.PIECE + block + 1):
        x = _data(rng, n, kind)
        want = reference(lambda: codecs.encode(codec, x, block))
        assert codecs.encode(codec, x, block).tobytes() == want.tobytes(), (codec, block, kind, n)
        acc0 = rng.standard_normal(n).astype(np.float32)
        for w in (1.0, -0.3):
            r = reference(lambda: codecs.decode_accumulate(codec, want, n, w, acc0.copy(), block))
            assert codecs.decode_accumulate(codec, want, n, w, acc0.copy(), block).tobytes() == r.tobytes()
        r = reference(lambda: codecs.decode(codec, want, n, block))
        assert codecs.decode(codec, want, n, block).tobytes() == r.tobytes()


@pytest.mark.parametrize("bad", [np.nan, -np.inf, 3.1e38])
def test_sparse_refusals_are_the_reference_s(bad, reference):
    x = np.ones(3000, np.float32)
    x[1234] = bad

    def message():
        with pytest.raises(CodecError) as e:
            codecs.encode("topk:0.02+int2", x, 256, name="w")
        return str(e.value), e.value.code
    assert message() == reference(message)
