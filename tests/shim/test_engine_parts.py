"""The engine's pure parts: the fragment schedule and the streaming push encoder (bit-identical to encoding the
whole fragment at once, with and without error feedback)."""
import numpy as np
import pytest

from yeto_patch.island.boundary.push_encoder import PushEncoder
from yeto_patch.island.boundary.schedule import due_fragments, offset
from yeto_patch.wire import codecs
from yeto_patch.wire.frames import CodecError


def test_schedule_spreads_fragments_evenly():
    H, P = 100, 4
    assert [offset(f, H, P) for f in range(P)] == [25, 50, 75, 0]
    hits = {}
    for s in range(1, 401):
        for f in due_fragments(s, H, P):
            hits.setdefault(f, []).append(s)
    assert hits == {0: [25, 125, 225, 325], 1: [50, 150, 250, 350], 2: [75, 175, 275, 375],
                    3: [100, 200, 300, 400]}
    assert due_fragments(0, H, P) == []


def test_schedule_more_fragments_than_steps():
    H, P = 2, 5
    seen = [f for s in range(1, 3) for f in due_fragments(s, H, P)]
    assert sorted(seen) == list(range(P))          # every fragment once per H steps


@pytest.mark.parametrize("codec", codecs.CODECS + ("topk:0.05+int2", "topk:0.1+int4"))
@pytest.mark.parametrize("numel,piece,block", [(1000, 256, 64), (4097, 1024, 256), (5, 1 << 20, 256),
                                               (777, 100, 8)])
def test_streamed_encoding_equals_whole(codec, numel, piece, block):
    rng = np.random.default_rng(numel)
    x = rng.standard_normal(numel).astype(np.float32) * 0.01
    enc = PushEncoder(codec, block, numel, piece_elems=piece)
    cuts = sorted(set(rng.integers(0, numel, 7).tolist()) | {0, numel})
    for a, b in zip(cuts, cuts[1:]):
        enc.feed(x[a:b])
    body = enc.finish()
    whole = np.frombuffer(bytes(codecs.encode(codec, x, block)), dtype=np.uint8)
    assert body.nbytes == codecs.encoded_nbytes(codec, numel, block)
    assert np.array_equal(body, whole)


@pytest.mark.parametrize("codec", ["int4", "int8", "int4-log", "bf16", "topk:0.1+int2"])
def test_error_feedback_carries_the_residual(codec):
    rng = np.random.default_rng(3)
    numel, block = 3000, 128
    residual = np.zeros(numel, np.float32)
    total_sent = np.zeros(numel, np.float64)
    total_true = np.zeros(numel, np.float64)
    for _ in range(20):
        x = (rng.standard_normal(numel) * 0.01).astype(np.float32)
        enc = PushEncoder(codec, block, numel, piece_elems=512, residual=residual)
        enc.feed(x)
        body = enc.finish()
        total_sent += codecs.decode(codec, body, numel, block)
        total_true += x
    # with error feedback, what was sent plus what is still carried equals what was meant, to float precision
    assert np.allclose(total_sent + residual, total_true, atol=1e-5)
    # and the carried error stays bounded (one quantization step; sparse: what ~10 pushes of 10% leave), not growing
    # with the rounds
    assert np.abs(residual).max() < (0.06 if codec.startswith("topk") else 0.02)


def test_non_finite_delta_names_the_fragment_and_tensor():
    enc = PushEncoder("int4", 8, 32, piece_elems=16, what="fragment 3 delta", entry_starts=[0, 16],
                      entry_names=["decoder.layers.0.mlp.weight", "decoder.layers.1.mlp.weight"])
    x = np.zeros(32, np.float32)
    x[20] = np.nan
    enc.feed(x[:16])
    with pytest.raises(CodecError, match="fragment 3 delta.*decoder.layers.1.mlp.weight.*NaN/inf"):
        enc.feed(x[16:])
        enc.finish()


def test_wrong_amount_of_values_is_an_error():
    enc = PushEncoder("f32", 256, 10)
    enc.feed(np.zeros(4, np.float32))
    with pytest.raises(CodecError, match="got 4 values"):
        enc.finish()
    with pytest.raises(CodecError, match="more values"):
        PushEncoder("f32", 256, 3).feed(np.zeros(4, np.float32))
