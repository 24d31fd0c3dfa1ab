"""An island killed and restarted from its Megatron checkpoint continues its DiLoCo rounds where the checkpoint
left them (Megatron-LM's own loop, attached only through the environment).

Island b stops at iteration 6 through Megatron's --exit-interval (it saves, then exits) and is launched again
with --load; island a and the syncer run on, waiting for it (fixed roster). Its sync state (anchors' versions,
counters, error-feedback residuals, unanswered pushes) was saved beside the checkpoint and is restored, so with
int4 pushes, error feedback and tau = 0 the final model is bit-identical to the run without the restart.

megatron-core's plain-PyTorch Adam path (no Transformer Engine / Apex) cannot resume exactly by itself (T5-T7 in
tests/mcore/mlm_cpu_patches.py, patched in the test harness): the comparison is against what Megatron does when
correct."""
import importlib.util
import json
import os
import time

import numpy as np
import pytest

from tests.shim import procs as P
from tests.shim.test_megatron_lm_loop import mlm_args, torchrun

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron-core < 0.17 ships no megatron.training")

ITERS, STOP = 12, 6


def env(port, key, name, tmp):
    return dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID=name,
                YETO_DILOCO_SYNC_EVERY=4, YETO_DILOCO_PUSH_DTYPE="int4", YETO_DILOCO_ERROR_FEEDBACK=1,
                YETO_DILOCO_OVERLAP_STEPS=0, YETO_DILOCO_TIMEOUT=240,
                YETO_DILOCO_METRICS=str(tmp / f"metrics.{name}.jsonl"))


def args(seed, ckpt, extra=()):
    # (later occurrences of --seed and --train-iters override mlm_args' defaults)
    # dropout off: on CPU the test-only patches cannot save and restore the CUDA RNG tracker that dropout uses,
    # so Megatron itself could not resume exactly with it
    return [*mlm_args(ckpt, ["--seed", str(seed), "--save", ckpt, "--save-interval", str(STOP),
                             "--hidden-dropout", "0", "--attention-dropout", "0", *extra]),
            "--train-iters", str(ITERS)]


def run(tmp, restart):
    port = P.free_port()
    key = P.key_file(tmp)
    syncer = P.start_syncer(tmp, port, islands=2, fragments=2, key=key)
    ca, cb = str(tmp / "ckpt_a"), str(tmp / "ckpt_b")
    a = torchrun(tmp, "a", args(1, ca), env(port, key, "a", tmp))
    # a joins first, then b; a, the lowest id, initializes the run (the same initial weights in every run)
    deadline = time.time() + 300
    while "island a joined" not in syncer.text() and a.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    b = torchrun(tmp, "b", args(2, cb, ["--exit-interval", str(STOP)] if restart else []), env(port, key, "b", tmp))
    procs = [syncer, a, b]
    try:
        if restart:
            assert P.wait_all([b], timeout=400) == [0], P.logs(procs)     # b saved at STOP and exited
            assert "saved the island's sync state for iteration 6" in b.text(), b.text()[-3000:]
            b = torchrun(tmp, "b2", args(2, cb, ["--load", cb]), env(port, key, "b", tmp))
            procs.append(b)
        rcs = P.wait_all([syncer, a, b], timeout=500)
        assert rcs == [0, 0, 0], P.logs(procs)
    finally:
        for p in procs:
            p.kill()
    return procs


@pytest.mark.timeout(1500)
def test_island_restarted_from_its_checkpoint_ends_bit_identical(tmp_path):
    ref, cut = tmp_path / "reference", tmp_path / "restart"
    ref.mkdir()
    cut.mkdir()
    run(ref, restart=False)
    procs = run(cut, restart=True)
    log = procs[-1].text()
    assert "resuming the island's sync state of iteration 6" in log, log[-4000:]
    assert os.path.exists(cut / "ckpt_b" / "yeto_sync" / "iter_0000006.bin")
    model_ref, v_ref = P.syncer_model(str(ref / "syncer.ckpt"))
    model_cut, v_cut = P.syncer_model(str(cut / "syncer.ckpt"))
    assert v_ref == v_cut
    assert sorted(model_ref) == sorted(model_cut)
    for k in model_ref:
        assert np.array_equal(model_ref[k], model_cut[k]), (k, float(np.abs(model_ref[k] - model_cut[k]).max()))
    with open(cut / "metrics.b.jsonl") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    # both fragments kept the local progress of iteration 6 (the syncer waited at the same versions)
    assert [r["reason"] for r in recs if r["event"] == "install"] == ["resume", "resume"], recs


@pytest.mark.timeout(900)
def test_island_killed_at_a_random_moment_rejoins_and_its_pushes_count_once(tmp_path):
    """Island b's rank 0 is SIGKILLed at a random moment of a random iteration after its checkpoint at 6 (pushes
    made since may or may not have been merged; torchrun then ends the job). Relaunched with --load it rejoins,
    skips the rounds already merged with its pushes of before, and the run ends with every round merged from both
    islands exactly once."""
    import random

    port = P.free_port()
    key = P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=2, fragments=2, key=key)
    ca, cb = str(tmp_path / "ckpt_a"), str(tmp_path / "ckpt_b")
    # (the kill lands up to 0.15 s after iteration kill_at starts: at most 10, so never in the final cut at 12,
    # after which the syncer may end the run before the relaunched island is back)
    kill_at = random.randint(STOP + 1, ITERS - 2)
    a = torchrun(tmp_path, "a", args(1, ca), env(port, key, "a", tmp_path))
    b = torchrun(tmp_path, "b", args(2, cb, ["--crash-at-iteration", str(kill_at)]), env(port, key, "b", tmp_path))
    procs = [syncer, a, b]
    try:
        assert P.wait_all([b], timeout=400) != [0], P.logs(procs)    # rank 0 SIGKILLed itself mid-iteration
        b = torchrun(tmp_path, "b2", args(2, cb, ["--load", cb]), env(port, key, "b", tmp_path))
        procs.append(b)
        rcs = P.wait_all([syncer, a, b], timeout=500)
        assert rcs == [0, 0, 0], (kill_at, P.logs(procs))
    finally:
        for p in procs:
            p.kill()
    assert "resuming the island's sync state of iteration 6" in b.text()
    with open(tmp_path / "tape.jsonl") as f:
        tape = [json.loads(line) for line in f if line.strip()]
    for t in tape:   # every round: one push from each island, none counted twice
        assert sorted(r["island"] for r in t["responders"]) == ["a", "b"], (kill_at, t)
    _, versions = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    assert versions == {0: 4, 1: 3}, (kill_at, versions)
