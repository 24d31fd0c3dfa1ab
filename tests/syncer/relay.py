"""An on-path TCP relay for link and tamper tests (the pattern of tests/shim/cutlink.py): it forwards island <->
syncer bytes and lets a test pause one direction after some bytes (a peer that stops reading, a stalled WAN
link) or rewrite what passes (a hostile router)."""
import socket
import threading
import time


class Relay:
    """Forward connections on ``self.port`` to ``target_port``. ``pause_up``/``pause_down``: (after_bytes,
    seconds) — once that many bytes went that way on a connection, stop reading from the sender for ``seconds``
    (once per connection). ``tamper_up``/``tamper_down``: ``f(conn_index, data, offset) -> bytes`` rewrites a
    piece (``offset``: bytes already forwarded that way on the connection)."""

    def __init__(self, target_port, host="127.0.0.1", pause_up=None, pause_down=None, tamper_up=None,
                 tamper_down=None):
        self.target = (host, target_port)
        self.pause = {"up": pause_up, "down": pause_down}
        self.tamper = {"up": tamper_up, "down": tamper_down}
        self.connections = 0
        self.paused = []   # (direction, monotonic start, seconds)
        self.lock = threading.Lock()
        self.srv = socket.create_server((host, 0))
        self.port = self.srv.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target, timeout=10)
            except OSError:
                a.close()
                continue
            for s in (a, b):
                s.settimeout(None)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            with self.lock:
                idx = self.connections
                self.connections += 1
            threading.Thread(target=self._pump, args=(a, b, "up", idx), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, "down", idx), daemon=True).start()

    def _pump(self, src, dst, way, idx):
        sent = 0
        pause = self.pause[way]
        tamper = self.tamper[way]
        try:
            while True:
                if pause is not None and sent >= pause[0]:
                    with self.lock:
                        self.paused.append((way, time.monotonic(), pause[1]))
                    time.sleep(pause[1])
                    pause = None
                want = 1 << 16 if pause is None else max(1, min(1 << 16, pause[0] - sent))
                data = src.recv(want)
                if not data:
                    break
                out = tamper(idx, data, sent) if tamper is not None else data
                sent += len(data)
                if out:
                    dst.sendall(out)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.closed = True
        self.srv.close()


HEADER_SIZE = 28
TAG_SIZE = 16


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(min(1 << 20, n - len(buf)))
        if not b:
            raise ConnectionError("closed")
        buf += b
    return bytes(buf)


class FrameRelay(Relay):
    """A relay that forwards whole frames and lets ``on_frame(way, conn_index, n, header, rest) -> [bytes]``
    (``n``: frames that way so far on this connection; ``rest``: payload and, for an authenticated frame, its
    tag) replace each frame by any list of frames: drop ([]), replay ([f, f]), inject ([g, f]) or rewrite."""

    def __init__(self, target_port, on_frame, host="127.0.0.1"):
        self.on_frame = on_frame
        self.events = []
        super().__init__(target_port, host)

    def _pump(self, src, dst, way, idx):
        import struct
        n = 0
        try:
            while True:
                hdr = _recv_exact(src, HEADER_SIZE)
                _, _, t, flags, length, _ = struct.unpack("<4sHHIQQ", hdr)
                rest = _recv_exact(src, length + (TAG_SIZE if flags & 1 else 0))
                out = self.on_frame(way, idx, n, hdr, rest)
                n += 1
                for f in out:
                    dst.sendall(f)
        except (OSError, ConnectionError):
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
