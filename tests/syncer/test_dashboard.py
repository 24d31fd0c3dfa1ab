"""The operator's Grafana dashboard (docs/grafana/yeto-syncer.json) queries only what the syncer exports: every
metric a PromQL expression names is a sample name of the syncer's registry (counters as <name>_total,
histograms as _bucket / _sum / _count), and every label it groups or filters by is one of those metrics' labels.
And it covers what an operator needs to see. (Prometheus itself evaluates every query over a real run:
tests/ops/test_prometheus.py.)"""
import json
import os

import pytest

from tests.ops.exported import exported, names_and_labels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "docs", "grafana", "yeto-syncer.json")


def expressions() -> list:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def _check(title, expr, have):
    names, labels = names_and_labels(expr)
    assert names, (title, expr)
    for name in names:
        assert name in have, (title, name, sorted(have))
        assert labels <= have[name], (title, name, labels, have[name])


@pytest.mark.parametrize("title,expr", expressions())
def test_every_query_selects_an_exported_metric_and_its_labels(title, expr):
    _check(title, expr, exported())


def test_the_dashboard_shows_what_an_operator_watches():
    metrics = {name for _, e in expressions() for name in names_and_labels(e)[0]}
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
    assert names_and_labels('sum by (island) (rate(yeto_syncer_pushes_total{status="a"}[5m]))') == (
        {"yeto_syncer_pushes_total"}, {"island", "status"})
    with pytest.raises(AssertionError):     # pushes{status} has no island label
        _check("bad", 'sum by (island) (rate(yeto_syncer_pushes_total[5m]))', have)
    with pytest.raises(AssertionError):     # a renamed metric
        _check("bad", 'yeto_syncer_member', have)
