"""benchmarks/chaos.py at its CI setting (--quick: the syncer's defaults, 40 s of high chaos over six simulated
islands of speeds 1 to 0.35 that run the product's island link code): no healthy island stops, rounds go on while
islands are killed, cut off and paused, the killed islands come back from their checkpoints, and the final cut
ends the run. Timing figures are the benchmark's to print (the machine is shared); the checks here are loose.
Runtime: about 1 minute (most of it the fixed 40 s)."""
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(420)


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_quick_chaos_at_the_defaults(tmp_path, capsys):
    chaos = load("chaos")
    out = tmp_path / "rows.json"
    assert chaos.main(["--quick", "--seed", "1", "--out", str(tmp_path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["config"] == "defaults" and row["kills"] >= 1, row
    assert row["lost"] == [] and row["unfinished"] == [] and row["syncer_rc"] == 0, row
    assert row["pushes"] > 0 and row["unended"] == 0, row   # every push ended merged or refused (issue 35)
    assert row["merges_per_min"] > 0 and row["downtime_s"] < 0.5 * 40, row   # rounds went on through the chaos
    assert 0.5 < row["goodput"] <= 1.0 and row["utilisation"] > 0.3, row
    assert capsys.readouterr().out.splitlines()[-1].startswith("chaos: goodput ")
