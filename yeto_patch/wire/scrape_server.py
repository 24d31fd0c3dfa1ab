"""The bounded HTTP server of a metrics port (the syncer's ``--metrics-port``, an island's
``YETO_DILOCO_METRICS_PORT``): Prometheus scrapes and small read-only pages, on one thread, bytes only."""
from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Callable, Dict, NamedTuple, Optional, Tuple

__all__ = ["MetricsServer", "Page", "CONTENT_TYPE"]

# Prometheus' text exposition format (prometheus_client.exposition.CONTENT_TYPE_LATEST)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Page(NamedTuple):
    """A page's answer: its bytes, content type and extra headers ((name, value) pairs, ASCII)."""
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    headers: Tuple[Tuple[str, str], ...] = ()


class MetricsServer:
    """A minimal HTTP/1.0 server for Prometheus scrapes on ONE thread (non-blocking sockets, a selector): whoever
    can reach the port cannot make the process start threads or hold memory. ``GET /metrics`` (or ``/``) answers
    ``body()`` (Prometheus' text format), ``GET <path>`` of ``pages`` answers ``pages[path]()`` (a ``Page``),
    anything else 404/405, then the connection closes. At most ``max_connections`` are open (a new one
    closes the oldest, so idle connections cannot keep a scraper out); each one is closed ``idle_s`` after it was
    accepted whether or not its request arrived or its answer was read; a request is at most ``max_request``
    bytes."""

    def __init__(self, body, port: int, addr: str = "127.0.0.1", *, max_connections: int = 16, idle_s: float = 5.0,
                 max_request: int = 8192, pages: Optional[Dict[str, Callable[[], "Page"]]] = None):
        self.body, self.max_connections, self.idle_s, self.max_request = body, max_connections, idle_s, max_request
        self.pages = {p.encode("ascii"): fn for p, fn in (pages or {}).items()}
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
        headers = ""
        if method not in (b"GET", b"HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
        elif path in self.pages:
            try:
                page = self.pages[path]()
                status, ctype, body = "200 OK", page.content_type, page.body
                headers = "".join(f"{k}: {v}\r\n" for k, v in page.headers)
            except Exception as e:  # noqa: BLE001 - a page that fails never stops the server
                status, ctype, body = "500 Internal Server Error", "text/plain", f"{type(e).__name__}\n".encode()
        elif path not in (b"/metrics", b"/"):
            status, ctype, body = "404 Not Found", "text/plain", b"GET /metrics\n"
        else:
            status, ctype, body = "200 OK", CONTENT_TYPE, self.body()
        head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{headers}"
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
