"""Prometheus metrics (prometheus-client, own registry) and the JSONL merge tape."""
from __future__ import annotations

import json
import threading
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics", "Tape"]


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
        self.server = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        res = start_http_server(port, addr=addr, registry=self.registry)
        if isinstance(res, tuple):  # prometheus-client >= 0.17 returns (server, thread)
            self.server = res[0]
            return self.server.server_port
        return port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def record_merge(self, rec) -> None:
        frag = str(rec.fragment)
        if rec.ok:
            self.merges.labels(frag).inc()
            self.version.labels(frag).set(rec.version)
            self.grad_norm.labels(frag).set(rec.grad_norm)
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
