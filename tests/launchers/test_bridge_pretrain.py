"""Megatron-Bridge's real `pretrain()` as DiLoCo islands, attached only through PYTHONPATH and YETO_*: a TP2 bf16
island with the distributed optimizer and a DP2 fp32 island, a syncer, a final cut before Bridge's last
iteration. Bridge leaves its loop through its own exit interval, so the checkpoint it saves there is numbered by
the steps it holds, and both islands' checkpoints hold the syncer's final model.

The TP2 island is also stopped at iteration 2 through Bridge's exit interval (it saves, with the sync state beside
the checkpoint) and launched again with cfg.checkpoint.load: it restores the sync state, continues its rounds to
the final cut, and every round is merged exactly once, from both islands. (One run for both: each Bridge start-up
costs about a minute on the CI machine.)"""
import json
import re
import time

import numpy as np
import pytest

from tests.launchers import need
from tests.launchers import launch as L
from tests.shim import procs as P

pytestmark = need("megatron.bridge")

ITERS, CUT = 6, 4
LAYERS = 2


def losses(log: str) -> list:
    return [float(m) for m in re.findall(r"lm loss: ([0-9.]+E[+-][0-9]+)", log)]


def per_layer(model: dict) -> dict:
    out = {}
    for k, v in model.items():
        if k.startswith("optimizer.") or k.startswith("rng_state"):
            continue
        if k.startswith("decoder.layers."):
            rest = k[len("decoder.layers."):]
            rest = {"mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
                    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias"}.get(rest, rest)
            assert v.shape[0] == LAYERS, (k, v.shape)
            for i in range(LAYERS):
                out[f"decoder.layers.{i}.{rest}"] = v[i]
        else:
            out[k] = v
    return out


@pytest.mark.timeout(1500)
def test_bridge_islands_of_different_layouts_one_stopped_and_resumed_end_with_the_same_model(tmp_path):
    t0 = time.time()
    port = P.free_port()
    key = P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=2, fragments=2, key=key)
    yeto = {name: L.yeto_env(port, key, name, tmp_path, YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_TOTAL_STEPS=CUT)
            for name in ("tp2", "dp2")}
    args = {name: [*layout, "--iters", str(ITERS), "--save", str(tmp_path / name / "ckpt"), "--save-interval", "100"]
            for name, layout in (("tp2", ["--tp", "2", "--bf16"]), ("dp2", []))}
    tp2 = L.start_bridge(tmp_path, "tp2", [*args["tp2"], "--exit-interval", "2"], yeto=yeto["tp2"])
    dp2 = L.start_bridge(tmp_path, "dp2", args["dp2"], yeto=yeto["dp2"])
    procs = [syncer, tp2, dp2]
    try:
        assert P.wait_all([tp2], timeout=900) == [0], P.logs(procs)
        assert "saved the island's sync state for iteration 2" in tp2.text(), tp2.text()[-3000:]
        resumed = L.start_bridge(tmp_path, "tp2-resumed", [*args["tp2"], "--load", str(tmp_path / "tp2" / "ckpt")],
                                 yeto=yeto["tp2"])
        procs.append(resumed)
        rcs = P.wait_all([resumed, dp2, syncer], timeout=1200)
        assert rcs == [0, 0, 0], P.logs(procs)
    finally:
        for p in procs:
            p.kill()
    print(f"two Bridge pretrain() islands (one stopped and resumed) + syncer: {time.time() - t0:.0f}s")

    assert "resuming the island's sync state of iteration 2" in resumed.text(), resumed.text()[-4000:]
    final, versions = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    models = {}
    for name, last, logs in (("tp2", resumed, tp2.text() + resumed.text()), ("dp2", dp2, dp2.text())):
        log = last.text()
        assert "installed the syncer's final model" in log, log[-3000:]
        assert f"exiting program at iteration {CUT}" in log, log[-3000:]   # Bridge's own exit rule
        ls = losses(logs)
        assert len(ls) == CUT and ls[-1] < ls[0], (name, ls)
        ckpt = tmp_path / name / "ckpt"
        with open(ckpt / "latest_checkpointed_iteration.txt") as f:
            assert f.read().strip() == str(CUT)     # numbered by the updates it holds (not CUT - 1)
        models[name] = per_layer(L.dist_checkpoint(ckpt / f"iter_{CUT:07d}"))   # (tp2 also saved iter 2)
    a, b = models["tp2"], models["dp2"]
    assert sorted(a) == sorted(b) == sorted(final), sorted(set(a) ^ set(final))
    for k, v in final.items():
        # the vocabulary is padded to a multiple of 128 x TP (1001 -> 1024 rows); the padding rows see no data
        # and are not synchronised, so the real rows are compared
        rows = v.shape[0]
        assert a[k].shape[1:] == b[k].shape[1:] == v.shape[1:] and min(a[k].shape[0], b[k].shape[0]) >= rows, k
        assert np.array_equal(b[k][:rows], v), (k, float(np.abs(b[k][:rows] - v).max()))            # fp32: exact
        assert np.array_equal(a[k][:rows], P.as_bf16(v)), (k, float(np.abs(a[k][:rows] - v).max()))  # bf16: cast
    with open(tmp_path / "tape.jsonl") as f:
        tape = [json.loads(line) for line in f if line.strip()]
    rounds = [(t["fragment"], t["version"]) for t in tape]
    assert len(rounds) == len(set(rounds)), rounds            # every round merged once, the resumed island's too
    assert tape and all(sorted(r["island"] for r in t["responders"]) == ["dp2", "tp2"] for t in tape), tape
    assert versions == {0: 3, 1: 2}, versions
