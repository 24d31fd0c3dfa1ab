"""Sample names (with their labels) the syncer's and an island's registries export, for the checks of the
dashboard and alert rules against them."""
from yeto_patch.island.exporter import IslandExporter
from yeto_patch.syncer.observe.metrics import Metrics

SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> dict:
    """{sample name: its label names} of every metric the syncer's and an island's registries export."""
    out = {}
    for owner in (Metrics(), IslandExporter("a")):
        label_names = {v._name: set(v._labelnames) for v in vars(owner).values() if hasattr(v, "_labelnames")}
        for fam in owner.registry.collect():
            labels = label_names[fam.name]
            for sfx in SUFFIXES[fam.type]:
                out[fam.name + sfx] = labels | ({"le"} if sfx == "_bucket" else set())
    return out


def names_and_labels(expr: str):
    """(metric names, label names) a PromQL expression of the dashboard or the rules refers to: the ``yeto_*``
    names, and the labels it groups by (``by (...)``) or matches (``{label=...}``). Lexical: enough for the
    queries written here (Prometheus itself evaluates them: tests/ops/test_prometheus.py)."""
    import re
    names = set(re.findall(r"\b(yeto_[a-z_]+)", expr))
    labels = set()
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", matchers))
    return names, labels
