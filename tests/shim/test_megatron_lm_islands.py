"""Two islands of different layouts on Megatron-LM's own loop (megatron.training.pretrain), one syncer with a fixed
roster of two (tau = 0):
- after the start, every parameter of the island that did not initialize (FP32 masters and bf16 weights, norms,
  biases, position embeddings, embedding rows, the last pipeline stage's tied output-layer copy) equals the INIT
  tensor bit for bit, TP2 initializing PP2 and PP2 initializing TP2;
- the run's initial base is the lowest island id's INIT whichever island connects first, so the whole run is
  bit-reproducible under either connection order;
- vocabulary padding: islands that pad alike merge every row and end with identical tensors; an island whose
  padding differs from the run's says so on every rank at start-up and still merges the common rows."""
import importlib.util

import numpy as np
import pytest

from tests.shim import mlm_islands as M
from tests.shim import procs as P

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron-core < 0.17 ships no megatron.training")

VOCAB = 100    # TP1 pads it to 128 rows, TP2 to 256 (--make-vocab-size-divisible-by 128 x 2) or 128 (64 x 2)
ALIGN = {"a": ["--make-vocab-size-divisible-by", "64"]}   # the TP2 island "a" pads like the PP2 one


def check_start(tmp, init_from, other):
    init = M.dump(tmp, init_from)
    assert init, "no start dump"
    for kind in ("master", "param"):
        ref = init if kind == "master" else {k: P.as_bf16(v) for k, v in init.items()}
        got = M.dump(tmp, other, kind=kind)
        rows = M.compare(ref, got, VOCAB)
        assert not M.differing(rows), (kind, M.differing(rows), M.table(rows))
        assert {n for n, *_ in rows} >= {"embedding.position_embeddings.weight", "decoder.final_layernorm.bias",
                                         "embedding.word_embeddings.weight"}
    return init


@pytest.mark.timeout(3000)
def test_start_installs_every_tensor_and_a_tau0_run_does_not_depend_on_the_connection_order(tmp_path):
    finals = []
    for order in ("pp2-first", "tp2-first"):
        tmp = tmp_path / order
        tmp.mkdir()
        pair = [("a", "tp2"), ("b", "pp2")]            # "a" (TP2) is the lowest id: it initializes
        rcs, procs = M.run_pair(tmp, *(pair[::-1] if order == "pp2-first" else pair), vocab=VOCAB, iters=4,
                                extra=ALIGN)
        assert rcs == [0, 0, 0], P.logs(procs)
        assert M.initializer(procs[2].text()) == "a", order
        check_start(tmp, "a", "b")
        assert M.TIED in M.dump(tmp, "b")              # the last PP stage's tied copy was compared
        final, _ = P.syncer_model(str(tmp / "syncer.ckpt"))
        assert final["embedding.word_embeddings.weight"].shape[0] == 128     # every padded row is merged
        ends = {n: M.dump(tmp, n, "final") for n in "ab"}
        for n in "ab":   # same padding: both islands end with the syncer's final model, every row of it
            assert sorted(ends[n]) == sorted(final), n
            for k, v in final.items():
                assert np.array_equal(ends[n][k], v), (n, k, float(np.abs(ends[n][k] - v).max()))
        finals.append((final, ends))
    (f1, isl1), (f2, isl2) = finals
    assert sorted(f1) == sorted(f2)
    for k in f1:
        assert np.array_equal(f1[k], f2[k]), (k, float(np.abs(f1[k] - f2[k]).max()))
    for n in "ab":
        assert sorted(isl1[n]) == sorted(isl2[n])
        for k in isl1[n]:
            assert np.array_equal(isl1[n][k], isl2[n][k]), (n, k)


@pytest.mark.timeout(1800)
def test_pp2_initializing_tp2_and_a_padding_unlike_the_runs(tmp_path):
    """TP2 (256 rows) joins first and fixes the run's manifest; PP2 (128 rows) is refused, says so on both its
    ranks, joins with the run's 256 rows (128..255 virtual there) and, as the lowest id, initializes TP2."""
    rcs, procs = M.run_pair(tmp_path, ("b", "tp2"), ("a", "pp2"), vocab=VOCAB, iters=2)
    assert rcs == [0, 0, 0], P.logs(procs)
    assert M.initializer(procs[2].text()) == "a"
    said = [x for x in procs[1].text().splitlines() if "the run's manifest (fixed by the first island that joined) "
            "has 256 rows, this island pads the vocabulary to 128" in x]
    assert len(said) == 2 and all("--make-vocab-size-divisible-by" in x and "rows 128..255 are not held here" in x
                                  for x in said), said     # once per rank of the PP2 island
    init = check_start(tmp_path, "a", "b")
    assert np.array_equal(init[M.TIED], init["embedding.word_embeddings.weight"])   # PP2's own two copies
    final, _ = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    emb = "embedding.word_embeddings.weight"
    assert final[emb].shape[0] == 256
    tp2, pp2 = M.dump(tmp_path, "b", "final"), M.dump(tmp_path, "a", "final")
    for k, v in final.items():
        assert np.array_equal(tp2[k], v), k
        assert np.array_equal(pp2[k], v[:128] if k == emb else v), k   # the 128 common rows, real ones included
