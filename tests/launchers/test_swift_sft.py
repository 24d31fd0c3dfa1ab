"""ms-swift's `megatron sft` (its own Megatron trainer loop, the real CLI) as a DiLoCo island, attached only through
PYTHONPATH and YETO_*, stopped after a checkpoint and resumed from it. (Two ms-swift islands of different layouts,
TP2 and DP2, ending with the same model at a final cut before ms-swift's last iteration: tests/launchers/
test_mixed_islands.py, in one run with a Megatron-LM island; the helpers below are shared with it.)"""
import glob
import json
import os
import re
import time

import pytest

from tests.launchers import need
from tests.launchers import launch as L
from tests.shim import procs as P

pytestmark = need("swift", "mcore_bridge")

ITERS, CUT = 6, 4


def losses(log: str) -> list:
    return [float(m) for m in re.findall(r"\{'loss': ([0-9.]+)", log)]


def checkpoint(out_dir, iteration):
    found = glob.glob(os.path.join(str(out_dir), "v*", f"checkpoint-{iteration}"))
    assert len(found) == 1, (out_dir, found, glob.glob(os.path.join(str(out_dir), "v*", "*")))
    return found[0]


def model_part(ckpt_dir) -> dict:
    return {k: v for k, v in L.dist_checkpoint(L.only_iter_dir(ckpt_dir)).items() if not k.startswith("optimizer.")}


# megatron-core's sharded checkpoint names the local spec's norms as Transformer Engine's fused ones
_CKPT_TO_PARAM = {"mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                  "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight"}


def per_layer(model: dict) -> dict:
    """{parameter name: array}: the checkpoint's stacked decoder.layers.* split into decoder.layers.<i>.*."""
    out = {}
    for k, v in model.items():
        if k.startswith("decoder.layers."):
            rest = k[len("decoder.layers."):]
            rest = _CKPT_TO_PARAM.get(rest, rest)
            for i in range(v.shape[0]):
                out[f"decoder.layers.{i}.{rest}"] = v[i]
        else:
            out[k] = v
    return out


def _tape(tmp_path) -> list:
    with open(tmp_path / "tape.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_for(proc, text, timeout):
    deadline = time.time() + timeout
    while text not in proc.text() and proc.poll() is None and time.time() < deadline:
        time.sleep(1)
    return text in proc.text()


@pytest.mark.timeout(1500)
def test_megatron_sft_island_stopped_and_resumed_from_its_checkpoint_rejoins(tmp_path):
    """The island is stopped after ms-swift saved checkpoint-2 (and its sync state beside it), then launched again
    with `--mcore_model .../checkpoint-2 --finetune false`: it restores the sync state, continues its rounds, and
    every round is merged exactly once (pushes made after the checkpoint and sent again are not counted twice)."""
    tiny = L.tiny_qwen2(tmp_path / "tiny")
    port = P.free_port()
    key = P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=1, fragments=2, key=key)
    out = tmp_path / "sft"
    # bf16 (masters separate from the model's weights): resuming an fp32 run fails inside megatron-core 0.19.2's
    # distributed-optimizer load (an in-place copy into a leaf parameter that requires grad; docs/launchers.md)
    args = L.swift_sft_args(tiny, out, tp=1, iters=ITERS,
                            extra=["--save_steps", "2", "--torch_dtype", "bfloat16", "--bf16", "true"])
    yeto = L.yeto_env(port, key, "a", tmp_path, YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_TOTAL_STEPS=CUT,
                      YETO_DILOCO_OVERLAP_STEPS=0)
    # held (every rank) once 3 iterations are done: after checkpoint-2 and the push of step 3 (tau 0: merged), so
    # the relaunch from checkpoint-2 repeats step 3's push, which must not be merged twice
    a = L.start_swift(tmp_path, "a", args, yeto=yeto, LAUNCHER_TEST_HOLD_AT="3")
    procs = [syncer, a]
    try:
        assert _wait_for(a, "launcher test hold: 3 iterations done", 900), P.logs(procs)
        assert "saved the island's sync state for iteration 2" in a.text(), P.logs(procs)
        a.kill()                                                  # stopped after its checkpoint at 2
        assert {"fragment": 0, "version": 2}.items() <= _tape(tmp_path)[-1].items(), _tape(tmp_path)
        ck2 = checkpoint(out, 2)
        assert os.path.exists(os.path.join(ck2, "yeto_sync", "iter_0000002.bin"))
        b = L.start_swift(tmp_path, "a2", [*args, "--mcore_model", ck2, "--finetune", "false"], yeto=yeto)
        procs.append(b)
        rcs = P.wait_all([b, syncer], timeout=900)
        assert rcs == [0, 0], P.logs(procs)
    finally:
        for p in procs:
            p.kill()
    log = b.text()
    assert "resuming the island's sync state of iteration 2" in log, log[-4000:]
    # ms-swift trains the Hugging Face model's weights: a pretrained start, which the restart keeps saying
    assert all(re.search(r"final cut at step \d+, from pretrained weights", x) for x in (a.text(), log)), log[-4000:]
    assert "installed the syncer's final model" in log and f"'iteration': '{CUT}/{CUT}'" in log
    assert os.path.exists(os.path.join(checkpoint(out, CUT), "latest_checkpointed_iteration.txt"))
    tape = _tape(tmp_path)
    rounds = [(t["fragment"], t["version"]) for t in tape]
    assert len(rounds) == len(set(rounds)), rounds                 # every round merged once
    assert all([r["island"] for r in t["responders"]] == ["a"] for t in tape), tape
    _, versions = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    assert versions == {0: 3, 1: 2}, versions
