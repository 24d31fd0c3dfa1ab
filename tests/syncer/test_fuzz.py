"""The hostile-input fuzzer (benchmarks/fuzz_syncer.py) with its quick setting: a few thousand hostile inputs
against a real syncer process; nothing crashes, grows, stays open or changes state."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(120)


def load_fuzzer():
    spec = importlib.util.spec_from_file_location("fuzz_syncer", os.path.join(ROOT, "benchmarks", "fuzz_syncer.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def test_quick_fuzz_holds_every_invariant():
    fz = load_fuzzer()
    res = fz.run(fz.parse_args(["--quick", "--seed", "1"]))
    text = fz.report(res)
    assert res["violations"] == [], text
    assert res["crashes"] == 0 and res["internal_errors"] == 0, text
    assert res["state_unchanged"] and res["checkpoint_unchanged"], text
    assert res["rss_growth_mib"] < 256, text
    assert res["churn"]["ids"] == 150, text  # churned ids left the ledger unchanged (state_unchanged above)
    assert res["partial_init_s"] < 30, text  # a stalled partial INIT was handed to the legitimate island
    rows = res["rows"]
    assert res["frames"] >= 3000 and not res["capped"], text
    assert all(r.get("open", 0) == 0 and r.get("unexpected", 0) == 0 for r in rows.values()), text
    push = rows["pushes"]  # refused one by one on one authenticated connection (junk between them ignored)
    assert push["refused"] >= 2000 and push["refused"] + push["ignored"] == push["sent"], text
    assert sum(rows[c]["sent"] for c in fz.PRE_AUTH) >= 400, text  # one connection each
    for cat in fz.ROWS:
        assert rows[cat]["sent"] > 0, (cat, text)
        if cat != "pushes":  # every hostile connection was closed by the syncer
            assert rows[cat]["error"] + rows[cat]["closed"] == rows[cat]["sent"], (cat, text)
