"""The demo's metered link between the islands and the syncer.

Islands reach the syncer through this TCP relay (it stands where the slow inter-island network would be), so
the demo reports the bytes that really crossed, both ways, framing and handshakes included, rather than an
estimate. It can also hold the first connections until every island has connected (``gate``): islands started
together then join the syncer together, whatever their start-up time, so none trains alone meanwhile (the syncer
itself waits for its quorum of islands before closing the first rounds; ``--no-start-gate`` shows that path).
"""
import socket
import threading
import time

__all__ = ["MeteredLink", "LinkGroup"]


class MeteredLink:
    def __init__(self, target_host, target_port, gate=0, host="127.0.0.1", timeout=30.0):
        self.target = (target_host, target_port)
        self.gate, self.timeout = gate, timeout
        self.lock = threading.Lock()
        self.up = 0          # island -> syncer
        self.down = 0        # syncer -> island
        self.connections = 0
        self.errors = []
        self.held = []
        self.gate_open = gate <= 0
        self.opened_at = None if gate > 0 else time.time()
        self.closed = False
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind((host, 0))
        self.srv.listen(64)
        self.address = self.srv.getsockname()
        self._socks = []
        self._t = threading.Thread(target=self._accept_loop, name="demo-link-accept", daemon=True)
        self._t.start()

    @property
    def port(self):
        return self.address[1]

    def _accept_loop(self):
        while not self.closed:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                if self.gate_open:
                    start = [conn]
                else:
                    self.held.append(conn)
                    start = []
                    if len(self.held) >= self.gate:
                        start, self.held = self.held, []
                        self.gate_open, self.opened_at = True, time.time()
            for c in start:
                self._relay(c)

    def _relay(self, conn):
        try:
            up = socket.create_connection(self.target, timeout=self.timeout)
        except OSError as e:
            self.errors.append(f"link: cannot reach the syncer at {self.target[0]}:{self.target[1]}: {e}")
            conn.close()
            return
        for s in (conn, up):
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            self._socks += [conn, up]
        threading.Thread(target=self._pump, args=(conn, up, "up"), daemon=True, name="demo-link-up").start()
        threading.Thread(target=self._pump, args=(up, conn, "down"), daemon=True, name="demo-link-down").start()

    def _pump(self, src, dst, direction):
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                dst.sendall(view[:n])
                with self.lock:
                    if direction == "up":
                        self.up += n
                    else:
                        self.down += n
        except OSError:
            pass
        finally:
            for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                try:
                    s.shutdown(how)
                except OSError:
                    pass

    def counters(self):
        with self.lock:
            return {"up": self.up, "down": self.down, "connections": self.connections,
                    "waiting_at_gate": len(self.held), "gate_open": self.gate_open}

    def close(self):
        self.closed = True
        try:
            self.srv.close()
        except OSError:
            pass
        with self.lock:
            socks = self._socks + self.held
        for s in socks:
            try:
                s.close()
            except OSError:
                pass


class LinkGroup:
    """The metered links to every syncer shard (one link for one syncer), read as one."""

    def __init__(self, links):
        self.links = list(links)
        self.gate = self.links[0].gate

    @property
    def addresses(self) -> str:
        """YETO_DILOCO_SYNCER for the islands: every shard's link, in shard order."""
        return ",".join(f"127.0.0.1:{lk.port}" for lk in self.links)

    @property
    def errors(self) -> list:
        return [e for lk in self.links for e in lk.errors]

    def counters(self) -> dict:
        cs = [lk.counters() for lk in self.links]
        out = {k: sum(c[k] for c in cs) for k in ("up", "down", "connections")}
        out["waiting_at_gate"] = max(c["waiting_at_gate"] for c in cs)
        out["gate_open"] = all(c["gate_open"] for c in cs)
        return out

    def close(self) -> None:
        for lk in self.links:
            lk.close()
