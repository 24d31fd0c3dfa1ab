"""benchmarks/vs_torchft.py --smoke: both sides (yeto-patch's syncer and islands; torchft's lighthouse, Manager and
DiLoCo) start, train the same tiny model and finish 2 syncs, and the byte meters see real traffic. Runs in the
py312-peers environment's Python (torchft 0.2.0; scripts/test.sh's py312-peers stage); skips in an interpreter
without torchft. The comparison's figures are for the full run, not checked here."""
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peers_python():
    """This interpreter when it has torchft (the py312-peers stage of scripts/test.sh), else skip: the other
    stages' interpreters lack it, and running the smoke once is enough."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        pytest.skip("needs torchft: $(bash scripts/venv.sh py312-peers)/bin/python -m pytest tests/test_vs_torchft.py "
                    "(scripts/test.sh's py312-peers stage)")
    return sys.executable


@pytest.mark.timeout(420)
def test_vs_torchft_smoke(tmp_path):
    python = peers_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "TORCHFT_"))}
    env["PYTHONPATH"] = ROOT
    out = tmp_path / "out"
    r = subprocess.run([python, os.path.join(ROOT, "benchmarks", "vs_torchft.py"), "--smoke", "--out", str(out),
                        "--json", str(tmp_path / "r.json"), "--timeout", "240"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "| measure | yeto-patch | torchft | torchft / yeto-patch |" in r.stdout, r.stdout[-3000:]
    with open(tmp_path / "r.json") as f:
        res = json.load(f)
    assert res["versions"]["torchft"] == "0.2.0"
    (row,) = res["rows"]
    y, t = row["yeto"], row["torchft"]
    steps = row["steps"]
    params = t["params"]
    assert y["params"] == params  # the same model on both sides
    assert y["steps_done"] == [steps, steps] and t["steps_done"] == [steps, steps]
    assert y["syncs"] >= 2 and t["syncs"] == 2, (y["syncs"], t["syncs"])
    # measured on the link: torchft's fp32 allreduce moves at least one full copy of the model per sync between
    # the replicas; yeto-patch's int4 pushes at least half a byte per parameter per island
    assert t["bytes"] >= t["syncs"] * params * 4, t
    assert y["bytes"] >= 2 * params // 2, y
    for loss in (y["loss"], t["loss"], t["loss_mean"]):
        assert math.isfinite(loss) and loss < math.log(256), (y, t)  # below the uniform byte guess: it trained
    assert t["blocked"] is not None and y["blocked"] is not None
    # the optimizer step timed on both sides (train_gpt.py's opt_s, the replica's): a per-sync figure for the
    # sync at step 4 of 8
    assert t["blocked_sync"] is not None and y["blocked_sync"] is not None
    assert t["blocked_sync_median"] is not None and y["blocked_sync_median"] is not None
    assert os.path.exists(out / "h32" / "torchft" / "sockets.json")


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_socket_meter_counts_each_byte_between_processes_once():
    """The torchft side's byte meter on real sockets: a child process sends 300,000 bytes to this one and gets
    1,000 back; a connection of this process to itself (as a replica to its own TCPStore) is not counted."""
    from benchmarks.vs_torchft import SocketMeter
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        port = srv.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", (
            "import socket, sys\n"
            f"s = socket.create_connection(('127.0.0.1', {port}))\n"
            "s.sendall(b'x' * 300000)\n"
            "got = 0\n"
            "while got < 1000:\n"
            "    got += len(s.recv(65536))\n"
            "print('ok', flush=True)\n"
            "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        stack.callback(child.wait, timeout=30)
        stack.callback(child.stdin.close)
        conn = stack.enter_context(srv.accept()[0])
        self_a = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        stack.enter_context(srv.accept()[0])
        self_a.sendall(b"z" * 5000)
        got = 0
        while got < 300000:
            got += len(conn.recv(1 << 20))
        conn.sendall(b"y" * 1000)
        assert child.stdout.readline().strip() == "ok"
        meter = SocketMeter()
        meter.sample()
        assert meter.samples == 1
        # only this test's connections: the xdist worker running it holds other tests' sockets too
        meter.socks = {k: v for k, v in meter.socks.items() if str(port) in (k[0].rsplit(":", 1)[1], k[1].rsplit(":", 1)[1])}
        assert meter.between([child.pid]) == 301000            # its sends + what it got from outside
        assert meter.between([child.pid], peers_only=True) == 0
        assert meter.between([child.pid, os.getpid()]) == 301000  # both ends known: each byte once
        assert meter.between([os.getpid()]) == 301000           # the self-connection's 5000 not counted
