"""INIT and meta the spec refuses (issue 13, bug 7): a second INIT of a fragment and an INIT after the run was
initialized are ERROR init (docs/protocol.md), and malformed meta (NaN, duplicate keys, bad UTF-8, deep nesting,
...) gets the best-effort ERROR protocol before the syncer closes, before and after the handshake."""
import json
import logging
import socket
import struct
import time

import numpy as np
import pytest
import xxhash

from yeto_patch.wire.frames import MsgType, PeerError

from .helpers import client, init_values, join_all, make_server, running

pytestmark = pytest.mark.timeout(90)


def raw_frame(t: MsgType, meta_text: bytes, body: bytes = b"") -> bytes:
    payload = struct.pack("<I", len(meta_text)) + meta_text + body
    return struct.pack("<4sHHIQQ", b"YETO", 1, t, 0, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def send_raw(c, t: MsgType, meta_text: bytes, body: bytes = b"") -> None:
    """A message whose meta the reference encoder would not write (1e999, 4300-digit integers)."""
    c.conn._send_frame(t, [raw_frame(t, meta_text, body)[28:]])


def peer_error(c, timeout=10.0) -> PeerError:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c.wait_event(0.2)
        except PeerError as e:
            return e
    raise AssertionError("no ERROR from the syncer")


def test_a_second_init_of_a_fragment_is_an_init_error_and_changes_nothing():
    server, addr = make_server(islands=2, fragments=3)
    values = init_values()
    with running(server):
        a = client(addr, "a")
        w = a.connect()
        assert w.needs_init == [0, 1, 2]
        a.send_init(0, [values[i] for i in w.layout[0]])
        a.send_init(0, [np.zeros_like(values[i]) for i in w.layout[0]])
        e = peer_error(a)
        assert e.code == "init" and "second INIT" in e.message
        assert not server.coord.initialized
        a.close()
        b = client(addr, "b")   # the run is still initialized from the island that takes over, from scratch
        wb = b.connect()
        b.wait_ready(20, init_source=lambda f: [values[i] for i in wb.layout[f]])
        assert server.coord.initialized
        b.close()


@pytest.mark.parametrize("value,says", [(np.nan, "non-finite value near 0"), (np.float32(3e36), "above 1e+30")])
def test_an_init_that_cannot_be_a_base_is_an_init_error_and_changes_nothing(value, says):
    """The INIT's values are checked in one pass before they become the base; the element is named."""
    server, addr = make_server(islands=2, fragments=2)
    values = init_values()
    with running(server):
        a = client(addr, "a")
        w = a.connect()
        bad = [values[i].copy() for i in w.layout[0]]
        bad[0].reshape(-1)[3] = value
        a.send_init(0, bad)
        e = peer_error(a)
        assert e.code == "init" and says in e.message, e.message
        assert not server.coord.initialized and not server.coord.frags[0].has_base
        a.close()
        b = client(addr, "b")   # an island with usable weights initializes the run
        wb = b.connect()
        b.wait_ready(20, init_source=lambda f: [values[i] for i in wb.layout[f]])
        assert server.coord.initialized
        b.close()


def test_init_after_initialization_is_an_init_error():
    server, addr = make_server(islands=2, fragments=2)
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a", "b"])
        before = [f.t.base.copy() for f in server.coord.frags]
        cs[1].send_init(0, [np.zeros_like(init_values()[i]) for i in layout[0]])
        e = peer_error(cs[1])
        assert e.code == "init" and "initialized" in e.message
        assert all(np.array_equal(f.t.base, b) for f, b in zip(server.coord.frags, before))
        for c in cs:
            c.close()


def recv_frames(sock, timeout=5.0) -> list:
    """(type, meta) of the frames the syncer sends until it closes the connection."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while True:
            d = sock.recv(1 << 16)
            if not d:
                break
            buf += d
    except (socket.timeout, ConnectionResetError):
        pass
    out = []
    while len(buf) >= 28:
        _, _, t, _, length, _ = struct.unpack("<4sHHIQQ", buf[:28])
        payload = buf[28:28 + length]
        (m,) = struct.unpack("<I", payload[:4])
        out.append((t, json.loads(payload[4:4 + m])))
        buf = buf[28 + length:]
    return out


@pytest.mark.parametrize("meta", [b'{"island_id":NaN}', b'{"a":1,"a":2}', b'{"a":"\xff\xfe"}',
                                  b'{"a":' * 5000 + b"1" + b"}" * 5000, b'{"a":Infinity}', b"[1,2]",
                                  ('{"a":' + "9" * 5000 + "}").encode()],
                         ids=["nan", "duplicate", "utf8", "depth", "infinity", "array", "digits"])
def test_malformed_meta_gets_an_error_before_the_close(meta, caplog):
    caplog.set_level(logging.WARNING, "yeto")
    server, addr = make_server(islands=1, fragments=1)
    host, port = addr.rsplit(":", 1)
    with running(server):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(raw_frame(MsgType.HELLO, meta))
            frames = recv_frames(s)
        assert [t for t, _ in frames] == [MsgType.CHALLENGE, MsgType.ERROR], frames
        assert frames[1][1]["code"] == "protocol" and "meta" in frames[1][1]["message"]
        # ... and after the handshake too
        cs, ws, layout, _ = join_all(addr, ["a"])
        send_raw(cs[0], MsgType.HEARTBEAT, meta)
        e = peer_error(cs[0])
        assert e.code == "protocol" and "meta" in e.message
        cs[0].close()
    assert "Traceback" not in caplog.text
