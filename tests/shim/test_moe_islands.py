"""Mixture-of-Experts islands end to end on Megatron-LM's own loop (tests/shim/scripts/pretrain_gpt_cpu.py, 4
experts, top-2, alltoall), three islands in one run: two with expert parallelism 2 (a, c) and one without (b:
DP2, every rank holds every expert). EP2 beside EP1 checks that experts are named by global index; EP2 beside EP2
checks expert aliasing, where the manifests are alike even if an island named its experts as EP rank 0's (the
bug class the original system had to fix in production): only the weights can tell. Every island's final model
(gathered with megatron's own expert groups and numbered by global expert index, independently of yeto-patch) and
its Megatron checkpoint are identical to the others', expert by expert; every expert moved from its initial
value; no two experts of a layer are equal; the loss fell on every island. (One run of three islands instead of
two runs of two: the same pairs, one syncer and one start-up less.)"""
import importlib.util
import os
import re

import numpy as np
import pytest

from tests.launchers.launch import dist_checkpoint, only_iter_dir
from tests.shim import mlm_islands as M
from tests.shim import procs as P

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron-core < 0.17 ships no megatron.training")

ITERS, LAYERS, EXPERTS = 4, 2, 4
EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)$")


def lm_losses(log: str) -> list:
    return [float(m) for m in re.findall(r"lm loss: ([0-9.]+E[+-][0-9]+)", log)]


ISLANDS = (("a", "ep2"), ("b", "dp2"), ("c", "ep2"))
NAMES = [name for name, _ in ISLANDS]


def _run(tmp):
    extra = {name: [*M.MOE, "--save", os.path.join(str(tmp), name, "ckpt"), "--save-interval", "1000"]
             for name in NAMES}
    rcs, procs = M.run_islands(tmp, ISLANDS, vocab=100, iters=ITERS, extra=extra)
    assert rcs == [0] * (len(ISLANDS) + 1), P.logs(procs)
    return procs


def _experts(model: dict) -> dict:
    """{(layer, expert): {rest: array}} of the expert tensors."""
    out = {}
    for k, v in model.items():
        m = EXPERT.match(k)
        if m:
            out.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = v
    return out


@pytest.mark.timeout(1800)
def test_moe_islands_ep2_ep1_ep2_end_with_the_same_experts_every_one_trained_and_distinct(tmp_path):
    procs = _run(tmp_path)
    final, _ = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    experts = _experts(final)
    assert sorted(experts) == [(lay, e) for lay in range(LAYERS) for e in range(EXPERTS)], sorted(experts)
    start = M.dump(tmp_path, "a")      # the initial base, as installed at the start (island a initialized)
    for name in NAMES:
        got = M.dump(tmp_path, name, "final")
        assert sorted(got) == sorted(final), sorted(set(got) ^ set(final))
        for k, v in final.items():     # expert by expert, by global expert index
            assert np.array_equal(got[k], v), (name, k, float(np.abs(got[k] - v).max()))
        assert np.array_equal(M.dump(tmp_path, name)["decoder.layers.1.mlp.experts.3.linear_fc2.weight"],
                              start["decoder.layers.1.mlp.experts.3.linear_fc2.weight"])   # b, c started there too
    for (layer, e), tensors in experts.items():
        for rest, v in tensors.items():
            k = f"decoder.layers.{layer}.mlp.experts.{e}.{rest}"
            assert not np.array_equal(v, start[k]), f"expert {e} of layer {layer} never trained ({rest})"
        for e2 in range(e + 1, EXPERTS):
            assert not any(np.array_equal(v, experts[(layer, e2)][rest]) for rest, v in tensors.items()), \
                f"experts {e} and {e2} of layer {layer} are equal"
    for p in procs[:len(ISLANDS)]:
        ls = lm_losses(p.text())
        assert len(ls) == ITERS and ls[-1] < ls[0], (p.name, ls)
    ck = {n: dist_checkpoint(only_iter_dir(tmp_path / n / "ckpt")) for n in NAMES}
    model = {n: {k: v for k, v in c.items() if "optimizer" not in k} for n, c in ck.items()}
    for other in NAMES[1:]:     # Megatron's own checkpoints (resharded by global expert index)
        assert sorted(model["a"]) == sorted(model[other]), other
        for k, v in model["a"].items():
            assert np.array_equal(v, model[other][k]), (other, k, float(np.abs(v - model[other][k]).max()))
    for fc in ("linear_fc1", "linear_fc2"):   # [layer, global expert, ...] there: the syncer's final experts
        stacked = model["a"][f"decoder.layers.mlp.experts.experts.{fc}.weight"]
        assert stacked.shape[:2] == (LAYERS, EXPERTS)
        for (layer, e), tensors in experts.items():
            assert np.array_equal(stacked[layer, e], P.as_bf16(tensors[f"{fc}.weight"])), (fc, layer, e)
