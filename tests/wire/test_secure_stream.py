"""Protected frames larger than one crypto piece (wire/secure.py streaming, wire/scratch.py): sealed piece by piece
they are byte for byte the frames a whole-frame seal writes, they round-trip on real loopback connections, and
any change inside them (a flipped bit in any piece, a cut, a dropped or replayed frame) fails authentication
without delivering anything."""
import os
import random
import socket
import struct
import threading

import numpy as np
import pytest

from yeto_patch.wire import scratch, secure, transport
from yeto_patch.wire.chunks import pack_envelope
from yeto_patch.wire.frames import FrameAuthError, MsgType, ProtocolError, encode_header
from yeto_patch.wire.message import pack_meta

pytestmark = pytest.mark.timeout(60)
K1, K2 = os.urandom(32), os.urandom(32)
P = scratch.PIECE
BODY = np.random.default_rng(1).integers(0, 255, 2 * P + 12345, dtype=np.uint8)   # three pieces, the last short


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_streamed_frame_is_the_frame_a_whole_seal_writes(encrypt):
    whole, streamed = secure.Sealer(K1, encrypt), secure.Sealer(K1, encrypt)
    mv = memoryview(BODY)
    for clear, t, parts in ((1, MsgType.CHUNK, [pack_envelope(7, MsgType.PUSH, 10 * P, 0), mv[:P + 3], mv[P + 3:]]),
                            (0, MsgType.PUSH, [pack_meta({"fragment": 0}), mv]),
                            (0, MsgType.HEARTBEAT, [pack_meta({"step": 1})])):   # (one piece: one write)
        header = encode_header(t, sum(len(p) for p in parts), 0, whole.flags)
        out, tag = whole.seal(header, parts, clear)
        writes = []
        streamed.stream(header, parts, lambda bufs: writes.append(b"".join(bytes(b) for b in bufs)), clear)
        assert b"".join(writes) == header + b"".join(bytes(p) for p in out) + tag, t
        assert (len(writes) == 1) is (t == MsgType.HEARTBEAT)
        assert all(len(w) <= P + 64 for w in writes[:-1]), [len(w) for w in writes]   # a piece at a time
        if t != MsgType.HEARTBEAT:
            assert (bytes(mv[100:200]) in b"".join(writes)) is (not encrypt)
    assert whole.seq == streamed.seq == 3


def _pair(chunk):
    a, b = socket.socketpair()
    return transport.Connection(a, timeout=10, chunk_size=chunk), transport.Connection(b, timeout=10, chunk_size=chunk)


@pytest.mark.parametrize("encrypt", [False, True])
def test_messages_of_many_pieces_round_trip_interleaved(encrypt):
    c, s = _pair(chunk=P + P // 2)   # chunks of 1.5 pieces: pieces straddle the chunk and part boundaries
    c.protect(K1, K2, encrypt)
    s.protect(K2, K1, encrypt)
    s.set_limits({MsgType.PUSH: 8 * P})
    bodies = [BODY, BODY[::-1].copy()]
    th = threading.Thread(target=lambda: [c.send(MsgType.PUSH, {"i": i}, b) for i, b in enumerate(bodies)])
    th.start()
    c.send(MsgType.HEARTBEAT, {"step": 1})   # from another thread, between the chunks
    got = [s.recv(timeout=10) for _ in range(3)]
    th.join(10)
    pushes = {m["i"]: bytes(b) for t, m, b in got if t == MsgType.PUSH}
    assert pushes == {0: BODY.tobytes(), 1: bodies[1].tobytes()}
    s.chunk_size = 4 * P
    s.send(MsgType.BASE, {"ok": 1}, BODY)   # the other direction, one unchunked multi-piece frame
    t, m, b = c.recv(timeout=10)
    assert (t, m, bytes(b)) == (MsgType.BASE, {"ok": 1}, BODY.tobytes())
    c.close()
    s.close()


def _capture(encrypt):
    """The raw bytes of a protected multi-piece PUSH frame (unchunked) and of the HEARTBEAT after it."""
    a, b = socket.socketpair()
    conn = transport.Connection(a, timeout=10, chunk_size=4 * P)
    conn.protect(K1, K2, encrypt)
    th = threading.Thread(target=lambda: (conn.send(MsgType.PUSH, {"i": 0}, BODY),
                                          conn.send(MsgType.HEARTBEAT, {"step": 1})))
    th.start()
    frames = []
    for _ in range(2):
        hdr = b.recv(28, socket.MSG_WAITALL)
        n = struct.unpack_from("<Q", hdr, 12)[0] + secure.TAG_SIZE
        frames.append(hdr + b.recv(n, socket.MSG_WAITALL))
    th.join(10)
    conn.close()
    b.close()
    return frames


def _deliver(raw: bytes, encrypt):
    a, b = socket.socketpair()
    conn = transport.Connection(b, timeout=2)
    conn.protect(K2, K1, encrypt)
    th = threading.Thread(target=lambda: (a.sendall(raw), a.shutdown(socket.SHUT_WR)))
    th.start()
    out = []
    try:
        while True:
            t, m, body = conn.recv(timeout=2)
            out.append((t, m, bytes(body)))
    except ProtocolError as e:   # (FrameAuthError, or the end of the stream)
        out.append(e)
    th.join(10)
    a.close()
    conn.close()
    return out


@pytest.mark.parametrize("encrypt", [False, True])
def test_any_change_inside_a_streamed_frame_fails_and_delivers_nothing(encrypt):
    push, hb = _capture(encrypt)
    assert len(push) > 2 * P
    ok = _deliver(push + hb, encrypt)
    assert [t for t, _, _ in ok[:2]] == [MsgType.PUSH, MsgType.HEARTBEAT] and ok[0][2] == BODY.tobytes()
    rng = random.Random(7)
    cases = {}
    for piece in range(3):   # a bit flipped in each piece of the payload, and in the tag
        pos = 28 + piece * P + rng.randrange(min(P, len(push) - 28 - 16 - piece * P))
        cases[f"piece {piece}"] = push[:pos] + bytes([push[pos] ^ (1 << rng.randrange(8))]) + push[pos + 1:] + hb
    cases["tag"] = push[:-3] + bytes([push[-3] ^ 0x10]) + push[-2:] + hb
    cases["dropped"] = hb
    cases["replayed"] = push + push + hb
    for name, stream in cases.items():
        out = _deliver(stream, encrypt)
        if name == "replayed":
            assert out[0][2] == BODY.tobytes(), name
            out = out[1:]
        assert isinstance(out[0], FrameAuthError) and "frame authentication failed" in str(out[0]), (name, out)
    cut = 28 + P + rng.randrange(P)   # cut in the middle of the second piece
    out = _deliver(push[:cut], encrypt)
    assert len(out) == 1 and "closed the connection mid-frame" in str(out[0]), out


def test_scratch_pieces_are_reused_and_bounded():
    with scratch.piece() as a:
        with scratch.piece() as b:
            assert len(a) == len(b) == P and a.obj is not b.obj
    with scratch.piece() as c:
        assert c.obj is b.obj or c.obj is a.obj   # from the free list, no fresh pages
    held = [scratch.piece() for _ in range(scratch.KEEP + 3)]
    for h in held:
        h.__enter__()
    for h in held:
        h.__exit__(None, None, None)
    assert len(scratch._free) <= scratch.KEEP
