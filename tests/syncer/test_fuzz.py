"""The hostile-input fuzzer (benchmarks/fuzzlib.py; script: benchmarks/fuzz_syncer.py) with its quick setting: a
few thousand hostile inputs against a real syncer process; nothing crashes, grows, stays open or changes state."""
import pytest

from benchmarks import fuzzlib as fz

pytestmark = pytest.mark.timeout(120)


def test_quick_fuzz_holds_every_invariant():
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
