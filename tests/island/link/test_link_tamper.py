"""A refusal nobody authenticated is transient (issue 26, finding 2): an on-path relay without the key that
forges a clear ``ERROR auth`` in place of the syncer's HELLO_OK, or flips one bit of the CHALLENGE's nonce, costs
the island an attempt, not its run: ``SyncerLink.open`` (start-up) and ``SyncerLink.reconnect`` try again with
their back-off and get through once the relay stops."""
import socket
import struct
import time

import numpy as np
import pytest
import xxhash

from tests.island.link.test_syncer_link import _joined, free_port, settings, syncer
from tests.syncer.helpers import MANIFEST
from tests.syncer.relay import FrameRelay
from yeto_patch.island.boundary.fragment import PushWire
from yeto_patch.island.link.syncer import SyncerLink
from yeto_patch.wire import codecs
from yeto_patch.wire.frames import MsgType
from yeto_patch.wire.message import pack_meta, unpack

pytestmark = pytest.mark.timeout(120)


def _frame(msg_type, meta) -> bytes:
    p = pack_meta(meta)
    return struct.pack("<4sHHIQQ", b"YETO", 1, msg_type, 0, len(p), xxhash.xxh3_64_intdigest(p)) + p


class Tamper:
    """From ``start`` on, the next ``times`` connections through the relay are tampered with ``how``."""

    def __init__(self, how, times=2):
        self.how, self.times, self.start, self.done = how, times, None, 0

    def __call__(self, way, idx, n, hdr, rest):
        if way != "down" or self.start is None or not self.start <= idx < self.start + self.times:
            return [hdr + rest]
        t = struct.unpack_from("<H", hdr, 6)[0]
        if self.how == "forged-auth" and n == 1:   # the syncer's HELLO_OK: a clear refusal instead
            self.done += 1
            return [_frame(MsgType.ERROR, {"code": "auth", "message": "HELLO refused: authentication code mismatch "
                                                                      "(wrong key, or an altered or replayed handshake)"})]
        if self.how == "nonce-bit" and n == 0 and t == MsgType.CHALLENGE:
            meta = dict(unpack(memoryview(rest))[0])
            nonce = bytearray(bytes.fromhex(meta["nonce"]))
            nonce[5] ^= 0x10   # one bit
            meta["nonce"] = nonce.hex()
            self.done += 1
            return [_frame(MsgType.CHALLENGE, meta)]
        return [hdr + rest]


@pytest.mark.parametrize("how", ["forged-auth", "nonce-bit"])
def test_start_up_gets_through_a_relay_that_tampers_with_its_first_handshakes(tmp_path, how):
    port = free_port()
    s = syncer(port)
    tamper = Tamper(how)
    tamper.start = 0
    relay = FrameRelay(port, tamper)
    try:
        link = SyncerLink(settings(tmp_path, relay.port, timeout=30.0), MANIFEST)
        w = link.open()
        assert tamper.done == 2 and relay.connections == 3 and w.fragments == 2
        link.close()
    finally:
        relay.close()
        s.stop()


@pytest.mark.parametrize("how", ["forged-auth", "nonce-bit"])
def test_a_reconnect_gets_through_a_relay_that_tampers_with_its_first_handshakes(tmp_path, how):
    port = free_port()
    s = syncer(port)
    tamper = Tamper(how)
    relay = FrameRelay(port, tamper)
    try:
        link, frags, values = _joined(tmp_path, relay.port)
        records = []
        link.record = lambda event, **kw: records.append((event, kw))
        link.resilient = True
        tamper.start = relay.connections   # the reconnect's first two handshakes
        link.client.conn.sock.shutdown(socket.SHUT_RDWR)   # the link is cut
        st = frags[0]
        body = np.full(st.numel, 0.5, np.float32)
        st.count(5)
        st.count(5)
        st.begin_push(2)
        st.push_handed(PushWire(codecs.encode("f32", body, 256), "f32"))
        link.send_push(st.outgoing(blend=False))   # meets the cut link: reconnects (through the tampering relay) and sends it again
        deadline = time.monotonic() + 30
        while not st.answered():
            assert time.monotonic() < deadline, "no answer"
            link.wait(0.5)
            frags.receive(link.poll())
        assert tamper.done == 2 and st.side.arrived.version == 1
        assert [e for e, _ in records if e != "merge"] == ["reconnect"]   # (one reconnect; merges are figures)
        link.close()
    finally:
        relay.close()
        s.stop()
