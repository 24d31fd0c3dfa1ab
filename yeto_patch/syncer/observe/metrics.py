"""Prometheus metrics (prometheus-client, own registry), the bounded server that exposes them, and the JSONL merge
tape.

The operator's dashboard over them is ``docs/grafana/yeto-syncer.json`` (tests/syncer/test_dashboard.py checks
that every metric and label it queries is one exported here). Island ids become label values only for islands
that authenticated (``record_push`` / ``record_merge``), at most ``MAX_ISLAND_LABELS`` of them; the others are
counted under ``island="other"``.
"""
from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

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
        self._islands: set = set()
        self.server = None

    def serve(self, port: int, addr: str = "127.0.0.1", **limits) -> int:
        """Serve the metrics on ``addr:port`` (port 0: any free port; returns the port). ``limits``: see
        :class:`MetricsServer`."""
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
        self.island_pushes.labels(self._island(island), status, code[:32]).inc()

    def record_push_bytes(self, island, nbytes: int) -> None:
        self.bytes_in.labels("push").inc(nbytes)
        self.island_bytes.labels(self._island(island)).inc(nbytes)

    def record_merge(self, rec) -> None:
        frag = str(rec.fragment)
        if rec.ok:
            self.merges.labels(frag).inc()
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


class MetricsServer:
    """A minimal HTTP/1.0 server for Prometheus scrapes on ONE thread (non-blocking sockets, a selector): whoever
    can reach the port cannot make the syncer start threads or hold memory. ``GET /metrics`` (or ``/``) answers
    ``body()``, anything else 404/405, then the connection closes. At most ``max_connections`` are open (a new one
    closes the oldest, so idle connections cannot keep a scraper out); each one is closed ``idle_s`` after it was
    accepted whether or not its request arrived or its answer was read; a request is at most ``max_request``
    bytes."""

    def __init__(self, body, port: int, addr: str = "127.0.0.1", *, max_connections: int = 16, idle_s: float = 5.0,
                 max_request: int = 8192):
        self.body, self.max_connections, self.idle_s, self.max_request = body, max_connections, idle_s, max_request
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((addr, port))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._open: dict = {}   # socket -> _Exchange
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="yeto-metrics", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for key, events in self._sel.select(timeout=0.2):
                    if key.data is None:
                        self._accept()
                    else:
                        self._serve(key.fileobj, key.data, events)
                now = time.monotonic()
                for sock in [s for s, x in self._open.items() if now - x.since > self.idle_s]:
                    self._drop(sock)
        finally:
            for sock in list(self._open):
                self._drop(sock)
            self._sel.close()
            self._listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        if len(self._open) >= self.max_connections:
            self._drop(min(self._open, key=lambda s: self._open[s].since))
        sock.setblocking(False)
        x = self._open[sock] = _Exchange()
        self._sel.register(sock, selectors.EVENT_READ, x)

    def _serve(self, sock, x: "_Exchange", events: int) -> None:
        try:
            if events & selectors.EVENT_READ and not x.reply:
                data = sock.recv(4096)
                if not data:
                    return self._drop(sock)
                x.request += data
                if b"\r\n\r\n" in x.request or b"\n\n" in x.request:
                    x.reply = self._answer(bytes(x.request))
                    self._sel.modify(sock, selectors.EVENT_WRITE, x)
                elif len(x.request) > self.max_request:
                    return self._drop(sock)
            if events & selectors.EVENT_WRITE and x.reply:
                n = sock.send(x.reply[x.sent:x.sent + (1 << 16)])
                x.sent += n
                if x.sent >= len(x.reply):
                    self._drop(sock)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(sock)

    def _answer(self, request: bytes) -> bytes:
        line = request.split(b"\n", 1)[0].split()
        method, path = (line[0], line[1].split(b"?")[0]) if len(line) >= 2 else (b"", b"")
        if method not in (b"GET", b"HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
        elif path not in (b"/metrics", b"/"):
            status, ctype, body = "404 Not Found", "text/plain", b"GET /metrics\n"
        else:
            status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.body()
        head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode("ascii")
        return head + (b"" if method == b"HEAD" else body)

    def _drop(self, sock) -> None:
        self._open.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        try:
            sock.close()
        except OSError:
            pass


class _Exchange:
    """One metrics connection: what it sent so far, the answer and how much of it went out."""

    def __init__(self):
        self.since = time.monotonic()
        self.request = bytearray()
        self.reply = b""
        self.sent = 0


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
