"""The operator's Grafana dashboard (docs/grafana/yeto-syncer.json) queries only what the syncer exports: every
PromQL expression parses (benchmarks/promql.py), every metric it selects is a sample name of the syncer's
registry (counters as <name>_total, histograms as _bucket / _sum / _count), and every label it groups or filters
by is one of that metric's labels. And it covers what an operator needs to see."""
import json
import os

import pytest

from benchmarks import promql
from yeto_patch.syncer.observe.metrics import Metrics
from yeto_patch.syncer.rounds.records import MergeRecord

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "docs", "grafana", "yeto-syncer.json")


def exported() -> dict:
    """{sample name: its label names} of every metric the syncer's registry exports."""
    out = {}
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    m = Metrics()
    label_names = {v._name: set(v._labelnames) for v in vars(m).values() if hasattr(v, "_labelnames")}
    for fam in m.registry.collect():
        labels = label_names[fam.name]
        for sfx in suffixes[fam.type]:
            out[fam.name + sfx] = labels | ({"le"} if sfx == "_bucket" else set())
    return out


def expressions() -> list:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


@pytest.mark.parametrize("title,expr", expressions())
def test_every_query_selects_an_exported_metric_and_its_labels(title, expr):
    have = exported()
    for name, labels in promql.selectors(promql.parse(expr)):
        assert name in have, (title, name, sorted(have))
        assert set(labels) <= have[name], (title, name, labels, have[name])


def test_the_dashboard_shows_what_an_operator_watches():
    metrics = {name for _, e in expressions() for name, _ in promql.selectors(promql.parse(e))}
    for need in ("yeto_syncer_fragment_version", "yeto_syncer_merges_total", "yeto_syncer_merge_seconds_bucket",
                 "yeto_syncer_island_pushes_total", "yeto_syncer_bytes_received_total",
                 "yeto_syncer_bytes_sent_total", "yeto_syncer_push_lag_versions_bucket", "yeto_syncer_members",
                 "yeto_syncer_shard", "yeto_syncer_island_merge_weight", "yeto_syncer_outer_lr"):
        assert need in metrics, need
    with open(DASHBOARD) as f:
        dash = json.load(f)
    assert any(v["type"] == "datasource" for v in dash["templating"]["list"])   # any Prometheus data source
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_a_query_of_a_metric_the_syncer_does_not_export_is_caught():
    have = exported()
    bad = promql.selectors(promql.parse('sum by (island) (rate(yeto_syncer_pushes_total{island="a"}[5m]))'))
    assert bad == [("yeto_syncer_pushes_total", ("island",))]
    assert not set(bad[0][1]) <= have["yeto_syncer_pushes_total"]       # pushes{status} has no island label
    with pytest.raises(ValueError):
        promql.parse("topk(3, yeto_syncer_members)")


def test_the_evaluator_computes_rates_sums_and_quantiles_from_scrapes():
    """The renderer of the docs' picture draws what these queries give over real scrapes."""
    m = Metrics()
    scrapes = []
    for i, t in enumerate((0.0, 10.0, 20.0)):
        for island in ("a", "b"):
            m.record_push(island, {"status": "accepted"})
        m.record_push("b", {"status": "refused", "code": "stale"})
        m.record_merge(MergeRecord(fragment=0, version=i + 1, ok=True, total_weight=2.0, bytes=10, quorum_s=0.1,
                                   merge_s=0.02 * (i + 1), grad_norm=1.0, expected=["a", "b"], outer_lr=0.7,
                                   responders=[{"island": "a", "lag": 0, "weight": 1.5},
                                               {"island": "b", "lag": 1, "weight": 0.5}]))
        from prometheus_client import generate_latest
        scrapes.append((t, promql.parse_exposition(generate_latest(m.registry).decode())))
    s = promql.Samples(scrapes)

    def at(expr):
        return {tuple(sorted(k)): v for k, v in promql.evaluate(promql.parse(expr), s, 20.0, 30.0).items()}
    rate = at("sum by (island, outcome) (rate(yeto_syncer_island_pushes_total[$__rate_interval])) * 60")
    assert rate[(("island", "a"), ("outcome", "accepted"))] == pytest.approx(6.0)
    assert rate[(("island", "b"), ("outcome", "refused"))] == pytest.approx(6.0)
    assert at("yeto_syncer_island_merge_weight")[(("island", "a"),)] == pytest.approx(0.75)
    lag = at("sum by (island) (rate(yeto_syncer_push_lag_versions_sum[1m])) / "
             "sum by (island) (rate(yeto_syncer_push_lag_versions_count[1m]))")
    assert lag == {(("island", "a"),): 0.0, (("island", "b"),): 1.0}
    q = at("histogram_quantile(0.5, sum by (le) (rate(yeto_syncer_merge_seconds_bucket[1m])))")
    assert 0.01 < q[()] <= 0.05
