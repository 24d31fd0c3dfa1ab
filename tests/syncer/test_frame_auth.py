"""Every frame after the handshake is authenticated (issue #13, integrity): an on-path relay that rewrites a PUSH
or a BASE, injects a FINAL, replays or drops a frame is detected, the connection fails with a clear error on the
side that received the bad frame, nothing reaches the model, and the island's reconnect still works."""
import logging
import os
import struct
import time

import numpy as np
import pytest

from yeto_patch.wire import codecs
from yeto_patch.wire.client import recoverable
from yeto_patch.wire.frames import MsgType, ProtocolError

from .helpers import client, init_values, make_server, running
from .relay import FrameRelay

pytestmark = pytest.mark.timeout(60)
VALUES = init_values()


def inner_type(hdr, rest):
    t = struct.unpack_from("<H", hdr, 6)[0]
    return struct.unpack_from("<H", rest, 8)[0] if t == MsgType.CHUNK else t


def flip(hdr, rest, at=-17):
    b = bytearray(rest)
    b[at] ^= 0x40   # a byte of the payload (the tag is the last 16)
    return hdr + bytes(b)


class Plan:
    """What the relay does to connection 0 (later connections pass untouched), once."""

    def __init__(self, way, kind, action):
        self.way, self.kind, self.action, self.armed, self.done = way, kind, action, False, False

    def __call__(self, way, idx, n, hdr, rest):
        f = hdr + rest
        flags = struct.unpack_from("<I", hdr, 8)[0]
        if idx != 0 or way != self.way or not self.armed or self.done or not flags & 1 \
                or inner_type(hdr, rest) != self.kind:
            return [f]
        self.done = True
        if self.action == "flip":
            return [flip(hdr, rest)]
        if self.action == "replay":
            return [f, f]
        if self.action == "drop":
            return []
        if self.action == "inject-clear":   # an unauthenticated FINAL before this frame
            from yeto_patch.wire.message import pack_meta
            import xxhash
            p = pack_meta({"last_step": 99})
            return [struct.pack("<4sHHIQQ", b"YETO", 1, MsgType.FINAL, 0, len(p), xxhash.xxh3_64_intdigest(p)) + p, f]
        if self.action == "inject-sealed":   # a FINAL with a made-up tag
            from yeto_patch.wire.message import pack_meta
            p = pack_meta({"last_step": 99})
            return [struct.pack("<4sHHIQQ", b"YETO", 1, MsgType.FINAL, 1, len(p), 0) + p + os.urandom(16), f]
        raise AssertionError(self.action)


def _join(addr, **kw):
    c = client(addr, "a", **kw)
    w = c.connect()
    c.wait_ready(20, init_source=lambda f: [VALUES[i] for i in w.layout[f]])
    return c, w


def _wait_log(caplog, text, timeout=10):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        hits = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if hits:
            return hits
        time.sleep(0.05)
    return []


def _wait_failed(c, timeout=10):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            c.wait_event(0.2)
        except ProtocolError as e:
            return e
    raise AssertionError("the island never saw its link fail")


@pytest.mark.parametrize("kind,action", [(MsgType.PUSH, "flip"), (MsgType.HEARTBEAT, "inject-clear"),
                                         (MsgType.HEARTBEAT, "inject-sealed"), (MsgType.HEARTBEAT, "replay"),
                                         (MsgType.HEARTBEAT, "drop")])
def test_tampered_frames_from_the_island_are_detected_by_the_syncer(caplog, kind, action):
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0}, heartbeat_s=0.2)
    with running(server), caplog.at_level(logging.INFO, logger="yeto"):
        plan = Plan("up", kind, action)
        relay = FrameRelay(int(addr.rsplit(":", 1)[1]), plan)
        c, w = _join(relay.address)
        plan.armed = True
        delta = codecs.encode("f32", np.full(w.numels[0], 0.5, np.float32))
        if kind == MsgType.PUSH:
            c.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32", body=delta)
        e = _wait_failed(c)
        assert plan.done
        hits = _wait_log(caplog, "frame")
        assert hits and any(("authentication failed" in h or "not authenticated" in h) for h in hits), hits
        assert recoverable(e), e            # the island reconnects
        assert server.coord.merges_total == 0 and not server.final_started
        assert all(not m.finished for m in server.coord.members.values())
        c.abort()
        c2 = client(relay.address, "a", incarnation=c.incarnation)   # the reconnect (its link is not tampered)
        c2.connect()
        c2.wait_ready(20)
        r = c2.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32", body=delta, wait=True)
        assert r.status == "accepted"
        c2.wait_base(0, 1, 10)
        assert server.coord.merges_total == 1
        c2.close()
        relay.close()


@pytest.mark.parametrize("action", ["flip", "replay", "drop"])
def test_tampered_bases_are_detected_by_the_island(caplog, action):
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0}, heartbeat_s=0.2)
    with running(server):
        plan = Plan("down", MsgType.BASE, action)
        relay = FrameRelay(int(addr.rsplit(":", 1)[1]), plan)
        c, w = _join(relay.address)
        plan.armed = True
        delta = codecs.encode("f32", np.full(w.numels[0], 0.5, np.float32))
        c.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32", body=delta)
        got = None
        try:
            got = c.wait_base(0, 1, 10)
        except ProtocolError as e:
            assert "frame authentication failed" in str(e) or "not frame" in str(e), e
            assert recoverable(e)
        assert plan.done
        if got is not None:   # a replay: the first copy was genuine, the copy breaks the link
            assert action == "replay"
            e = _wait_failed(c)
            assert "frame authentication failed" in str(e) and recoverable(e), e
        c.abort()
        c2 = client(relay.address, "a", incarnation=c.incarnation)
        c2.connect()
        b = c2.wait_ready(20)
        assert b[0].version == 1
        c2.close()
        relay.close()


def test_encrypted_frames_hide_the_weights_and_still_merge():
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0}, encrypt=True)
    seen = {"up": bytearray(), "down": bytearray()}

    def tap(way, idx, n, hdr, rest):
        seen[way] += rest
        return [hdr + rest]

    with running(server):
        relay = FrameRelay(int(addr.rsplit(":", 1)[1]), tap)
        c, w = _join(relay.address)
        assert c.conn.protection == "aead"
        c.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
               body=codecs.encode("f32", np.full(w.numels[0], 0.5, np.float32)), wait=True)
        b = c.wait_base(0, 1, 10)
        assert b.version == 1 and np.isfinite(b.values).all()
        c.close()
        relay.close()
    flat = np.concatenate([VALUES[i].reshape(-1) for i in w.layout[0]]).tobytes()
    assert flat[:64] not in bytes(seen["up"]) and flat[:64] not in bytes(seen["down"])   # INIT/BASE encrypted
    assert b'"island_id"' in bytes(seen["up"])   # (the HELLO itself is in the clear)
