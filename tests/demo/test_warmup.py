"""Synchronous warm-up (``yeto-patch demo --sync-warmup K``): examples/train_gpt.py's --snapshot-at / --init-from
resume a run exactly (weights, FP32 masters, Adam state, LR schedule position), and the demo's islands start
DiLoCo from the synchronous baseline's model after step K."""
import json
import os
import subprocess
import sys
import time

import pytest

from .test_demo import ROOT, _env, _has, needs_megatron

TRAIN = os.path.join(ROOT, "examples", "train_gpt.py")
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--train-iters", "30", "--lr", "6e-3", "--min-lr", "6e-4", "--lr-warmup-iters", "10", "--eval-interval",
         "15", "--eval-seqs", "16", "--log-interval", "0", "--num-shards", "2", "--shards", "0",
         "--global-batch-size", "8", "--micro-batch-size", "4"]


def _recs(path):
    return [json.loads(x) for x in open(path).read().splitlines()]


def _train(*extra):
    env = _env()
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, TRAIN] + FLAGS + list(extra), cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


@needs_megatron
def test_init_from_a_snapshot_continues_the_run_bit_for_bit(tmp_path):
    """30 steps in one go (snapshot after 15) against 15 + 15 resumed from the snapshot: every later step's loss
    and lr and the final held-out loss are identical. Without the Adam state (measured: the moments left empty)
    the final loss differs by 0.09, without the weights the resumed run starts at ln(256)."""
    snap, a, b = tmp_path / "snap.npz", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _train("--snapshot-at", "15", "--snapshot", str(snap), "--log-jsonl", str(a))
    _train("--init-from", str(snap), "--log-jsonl", str(b))
    ra, rb = _recs(a), _recs(b)
    ta = {r["step"]: (r["loss"], r["lr"]) for r in ra if r["event"] == "train"}
    tb = {r["step"]: (r["loss"], r["lr"]) for r in rb if r["event"] == "train"}
    assert sorted(tb) == list(range(16, 31))
    assert {s: ta[s] for s in tb} == tb
    ea = {r["step"]: r["heldout_loss"] for r in ra if r["event"] == "eval"}
    eb = {r["step"]: r["heldout_loss"] for r in rb if r["event"] == "eval"}
    assert sorted(eb) == [15, 30] and eb == {15: ea[15], 30: ea[30]}
    assert ea[0] > 5.0 and ea[15] < 4.0  # the resumed run did not start from a fresh model
    end = [r for r in rb if r["event"] == "end"][0]
    assert end["start_step"] == 15 and end["initial_heldout_loss"] == ea[15]


@pytest.mark.slow
@needs_megatron
@pytest.mark.skipif(not (_has("yeto_patch.syncer.cli") and _has("yeto_patch.island.engine")),
                    reason="the syncer CLI or the island engine is not in this checkout yet")
def test_demo_sync_warmup_islands_start_from_the_baselines_step_k(tmp_path):
    """--short with single-rank islands and --sync-warmup 20: the baseline runs first and keeps its state after
    step 20; both islands evaluate that model before their first step (the same held-out loss as the baseline's
    own evaluation at step 20, far below a fresh model's), train steps 21..60 and end identical; the bytes
    ratios count the warm-up's 20 all-reduce steps."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "yeto_patch.demo", "--short", "--layouts", "single", "--sync-warmup", "20",
           "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--progress-every", "30"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, f"demo failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = json.loads((out / "result.json").read_text())
    at_k = res["baseline_heldout_at_warmup"]
    assert at_k is not None and at_k < 4.0  # byte-level loss of a fresh model is about ln(256) = 5.55
    assert res["initial_heldout_loss"] == pytest.approx(at_k, abs=1e-6)
    base = _recs(out / "baseline.jsonl")
    assert [r["heldout_loss"] for r in base if r["event"] == "eval"][0] > 5.0
    for name in res["ids"]:
        recs = _recs(out / f"island-{name}.jsonl")
        assert [r["step"] for r in recs if r["event"] == "resume"] == [20]
        assert [r["step"] for r in recs if r["event"] == "train"] == list(range(21, 61))
        first = [r for r in recs if r["event"] == "eval"][0]
        assert first["step"] == 20 and first["heldout_loss"] == pytest.approx(at_k, abs=1e-6)
    assert res["islands_identical"] is True, res["islands_compare"]
    assert res["merges"] > 0 and res["warmup_steps"] == 20
    assert res["warmup_allreduce_bytes"] == res["allreduce_bytes"] * 20 // 60
    assert res["bytes_ratio"] < res["bytes_ratio_diloco_only"]
    print(f"warm-up demo: {time.time() - t0:.0f}s, baseline at step 20 {at_k:.4f}, islands start "
          f"{res['initial_heldout_loss']:.4f}, final ratio {res['loss_ratio']:.4f}")
