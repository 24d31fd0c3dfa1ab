"""The demo's metered link: relays both ways, counts bytes exactly, holds connections until the gate opens."""
import socket
import threading
import time

from yeto_patch.demo.link import MeteredLink


def _echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve(c):
        with c:
            while True:
                d = c.recv(65536)
                if not d:
                    return
                c.sendall(d + d)  # answer twice as many bytes

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
    return srv


def _roundtrip(port, payload):
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    c.sendall(payload)
    got = b""
    while len(got) < 2 * len(payload):
        got += c.recv(1 << 20)
    c.close()
    return got


def test_counts_both_directions_and_gates():
    srv = _echo_server()
    link = MeteredLink("127.0.0.1", srv.getsockname()[1], gate=2)
    try:
        results = {}
        t1 = threading.Thread(target=lambda: results.__setitem__(1, _roundtrip(link.port, b"a" * 300_000)))
        t1.start()
        time.sleep(0.5)
        c = link.counters()
        assert not c["gate_open"] and c["waiting_at_gate"] == 1 and c["up"] == 0  # held, nothing relayed
        assert 1 not in results
        results[2] = _roundtrip(link.port, b"b" * 1000)
        t1.join(10)
        assert results[1] == b"a" * 600_000 and results[2] == b"b" * 2000
        deadline = time.time() + 5
        # each pump counts a chunk after relaying it: the echo's answer can come back down before the up pump
        # has counted what it relayed, so wait for both counts
        while (link.counters()["up"] < 301_000 or link.counters()["down"] < 602_000) and time.time() < deadline:
            time.sleep(0.05)
        c = link.counters()
        assert c["gate_open"] and c["connections"] == 2
        assert c["up"] == 301_000 and c["down"] == 602_000
        # after the gate opened, a new connection passes at once
        assert _roundtrip(link.port, b"c" * 10) == b"c" * 20
    finally:
        link.close()
        srv.close()


def test_unreachable_syncer_is_reported():
    from tests.ports import free_port
    dead_port = free_port()   # nothing listens there
    link = MeteredLink("127.0.0.1", dead_port, gate=0, timeout=2)
    try:
        c = socket.create_connection(("127.0.0.1", link.port), timeout=5)
        c.settimeout(5)
        assert c.recv(10) == b""  # closed by the link
        c.close()
        assert link.errors and "cannot reach the syncer" in link.errors[0]
    finally:
        link.close()
