"""tests/ports.py: the tests' ports stay out of the kernel's ephemeral range and out of each other's way."""
import os
import socket
import subprocess
import sys

from tests import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    assert all(ports.LOWEST <= p < ports._ephemeral_low() for p in got)
    for p in got[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_bound_port_is_skipped_and_runs_are_consecutive():
    base = ports.free_ports(3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))
        s.listen()
        ports._next = base - ports._BLOCK.start   # the next walk starts at base, where base + 1 is taken
        again = ports.free_ports(2)
        assert again != base and not (again <= base + 1 < again + 2)
        for p in (again, again + 1):
            with socket.socket() as t:
                t.bind(("127.0.0.1", p))


def test_each_xdist_worker_has_a_block_of_its_own():
    code = "from tests import ports; print(ports._BLOCK.start, ports._BLOCK.stop)"
    blocks = []
    for worker in ("gw0", "gw1"):
        env = {"PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": "2", "PYTHONPATH": ROOT}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        blocks.append(tuple(map(int, out.stdout.split())))
    (a0, a1), (b0, b1) = blocks
    assert a0 == ports.LOWEST and a1 <= b0 and b1 <= ports._ephemeral_low() and a1 - a0 > 1000
