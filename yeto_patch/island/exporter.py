"""An island's own Prometheus metrics (``YETO_DILOCO_METRICS_PORT``), served by island rank 0 on the bounded
metrics server (wire/scrape_server.py), for the alert rules in docs/grafana/yeto-alerts.yml that only an island
can see: the syncer unreachable from it, and its training thread waiting for bases.

Every sample carries ``island`` (this island's id). From the boundary log's records (a sink of
``boundary/log.BoundaryLog``) and, at each scrape, the link to the syncer:

- ``yeto_island_syncer_reachable``: 1 while the syncer is connected and heard from, else 0 (read at the scrape).
- ``yeto_island_syncer_unreachable_seconds``: seconds since a scrape last found the syncer reachable (0 while it
  is; counted from the exporter's start before the first reachable scrape).
- ``yeto_island_step``: the training step of the last record.
- ``yeto_island_pushes_total``: fragment pushes completed (a base installed in answer).
- ``yeto_island_wait_seconds_total``: time the training thread was blocked waiting for bases (the records'
  wait_ms, staged_wait_ms and snapshot_wait_ms).
- ``yeto_island_reconnects_total``: reconnections to the syncer.
- ``yeto_island_fragment_version{fragment}``: the base version installed per fragment.
- ``yeto_island_last_install_timestamp_seconds``: unix time of the last base installed.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from ..wire.scrape_server import MetricsServer

__all__ = ["IslandExporter"]

WAIT_FIELDS = ("wait_ms", "staged_wait_ms", "snapshot_wait_ms")
MAX_FRAGMENT_LABELS = 1024


class IslandExporter:
    """The island's registry, fed by ``record`` (a BoundaryLog sink) and served by ``serve``. ``reachable``: the
    link's ``reachable()`` (None: the metric reads 0, no link)."""

    def __init__(self, island: str, reachable: Optional[Callable[[], bool]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.island, self._reachable, self._clock = str(island), reachable, clock
        self._lock = threading.Lock()
        self._heard = clock()
        r = self.registry = CollectorRegistry()
        lab = ["island"]
        self.reachable = Gauge("yeto_island_syncer_reachable", "1 while the syncer is connected and heard from",
                               lab, registry=r)
        self.unreachable = Gauge("yeto_island_syncer_unreachable_seconds", "Seconds since the syncer was last "
                                 "found reachable (0 while it is)", lab, registry=r)
        self.step = Gauge("yeto_island_step", "Training step of the last boundary record", lab, registry=r)
        self.pushes = Counter("yeto_island_pushes", "Fragment pushes answered by an installed base", lab,
                              registry=r)
        self.waits = Counter("yeto_island_wait_seconds", "Time the training thread waited for bases", lab,
                             registry=r)
        self.reconnects = Counter("yeto_island_reconnects", "Reconnections to the syncer", lab, registry=r)
        self.version = Gauge("yeto_island_fragment_version", "Base version installed per fragment",
                             lab + ["fragment"], registry=r)
        self.last_install = Gauge("yeto_island_last_install_timestamp_seconds", "Unix time of the last base "
                                  "installed", lab, registry=r)
        for m in (self.pushes, self.waits, self.reconnects):
            m.labels(self.island)   # (present, at 0, from the first scrape)
        self.server: Optional[MetricsServer] = None

    def record(self, rec: dict) -> None:
        """A boundary-log record (boundary/log.py's events)."""
        event, i = rec.get("event"), self.island
        step = rec.get("step")
        if _num(step):
            self.step.labels(i).set(step)
        wait = sum(float(rec[f]) for f in WAIT_FIELDS if _num(rec.get(f)) and rec[f] > 0)
        if wait:
            self.waits.labels(i).inc(wait / 1000.0)
        if event == "reconnect":
            self.reconnects.labels(i).inc()
        if event in ("boundary", "install") and _num(rec.get("version")) and _num(rec.get("fragment")):
            if event == "boundary":
                self.pushes.labels(i).inc()
            frag = int(rec["fragment"])
            if 0 <= frag < MAX_FRAGMENT_LABELS:
                self.version.labels(i, str(frag)).set(rec["version"])
            self.last_install.labels(i).set(float(rec["time"]) if _num(rec.get("time")) else time.time())

    def scrape(self) -> bytes:
        """The metrics as Prometheus' text, the link read now."""
        with self._lock:
            now = self._clock()
            alive = False
            if self._reachable is not None:
                try:
                    alive = bool(self._reachable())
                except Exception:  # noqa: BLE001 - a link being torn down reads as unreachable
                    alive = False
            if alive:
                self._heard = now
            self.reachable.labels(self.island).set(1 if alive else 0)
            self.unreachable.labels(self.island).set(0.0 if alive else round(now - self._heard, 3))
            return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: any free port); returns the port."""
        self.server = MetricsServer(self.scrape, port, addr)
        return self.server.port

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
