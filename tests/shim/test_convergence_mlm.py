"""benchmarks/convergence_mlm.py in its CI setting (issue 24): Megatron-LM's pretrain() on indexed byte-level text,
two islands (TP2 seed 11 on shard 0, PP2 seed 22 on shard 1) at the defaults and with the fixed roster, 4 fragments, island a
initializing (the syncer's default policy takes the lowest id; the start the issue found worse), the lone island
from that start, and textbook DiLoCo (benchmarks/diloco_reference_mlm.py) from it. The DiLoCo run ends with one
final model (both islands' evaluations agree) that is no worse than the lone island from the same start and within
3% of the reference (the fixed roster's: the reference merges every island in every round), and the lone run starts bit for bit from the INIT the DiLoCo run took. (INIT from island b:
the benchmark's grid, docs/convergence.md; kept out of CI for time.)"""
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.shim import procs as P

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron-core < 0.17 ships no megatron.training")
# DiLoCo from a start may be at most this much worse than the lone island from it (loss ratio); measured at this
# setting: see docs/convergence.md ("The CI setting")
SLACK = 1.0


@pytest.mark.timeout(1200)
def test_two_islands_f4_are_no_worse_than_the_lone_island_from_the_same_start(tmp_path):
    out = tmp_path / "res.json"
    cmd = [sys.executable, "benchmarks/convergence_mlm.py", "--ci", "--jobs", "4", "--out", str(tmp_path),
           "--json", str(out), "--timeout", "700", "--init", "a", "--settings", "defaults,fixed roster"]
    r = subprocess.run(cmd, cwd=P.ROOT, env=P.base_env(), capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = {(c["kind"], c["init"], c.get("setting") if c["kind"] == "diloco" else None): c
           for c in json.loads(out.read_text())}
    assert sorted(res, key=str) == sorted([("diloco", "a", "defaults"), ("diloco", "a", "fixed roster"),
                                           ("lone", "a", None), ("ref", "a", None)], key=str), r.stdout[-3000:]
    lone, ref = res[("lone", "a", None)], res[("ref", "a", None)]      # ref: textbook DiLoCo, fp32, same start
    for setting in ("defaults", "fixed roster"):
        d = res[("diloco", "a", setting)]
        assert d["fragments"] == 4
        assert abs(d["islands"][0] - d["islands"][1]) < 2e-3, d           # one final model
        assert d["same_start"] is True, d                                  # the lone run's start is the INIT
        assert 2.0 < lone["loss"] < 5.5 and 2.0 < d["loss"] < 5.5, (d, lone)   # trained (ln 257 = 5.55)
        assert d["loss"] <= lone["loss"] * SLACK, (setting, d["loss"], lone["loss"], r.stdout[-3000:])
    # the reference merges every island in every round: the fixed roster does too, the elastic defaults do not
    # (at these 20 steps a CI run's timing put them 4.7% better than the reference), so the fixed roster is the
    # one compared with it
    d = res[("diloco", "a", "fixed roster")]
    assert ref["fragments"] == 4 and abs(d["loss"] / ref["loss"] - 1) < 0.03, (d["loss"], ref["loss"])
    assert "worst yeto/lone" in r.stdout
    # the reference was given the islands' own Megatron argument lists (--island); built from the benchmark's
    # options instead (--data, --seeds, ...) it is the same run: the same figure
    ref_json = tmp_path / "ref-opts.json"
    cmd = [sys.executable, "benchmarks/diloco_reference_mlm.py", "--init", lone["start"], "--data",
           str(tmp_path / "data"), "--seeds", "11:22", "--iters", "20", "-H", "5", "--eval-seqs", "16",
           "--fragments", "4", "--json", str(ref_json)]
    r = subprocess.run(cmd, cwd=P.ROOT, env=P.base_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.loads(ref_json.read_text())["diloco"] == ref["loss"]
    # with the product's codec on the pushes (--push-dtype, the islands' error feedback): another run, near it
    cmd += ["--push-dtype", "int1", "--push-block", "1024"]
    cmd[cmd.index(str(ref_json))] = str(tmp_path / "ref-int1.json")
    r = subprocess.run(cmd, cwd=P.ROOT, env=P.base_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    coded = json.loads((tmp_path / "ref-int1.json").read_text())
    assert coded["pushes"] == "int1 block 1024 + error feedback", coded
    assert coded["diloco"] != ref["loss"] and abs(coded["diloco"] / ref["loss"] - 1) < 0.05, (coded, ref)


def test_ms_per_iteration_leaves_out_start_up_and_the_final_cut_wait():
    """The table's ms per iteration is an island's training pace: Megatron's first window (start-up) and last
    (a fast island waiting at its last step for the final cut) are left out."""
    from benchmarks import convergence_mlm as mod
    assert mod.training_ms([900.0, 55.0, 53.0, 57.0, 666.4]) == pytest.approx(55.0)
    assert mod.training_ms([900.0, 60.0]) == 60.0 and mod.training_ms([900.0]) is None and mod.training_ms([]) is None


def test_a_row_sets_a_variable_on_one_island_only(monkeypatch):
    """``b:VAR=V`` in a --row goes to island b alone (H pinned per island); an unknown island prefix is refused."""
    from benchmarks import convergence_mlm as mod
    monkeypatch.setattr(mod, "SETTINGS", dict(mod.SETTINGS))
    env = {"YETO_DILOCO_PUSH_DTYPE": "int1", "b:YETO_DILOCO_SYNC_EVERY": "16"}
    assert mod.island_env(env, "a") == {"YETO_DILOCO_PUSH_DTYPE": "int1"}
    assert mod.island_env(env, "b") == {"YETO_DILOCO_PUSH_DTYPE": "int1", "YETO_DILOCO_SYNC_EVERY": "16"}
    a = mod.parse(["--only", "diloco", "--row", "lockstep|b:YETO_DILOCO_SYNC_EVERY=16|--quorum 2"])
    assert a.settings == ["lockstep"]
    with pytest.raises(SystemExit):
        mod.parse(["--only", "diloco", "--row", "bad|c:YETO_DILOCO_SYNC_EVERY=16|"])
