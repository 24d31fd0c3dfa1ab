"""An island of a custom training loop (examples/train_gpt.py) killed hard and launched again from its own
checkpoints: the demo's --save-interval / --kill with a real syncer, real torchrun islands and real megatron-core on
CPU, yeto-patch attached through PYTHONPATH and YETO_* only, the checkpoints told to it through
yeto_patch.hooks.checkpoint_saved / checkpoint_loaded.

Island B is SIGKILLed (every process of it) once it logged step 6, after its checkpoint at 4, and relaunched with
--load 1 s later. It must resume from that checkpoint and its sync state, reach the final cut at step 16 and hold
the syncer's final model; with the syncer's fixed roster (--quorum 2) every round must hold exactly one push of
each island: none lost, none counted twice."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.demo.test_demo import _env, needs_megatron

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY, KILL_AT = 16, 4, 6


@pytest.mark.slow
@needs_megatron
@pytest.mark.timeout(600)
def test_island_killed_hard_comes_back_from_its_checkpoint(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "yeto_patch.demo", "--steps", str(STEPS), "--hidden", "32", "--layers", "1",
           "--heads", "2", "--seq-length", "32", "--batch", "4", "--micro-batch", "2", "--sync-every", "4",
           "--fragments", "2", "--overlap-steps", "1", "--eval-interval", str(STEPS), "--eval-seqs", "4",
           "--warmup", "2", "--layouts", "single", "--fp32", "--no-baseline", "--save-interval", str(EVERY),
           "--kill", f"1:{KILL_AT}:1", "--syncer-arg=--quorum=2", "--out", str(out), "--progress-every", "10"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, f"demo failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = json.loads((out / "result.json").read_text())
    (kill,) = res["kills"]
    assert kill["id"] == "B-single" and kill["killed_step"] >= KILL_AT and kill["restarted_t"] > kill["killed_t"]
    first, again = (out / "logs" / "island-B-single.log").read_text(), \
        (out / "logs" / "island-B-single-relaunch1.log").read_text()
    assert "installed the syncer's final model" not in first, first[-3000:]         # it died mid-run
    assert "saved the island's sync state for iteration 4" in first, first[-3000:]

    recs = [json.loads(x) for x in (out / "island-B-single.jsonl").read_text().splitlines()]
    (resume,) = [r for r in recs if r["event"] == "resume"]
    back = resume["step"]     # its latest checkpoint when it was killed (4, or 8 if the kill landed late)
    assert resume["checkpoint"] and back % EVERY == 0 and EVERY <= back <= kill["killed_step"], (resume, kill)
    assert f"resuming the island's sync state of iteration {back} " in again, again[-3000:]
    lives = [i for i, r in enumerate(recs) if r["event"] == "start"]
    assert len(lives) == 2
    after = [r["step"] for r in recs[lives[1]:] if r["event"] == "train"]
    assert after == list(range(back + 1, STEPS + 1))                      # on from the checkpoint to the end
    assert "step 16: installed the syncer's final model" in again

    tape = [json.loads(x) for x in (out / "syncer-tape.jsonl").read_text().splitlines() if x.strip()]
    for t in tape:   # every round: one push of each island, none counted twice
        assert t["ok"] and sorted(r["island"] for r in t["responders"]) == ["A-single", "B-single"], t
    from tests.shim.procs import syncer_model
    model, versions = syncer_model(str(out / "syncer.ckpt"))
    assert versions == {0: 5, 1: 4}, versions   # H=4, 2 fragments, 16 steps: every round of the run, once
    for iid in ("A-single", "B-single"):
        with np.load(out / f"island-{iid}.npz") as z:
            for name, arr in model.items():
                assert np.array_equal(z[f"master/{name}"], arr), (iid, name)
    assert (out / "island-B-single.ckpt" / "yeto_sync" / f"iter_{back:07d}.bin").exists()
