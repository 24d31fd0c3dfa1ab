"""Sample names (with their labels) the syncer's and an island's registries export, for the checks of the
dashboard and alert rules against them."""
from yeto_patch.island.exporter import IslandExporter
from yeto_patch.syncer.metrics import Metrics

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
