"""benchmarks/netlab.py, the WAN of vs_torchft.py's slow-link and failure runs: namespaces on a bridge, access
links shaped by tc tbf, outages, and the interpreter that puts a demo's islands in their namespaces. Real
namespaces and sockets; skips where they cannot be made (not root, no tbf)."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import netlab  # noqa: E402

why = netlab.available()
pytestmark = pytest.mark.skipif(why is not None, reason=f"network namespaces: {why}")


def _sink(host):
    """A server on `host` that counts what each connection sends: returns (server, [(bytes, time it ended)])."""
    srv = socket.create_server((host, 0))
    got = []

    def run():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            n = 0
            while True:
                d = c.recv(1 << 16)
                if not d:
                    break
                n += len(d)
            got.append((n, time.time()))
            c.close()
    threading.Thread(target=run, daemon=True).start()
    return srv, got


def _send(lab, k, host, port, nbytes, timeout=20):
    code = (f"import socket; s = socket.create_connection(({host!r}, {port}), timeout=3); "
            f"s.sendall(b'x' * {nbytes}); s.close()")
    return subprocess.run(lab.wrap(k, [sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=timeout)


def test_rate_counters_and_outage():
    with netlab.NetLab(2, rate_mbit=8) as lab:
        srv, got = _sink(lab.host_ip)
        port = srv.getsockname()[1]
        before = lab.counters(0)
        t0 = time.time()
        r = _send(lab, 0, lab.host_ip, port, 1_000_000)
        assert r.returncode == 0, r.stderr
        deadline = time.time() + 5
        while not got and time.time() < deadline:
            time.sleep(0.05)
        assert [n for n, _ in got] == [1_000_000]
        # 8 Mbit/s: 1 MB takes at least ~1 s on the shaped link (the interpreter's start-up comes on top)
        assert got[0][1] - t0 >= 0.9, got[0][1] - t0
        up = lab.counters(0)["up"] - before["up"]
        assert 1_000_000 <= up < 1_200_000, up        # frames as sent: payload plus headers
        assert lab.counters(1)["up"] < 20_000          # the other participant sent (almost) nothing
        # an outage: participant 1 cannot connect while its link is down, and can again once it is up
        lab.set_link(1, False)
        try:
            r = _send(lab, 1, lab.host_ip, port, 10)
            assert r.returncode != 0
        finally:
            lab.set_link(1, True)
        deadline = time.time() + 5   # the neighbour entry the failed attempt left may take a moment
        while (r := _send(lab, 1, lab.host_ip, port, 10)).returncode and time.time() < deadline:
            time.sleep(0.1)
        assert r.returncode == 0, r.stderr
        srv.close()
    assert not any(ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                   for ns in lab.ns)                   # gone with the lab


def test_island_python_runs_islands_in_their_namespace(tmp_path):
    """The demo's --python: a child with an island id runs in its namespace and reaches a server on the root
    namespace's loopback (the demo's relay) through the forwarder; a child without one runs as is."""
    with netlab.NetLab(2) as lab:
        srv, got = _sink("127.0.0.1")
        port = srv.getsockname()[1]
        py = netlab.island_python(str(tmp_path / "bin"), lab, {"A-single": 0, "B-single": 1})
        code = ("import os, socket, subprocess; h, p = os.environ['YETO_DILOCO_SYNCER'].rsplit(':', 1); "
                "s = socket.create_connection((h, int(p)), timeout=5); s.sendall(b'y' * 12345); s.close(); "
                "print(subprocess.run(['ip', '-o', '-4', 'addr'], capture_output=True, text=True).stdout)")
        env = dict(os.environ, YETO_DILOCO_ISLAND_ID="B-single", YETO_DILOCO_SYNCER=f"127.0.0.1:{port}")
        r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert lab.ip_of(1) in r.stdout and lab.ip_of(0) not in r.stdout
        deadline = time.time() + 5
        while not got and time.time() < deadline:
            time.sleep(0.05)
        assert [n for n, _ in got] == [12345]
        assert lab.counters(1)["up"] >= 12345
        env.pop("YETO_DILOCO_ISLAND_ID")
        r = subprocess.run([py, "-c", "import sys; print(sys.executable)"], env=env, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0 and r.stdout.strip() == sys.executable
        srv.close()
