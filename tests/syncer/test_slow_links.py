"""Slow links are not dropped (issue #13, bug 2): a peer that stops reading for less than the timeout keeps its
connection on both sides; one that stops for longer is dropped, and the log says how long it really stalled."""
import logging
import random
import time

import numpy as np
import pytest

from yeto_patch.wire import auth, codecs
from yeto_patch.wire.client import _handshake
from yeto_patch.wire.frames import MsgType
from yeto_patch.wire.transport import connect

from .helpers import KEY, client, make_server, running
from .relay import Relay

pytestmark = pytest.mark.timeout(90)
BIG = [("decoder.layers.0.mlp.linear_fc1.weight", (8 << 20,), "float32")]   # one 32 MiB fragment
VALUES = [np.linspace(-1, 1, 8 << 20, dtype=np.float32)]


def _init(addr):
    a = client(addr, "a", manifest=BIG, timeout=30.0)
    w = a.connect()
    a.wait_ready(30, init_source=lambda f: [VALUES[i] for i in w.layout[f]])
    return a


def _raw_island(addr, island):
    """A hand-driven island connection: handshake only, then the test decides when it reads."""
    conn = connect(addr, timeout=10, retries=0)
    import socket
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    _handshake(conn, KEY, False, MsgType.HELLO, island, random.getrandbits(63), auth.manifest_digest(BIG),
               {"manifest": [[n, list(s), d] for n, s, d in BIG]}, 10)
    bulk = 4 * (8 << 20) + (1 << 20)   # (as SyncerClient does after its WELCOME: room for the 32 MiB base)
    conn.set_limits({MsgType.BASE: bulk}, bulk + (2 << 20))
    return conn


# (quorum 1: an elastic roster, so island a initializes the run before b joins)
def test_syncer_keeps_an_island_that_stops_reading_for_1_5s(caplog):
    server, addr = make_server(islands=2, fragments=1, io_timeout_s=10.0, rounds={"lease_s": 40.0, "quorum": 1})
    with running(server), caplog.at_level(logging.INFO, logger="yeto"):
        a = _init(addr)
        b = _raw_island(addr, "b")   # the syncer now streams the 32 MiB base to b, which reads nothing
        time.sleep(1.5)
        t, meta, body = b.recv(timeout=10)
        while t == MsgType.HEARTBEAT:
            t, meta, body = b.recv(timeout=10)
        assert t == MsgType.BASE and memoryview(body).nbytes == 4 * (8 << 20)
        assert np.array_equal(np.frombuffer(body, np.float32), VALUES[0])
        t, _, _ = b.recv(timeout=10)   # still connected: the next heartbeat arrives
        assert t == MsgType.HEARTBEAT
        assert not [r for r in caplog.records if "send failed" in r.getMessage()]
        assert not server.sessions["b"].closed
        b.close()
        a.close()


def test_syncer_drops_an_island_that_stops_reading_longer_than_io_timeout(caplog):
    server, addr = make_server(islands=2, fragments=1, io_timeout_s=2.0, rounds={"lease_s": 40.0, "quorum": 1})
    with running(server), caplog.at_level(logging.INFO, logger="yeto"):
        a = _init(addr)
        t0 = time.monotonic()
        b = _raw_island(addr, "b")
        deadline = time.monotonic() + 20
        while not [r for r in caplog.records if "send failed" in r.getMessage()] and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - t0
        lines = [r.getMessage() for r in caplog.records if "send failed" in r.getMessage()]
        assert lines, "the stalled island was never dropped"
        assert "island b" in lines[0] and "stalled for more than 2.0s" in lines[0]
        assert took >= 2.0, took   # old code: dropped after ~1 s while claiming 2 s
        b.close()
        a.close()


def test_island_push_survives_a_1_5s_pause_mid_push():
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        # upstream: the INIT (32 MiB + handshake), then 16 MiB into the PUSH the relay stops reading for 1.5 s
        relay = Relay(int(addr.rsplit(":", 1)[1]), pause_up=((32 << 20) + (16 << 20), 1.5))
        a = client(relay.address, "a", manifest=BIG, timeout=30.0)
        w = a.connect()
        a.wait_ready(30, init_source=lambda f: [VALUES[i] for i in w.layout[f]])
        delta = np.full(8 << 20, 1e-3, np.float32)
        r = a.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", delta), wait=True, timeout=30)
        assert r.status == "accepted"
        assert relay.paused and relay.paused[0][0] == "up"
        a.close()
        relay.close()
