"""The soak test (benchmarks/soak.py) at its quick setting: three scripted islands through a relay that adds
latency, throttles, pauses reading and cuts connections; no island is dropped for a pause shorter than its
timeout, every round merges once, and the final model is bit-identical to the run without the relay."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(180)


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "benchmarks", "soak.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_quick_soak_over_a_slow_lossy_link():
    soak = load_soak()
    res = soak.check(soak.parse_args(["--quick", "--seed", "3"]))   # (pushes: f32, topk:0.05+int2, int4, int1)
    assert res["base_wire"] == "topk:0.1+int2" and res["base_updates"] > 0, res   # (sparse base updates)
    assert set(res["pushes_by_codec"]) == {"f32", "topk:0.05+int2", "int4", "int1"}, res   # every codec, merged
    assert res["violations"] == [], res
    assert res["bit_identical"] and res["drops"] == 0, res
    assert res["merges"] == res["rounds"] * res["fragments"], res
    assert res["cuts"] >= 1 and res["pauses"] >= 1 and res["reconnects"] >= 1, res
