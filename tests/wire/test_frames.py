"""Frames, chunk envelopes, reassembly and message meta: formats and hostile input."""
import struct

import numpy as np
import pytest
import xxhash

from yeto_patch.wire import chunks, frames, message
from yeto_patch.wire.chunks import Envelope, Reassembler
from yeto_patch.wire.frames import FrameError, MsgType


def test_header_golden_and_round_trip():
    h = frames.encode_header(MsgType.PUSH, 5, 0x1122334455667788, flags=3)
    assert h.hex() == "5945544f" "0100" "1600" "03000000" "0500000000000000" "8877665544332211"
    assert len(h) == frames.HEADER_SIZE == 28
    assert frames.decode_header(h) == (MsgType.PUSH, 3, 5, 0x1122334455667788)
    assert frames.digest(b"ab", memoryview(b"c")) == xxhash.xxh3_64_intdigest(b"abc")


def _hdr(magic=b"YETO", version=1, t=22, flags=0, length=0, dig=0):
    return struct.pack("<4sHHIQQ", magic, version, t, flags, length, dig)


@pytest.mark.parametrize("buf,match", [
    (_hdr(magic=b"HTTP"), "bad magic"),
    (_hdr(version=2), "unsupported protocol version 2"),
    (_hdr(t=999), "unknown message type 999"),
    (_hdr(t=int(MsgType.HELLO), length=(16 << 20) + 1), "HELLO frame announces"),
    (_hdr(t=int(MsgType.CHUNK), length=1 << 40), "CHUNK frame announces"),
    (_hdr(t=int(MsgType.PUSH), length=(1 << 40) + 1), "PUSH frame announces"),
    (_hdr()[:27], "truncated frame header"),
])
def test_header_refusals(buf, match):
    with pytest.raises(FrameError, match=match):
        frames.decode_header(buf)


def test_encode_header_refusals():
    with pytest.raises(FrameError):
        frames.encode_header(77, 0, 0)
    with pytest.raises(FrameError, match="exceeds"):
        frames.encode_header(MsgType.ERROR, 1 << 20, 0)


def test_error_hierarchy():
    for cls in (frames.FrameError, frames.DigestError, frames.AuthError, frames.CodecError, frames.PeerError,
                frames.WireTimeout):
        assert issubclass(cls, frames.ProtocolError)
    assert issubclass(frames.WireTimeout, TimeoutError)
    e = frames.PeerError("bad_island", "unknown island x")
    assert e.code == "bad_island" and "unknown island x" in str(e)


# ----------------------------------------------------------------------------------------- envelopes
def test_envelope_golden():
    env = chunks.pack_envelope(7, MsgType.PUSH, 10, 4)
    assert env.hex() == "0700000000000000" "1600" "0000" "0a00000000000000" "0400000000000000"
    e, data = chunks.unpack_envelope(env + b"xyz")
    assert e == Envelope(7, MsgType.PUSH, 10, 4) and bytes(data) == b"xyz"
    with pytest.raises(FrameError, match="truncated chunk envelope"):
        chunks.unpack_envelope(env[:20])
    with pytest.raises(FrameError, match="reserved"):
        chunks.unpack_envelope(struct.pack("<QHHQQ", 7, 22, 1, 10, 0))


def test_reassembly_in_order_and_interleaved():
    r = Reassembler(max_partial=2)
    payload_a = bytes(range(256)) * 4
    payload_b = b"B" * 10
    assert r.feed(Envelope(1, MsgType.PUSH, len(payload_a), 0), payload_a[:300]) is None
    assert r.feed(Envelope(2, MsgType.BASE, 10, 0), payload_b[:5]) is None
    assert r.open_messages == 2
    assert r.feed(Envelope(1, MsgType.PUSH, len(payload_a), 300), payload_a[300:1000]) is None
    t, buf = r.feed(Envelope(2, MsgType.BASE, 10, 5), payload_b[5:])
    assert t == MsgType.BASE and bytes(buf) == payload_b
    t, buf = r.feed(Envelope(1, MsgType.PUSH, len(payload_a), 1000), payload_a[1000:])
    assert t == MsgType.PUSH and bytes(buf) == payload_a and isinstance(buf, np.ndarray)
    assert r.open_messages == 0


