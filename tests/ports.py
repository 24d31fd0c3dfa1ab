"""Ports for the tests' servers and torchrun rendezvous that no other process takes first (test-only).

The usual trick, binding port 0 and closing the socket, returns a port of the kernel's ephemeral range, and until
the server binds it any outgoing connection on the machine may take it as its local port: gloo opens many, and
with two pytest-xdist workers another file's islands run beside. A torchrun rendezvous failed with EADDRINUSE
that way. These ports come from below the ephemeral range, which the kernel never hands out on its own, from a
block of its own for each xdist worker (processes a worker starts share its block), and each process walks its
block from a random start, so ports handed out a moment ago (maybe not bound yet) are not handed out again. A
port that is bound now, or left in TIME_WAIT, fails the probe and is skipped.
"""
from __future__ import annotations

import os
import random
import socket

LOWEST = 15000      # above the registered ports most services use


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def _worker_block() -> range:
    """This xdist worker's ports (all of LOWEST..ephemeral low when pytest runs in one process)."""
    top = max(_ephemeral_low(), LOWEST + 1000)
    try:
        index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
        count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    except ValueError:
        index, count = 0, 1
    size = (top - LOWEST) // count
    return range(LOWEST + index * size, LOWEST + (index + 1) * size)


_BLOCK = _worker_block()
_next = random.SystemRandom().randrange(len(_BLOCK))


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> int:
    """The first of n consecutive ports that are free now (for a syncer's shards: base + LOCAL_RANK)."""
    global _next
    for _ in range(len(_BLOCK)):
        start = _BLOCK.start + _next % len(_BLOCK)
        _next += n
        if start + n <= _BLOCK.stop and all(_is_free(start + i) for i in range(n)):
            return start
    raise RuntimeError(f"no {n} free consecutive ports in {_BLOCK}")


def free_port() -> int:
    return free_ports(1)
