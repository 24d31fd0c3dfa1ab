"""Prometheus metrics (prometheus-client, own registry), the bounded server that exposes them, and the JSONL merge
tape.

The operator's dashboard over them is ``docs/grafana/yeto-syncer.json`` (tests/syncer/test_dashboard.py checks
that every metric and label it queries is one exported here). Island ids become label values only for islands
that authenticated (``record_push`` / ``record_merge``), at most ``MAX_ISLAND_LABELS`` of them; the others are
counted under ``island="other"``.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from ...wire.scrape_server import MetricsServer

__all__ = ["Metrics", "MetricsServer", "Tape", "MAX_ISLAND_LABELS"]

MAX_ISLAND_LABELS = 256


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.merges = Counter("yeto_syncer_merges", "Merges committed", ["fragment"], registry=r)
        self.merge_refusals = Counter("yeto_syncer_merge_refusals", "Merges refused (non-finite result)",
                                      registry=r)
        self.pushes = Counter("yeto_syncer_pushes", "Pushes by outcome", ["status"], registry=r)
        self.bytes_in = Counter("yeto_syncer_bytes_received", "Payload bytes received", ["kind"], registry=r)
        self.bytes_out = Counter("yeto_syncer_bytes_sent", "Payload bytes sent", ["kind"], registry=r)
        self.version = Gauge("yeto_syncer_fragment_version", "Merges of each fragment", ["fragment"], registry=r)
        self.members = Gauge("yeto_syncer_members", "Islands alive by lease", registry=r)
        self.connections = Gauge("yeto_syncer_connections", "Open island connections", registry=r)
        self.grad_norm = Gauge("yeto_syncer_outer_grad_norm", "Norm of the last outer gradient", ["fragment"],
                               registry=r)
        self.merge_seconds = Histogram("yeto_syncer_merge_seconds", "Merge (fold of carried + outer step) time",
                                       registry=r, buckets=(.001, .01, .05, .1, .5, 1, 5, 10, 30, 60, 300))
        self.quorum_seconds = Histogram("yeto_syncer_quorum_wait_seconds", "First push to merge start",
                                        registry=r, buckets=(.01, .1, .5, 1, 5, 10, 30, 60, 300, 1800))
        self.checkpoint_seconds = Gauge("yeto_syncer_checkpoint_seconds", "Duration of the last checkpoint write",
                                        registry=r)
        self.shard = Gauge("yeto_syncer_shard", "1 for this process's shard index and the shard count "
                           "(--shard; a whole syncer: 0 of 1)", ["shard", "shards"], registry=r)
        # by island (the dashboard's per-island panels)
        self.island_pushes = Counter("yeto_syncer_island_pushes", "Pushes by island and outcome (accepted, "
                                     "carried, closed, refused) and refusal code", ["island", "outcome", "code"],
                                     registry=r)
        self.island_bytes = Counter("yeto_syncer_island_bytes_received", "Push payload bytes received by island",
                                    ["island"], registry=r)
        self.push_lag = Histogram("yeto_syncer_push_lag_versions", "Versions a merged push was behind the "
                                  "fragment (its staleness; 0: on time)", ["island"], registry=r,
                                  buckets=(0, 1, 2, 3, 5, 10))
        self.island_weight = Gauge("yeto_syncer_island_merge_weight", "An island's share of the weight of the "
                                   "last merge it was in", ["island"], registry=r)
        self.responders = Gauge("yeto_syncer_merge_pushes", "Pushes folded into the last merge", ["fragment"],
                                registry=r)
        self.outer_lr = Gauge("yeto_syncer_outer_lr", "Outer learning rate of the last merge", ["fragment"],
                              registry=r)
        # (the alert rules, docs/grafana/yeto-alerts.yml: a round stalled beyond N x its period, an island gone)
        self.last_merge = Gauge("yeto_syncer_last_merge_timestamp_seconds", "Unix time of the fragment's last "
                                "merge", ["fragment"], registry=r)
        self.merge_interval = Gauge("yeto_syncer_merge_interval_seconds", "Time between the fragment's last two "
                                    "merges (its round period)", ["fragment"], registry=r)
        self.island_last_push = Gauge("yeto_syncer_island_last_push_timestamp_seconds", "Unix time of the "
                                      "island's last push (any outcome)", ["island"], registry=r)
        self._islands: set = set()
        self._last_merge: dict = {}   # fragment -> unix time of its last merge
        self.server = None

    def serve(self, port: int, addr: str = "127.0.0.1", **limits) -> int:
        """Serve the metrics on ``addr:port`` (port 0: any free port; returns the port). ``limits`` (and
        ``pages``, e.g. the status page): see :class:`MetricsServer` (wire/scrape_server.py)."""
        self.server = MetricsServer(lambda: generate_latest(self.registry), port, addr, **limits)
        return self.server.port

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def _island(self, island) -> str:
        island = str(island)
        if island not in self._islands and len(self._islands) >= MAX_ISLAND_LABELS:
            return "other"
        self._islands.add(island)
        return island

    def record_push(self, island, reply: dict) -> None:
        """A push's outcome (the PUSH_REPLY sent: status, and code when refused)."""
        status = str(reply.get("status", "?"))
        self.pushes.labels(status).inc()
        code = str(reply.get("code", "")) if status == "refused" else ""
        island = self._island(island)
        self.island_pushes.labels(island, status, code[:32]).inc()
        self.island_last_push.labels(island).set(time.time())

    def record_push_bytes(self, island, nbytes: int) -> None:
        self.bytes_in.labels("push").inc(nbytes)
        self.island_bytes.labels(self._island(island)).inc(nbytes)

    def record_merge(self, rec) -> None:
        frag = str(rec.fragment)
        if rec.ok:
            self.merges.labels(frag).inc()
            now, last = time.time(), self._last_merge.get(frag)
            if last is not None:
                self.merge_interval.labels(frag).set(now - last)
            self._last_merge[frag] = now
            self.last_merge.labels(frag).set(now)
            self.version.labels(frag).set(rec.version)
            self.grad_norm.labels(frag).set(rec.grad_norm)
            self.responders.labels(frag).set(len(rec.responders))
            if rec.outer_lr is not None:
                self.outer_lr.labels(frag).set(rec.outer_lr)
            total = float(rec.total_weight or 0.0)
            for r in rec.responders:
                island = self._island(r.get("island"))
                self.push_lag.labels(island).observe(int(r.get("lag", 0)))
                if total > 0:
                    self.island_weight.labels(island).set(float(r.get("weight", 0.0)) / total)
        else:
            self.merge_refusals.inc()
        self.merge_seconds.observe(rec.merge_s)
        self.quorum_seconds.observe(rec.quorum_s)


class Tape:
    """One JSON object per line per merge, flushed as written."""

    def __init__(self, path: Optional[str]):
        self._fh = open(path, "a", encoding="utf-8") if path else None
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        if self._fh is None:
            return
        line = json.dumps(record, separators=(",", ":"), allow_nan=True)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