@pytest.mark.parametrize("steps,match", [
    ([(0, b"abcd"), (2, b"xy")], "overlaps"),
    ([(0, b"abcd"), (0, b"abcd")], "overlaps"),
    ([(0, b"abcd"), (6, b"xy")], "gap"),
    ([(2, b"ab")], "gap"),
    ([(0, b"abcd"), (4, b"efghijk")], "overflows"),
    ([(0, b"")], "empty chunk"),
])
def test_reassembly_refusals_name_the_message(steps, match):
    r = Reassembler()
    with pytest.raises(FrameError, match=match) as ei:
        for off, data in steps:
            r.feed(Envelope(42, MsgType.PUSH, 10, off), data)
    assert "PUSH message 42" in str(ei.value)


def test_reassembly_limits():
    r = Reassembler(max_partial=2)
    r.feed(Envelope(1, MsgType.PUSH, 10, 0), b"a")
    r.feed(Envelope(2, MsgType.PUSH, 10, 0), b"a")
    with pytest.raises(FrameError, match="too many partial messages"):
        r.feed(Envelope(3, MsgType.PUSH, 10, 0), b"a")
    with pytest.raises(FrameError, match="above the maximum"):
        Reassembler().feed(Envelope(1, MsgType.HELLO, (16 << 20) + 1, 0), b"a")
    with pytest.raises(FrameError, match="above the maximum"):
        Reassembler().feed(Envelope(1, MsgType.PUSH, (1 << 40) + 1, 0), b"a")
    with pytest.raises(FrameError, match="unknown inner type"):
        Reassembler().feed(Envelope(1, 999, 10, 0), b"a")
    with pytest.raises(FrameError, match="nests another CHUNK"):
        Reassembler().feed(Envelope(1, MsgType.CHUNK, 10, 0), b"a")
    with pytest.raises(FrameError, match="empty chunked"):
        Reassembler().feed(Envelope(1, MsgType.PUSH, 0, 0), b"")
    with pytest.raises(FrameError, match="changes the message"):
        r.feed(Envelope(1, MsgType.PUSH, 11, 1), b"a")
    budget = Reassembler(max_bytes=100)
    budget.feed(Envelope(1, MsgType.PUSH, 60, 0), b"a")
    with pytest.raises(FrameError, match="reassembly budget"):
        budget.feed(Envelope(2, MsgType.PUSH, 60, 0), b"a")


def test_huge_announced_total_allocates_lazily():
    # an 8 GiB announcement must not commit memory up front (pages fill as data arrives) ...
    r = Reassembler(max_partial=1)
    r.feed(Envelope(1, MsgType.PUSH, 8 << 30, 0), b"abc")
    assert r.open_messages == 1
    r.drop(1)



def test_unbackable_total_is_a_frame_error(monkeypatch):
    def no_memory(*a, **k):
        raise MemoryError

    monkeypatch.setattr(chunks.np, "empty", no_memory)
    with pytest.raises(FrameError, match="PUSH message 2: cannot allocate"):
        Reassembler().feed(Envelope(2, MsgType.PUSH, 1 << 40, 0), b"abc")


# ------------------------------------------------------------------------------------------- messages
def test_meta_round_trip_and_golden():
    prefix = message.pack_meta({"a": 1, "b": "é"}, 3)
    assert prefix.hex() == "10000000" + '{"a":1,"b":"é"}'.encode().hex()
    meta, body = message.unpack(prefix + b"xyz")
    assert meta == {"a": 1, "b": "é"} and bytes(body) == b"xyz"
    meta, body = message.unpack(message.pack_meta({}) + b"")
    assert meta == {} and len(body) == 0


@pytest.mark.parametrize("payload,match", [
    (b"\x01\x00", "no meta length"),
    (struct.pack("<I", 100) + b"{}", "truncated message"),
    (struct.pack("<I", (16 << 20) + 1), "exceeds"),
    (struct.pack("<I", 2) + b"[]", "JSON object"),
    (struct.pack("<I", 3) + b"{x}", "not valid UTF-8 JSON"),
    (struct.pack("<I", 2) + b"\xff\xfe", "not valid UTF-8 JSON"),
    (struct.pack("<I", 9) + b'{"a":NaN}', "NaN"),
    (struct.pack("<I", 13) + b'{"a":1,"a":2}', "duplicate key"),
    (struct.pack("<I", 20000) + b"[" * 10000 + b"]" * 10000, "JSON"),
])
def test_meta_refusals(payload, match):
    with pytest.raises(FrameError, match=match):
        message.unpack(payload)


def test_pack_meta_refusals():
    with pytest.raises(FrameError, match="plain JSON"):
        message.pack_meta({"x": object()})
    with pytest.raises(FrameError, match="plain JSON"):
        message.pack_meta({"x": float("nan")})
    with pytest.raises(FrameError, match="must be a dict"):
        message.pack_meta([1, 2])
