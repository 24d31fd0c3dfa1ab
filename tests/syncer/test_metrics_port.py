"""The metrics port hands a stranger nothing (issue 26, finding 5): it binds to loopback by default, one thread
serves every connection, at most a bounded number stay open and each is closed after a bounded time, whether
its request came or not; a scrape still works during a flood of idle connections."""
import socket
import threading
import time
import urllib.request

import pytest

from yeto_patch.syncer import cli
from yeto_patch.syncer.observe.metrics import Metrics

pytestmark = pytest.mark.timeout(60)


def _closed_within(s, timeout) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def test_idle_connections_get_no_threads_and_are_dropped_after_a_bounded_time():
    m = Metrics()
    m.merges.labels("0").inc()
    before = threading.active_count()
    port = m.serve(0)   # (the defaults: at most 16 connections, each closed 5 s after it was accepted)
    try:
        assert threading.active_count() <= before + 1   # at most one serving thread
        t0 = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(100)]
        time.sleep(0.5)
        assert threading.active_count() <= before + 1, threading.active_count() - before
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:   # still scraped
            assert r.status == 200 and b'yeto_syncer_merges_total{fragment="0"} 1.0' in r.read()
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)   # a request that never completes ...
        slow.sendall(b"GET /metr")
        t1 = time.monotonic()
        assert all(_closed_within(s, max(0.1, t0 + 7.0 - time.monotonic())) for s in idle)   # within 5 s (+ slack)
        assert _closed_within(slow, max(0.1, t1 + 7.0 - time.monotonic()))   # ... is cut off as well
        slow.close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:   # an oversized one at once
            s.sendall(b"G" * 20000)
            assert _closed_within(s, 1)
    finally:
        m.close()
    assert threading.active_count() == before


def test_the_metrics_port_binds_to_loopback_by_default():
    a = cli.build_parser().parse_args(["--insecure", "--listen", "127.0.0.1:0"])
    assert a.metrics_addr == "127.0.0.1" and cli.config_from_args(a).metrics_addr == "127.0.0.1"
