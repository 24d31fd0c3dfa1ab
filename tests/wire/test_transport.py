"""Transport over real loopback sockets: framing, chunked streaming, digests, timeouts, peer errors."""
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
import xxhash

from yeto_patch.wire import chunks, frames, transport
from yeto_patch.wire.frames import DigestError, FrameError, MsgType, PeerError, ProtocolError, WireTimeout
from yeto_patch.wire.message import pack_meta

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    """(client Connection, server Connection) over 127.0.0.1."""
    ls = transport.listen("127.0.0.1:0")
    port = ls.getsockname()[1]
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("s", ls.accept()[0]))
    t.start()
    c = transport.connect(f"127.0.0.1:{port}", timeout=5, retries=0, chunk_size=64 << 10)
    t.join(5)
    s = transport.Connection(box["s"], timeout=5, chunk_size=64 << 10)
    yield c, s
    c.close()
    s.close()
    ls.close()


@pytest.fixture
def raw_pair():
    """(raw client socket, server Connection) for writing hostile bytes."""
    ls = transport.listen("127.0.0.1:0")
    raw = socket.create_connection(ls.getsockname()[:2], timeout=5)
    s = transport.Connection(ls.accept()[0], timeout=1.0)
    yield raw, s
    raw.close()
    s.close()
    ls.close()


def frame(t, payload, dig=None, magic=b"YETO", version=1, length=None):
    dig = xxhash.xxh3_64_intdigest(payload) if dig is None else dig
    return struct.pack("<4sHHIQQ", magic, version, t, 0, len(payload) if length is None else length, dig) + payload


def test_small_message_round_trip(pair):
    c, s = pair
    c.send(MsgType.HELLO, {"island": "a", "n": [1, 2]}, [b"ab", bytearray(b"cd"), memoryview(b"ef")])
    t, meta, body = s.recv()
    assert t == MsgType.HELLO and meta == {"island": "a", "n": [1, 2]} and bytes(body) == b"abcdef"
    s.send(MsgType.ACK, {})
    assert c.recv()[:2] == (MsgType.ACK, {})


def test_large_message_streamed_in_chunks(pair):
    c, s = pair
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (100_000, 1, 250_003, 70_000)]
    total = sum(a.nbytes for a in arrays)

    def gen():
        for a in arrays:
            yield a  # numpy arrays go out through the buffer protocol, no bytes() copy
    th = threading.Thread(target=lambda: c.send(MsgType.PUSH, {"fragment": 3}, body_iter=gen(), body_len=total))
    th.start()
    t, meta, body = s.recv()
    th.join()
    assert t == MsgType.PUSH and meta == {"fragment": 3}
    assert bytes(body) == b"".join(a.tobytes() for a in arrays)
    # list body larger than a chunk also works, and the next small message follows intact
    c.send(MsgType.BASE, {"v": 1}, [a for a in arrays[:2]])
    c.send(MsgType.HEARTBEAT, {"i": 1})
    t, meta, body = s.recv()
    assert t == MsgType.BASE and np.array_equal(np.frombuffer(body, np.float32)[:100_000], arrays[0])
    assert s.recv()[:2] == (MsgType.HEARTBEAT, {"i": 1})


def test_chunk_frames_on_the_wire_and_streaming_memory():
    """The sender cuts CHUNK frames of chunk_size and never holds a second copy of the body."""
    ls = transport.listen("127.0.0.1:0")
    raw = socket.create_connection(ls.getsockname()[:2], timeout=10)
    c = transport.Connection(ls.accept()[0], timeout=10, chunk_size=1 << 20)
    frames_seen = []

    def reader():
        buf = bytearray(2 << 20)
        while True:
            hdr = bytearray()
            while len(hdr) < 28:
                d = raw.recv(28 - len(hdr))
                if not d:
                    return
                hdr += d
            h = frames.decode_header(hdr)
            view = memoryview(buf)[: h.length]
            got = 0
            while got < h.length:
                got += raw.recv_into(view[got:], h.length - got)
            assert xxhash.xxh3_64_intdigest(view) == h.digest
            env, data = chunks.unpack_envelope(view)
            frames_seen.append((h.msg_type, env, len(data)))
            if env.offset + len(data) == env.total:
                return

    th = threading.Thread(target=reader)
    th.start()
    piece = np.ones(1 << 18, np.float32)  # 1 MiB, yielded 32 times: 32 MiB body
    tracemalloc.start()
    try:
        c.send(MsgType.INIT, {"f": 0}, body_iter=(piece for _ in range(32)), body_len=32 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    th.join(10)
    c.close()
    raw.close()
    ls.close()
    prefix = len(pack_meta({"f": 0}))
    total = prefix + (32 << 20)
    assert all(t == MsgType.CHUNK and env.inner_type == MsgType.INIT and env.total == total
               for t, env, _ in frames_seen)
    assert [n for _, _, n in frames_seen] == [1 << 20] * 32 + [prefix]
    assert [env.offset for _, env, _ in frames_seen] == [i << 20 for i in range(33)]
    assert peak < 1 << 20, f"sender allocated {peak} bytes while streaming 32 MiB"


def test_recv_timeout_raises_and_connection_survives(pair):
    c, s = pair
    t0 = time.monotonic()
    with pytest.raises(WireTimeout, match="no message"):
        s.recv(timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    c.send(MsgType.PROBE, {"x": 1})
    assert s.recv(timeout=5)[1] == {"x": 1}


def test_stall_mid_frame_times_out_and_breaks(raw_pair):
    raw, s = raw_pair
    raw.sendall(frame(MsgType.HELLO, b"\x02\x00\x00\x00{}")[:20])
    with pytest.raises(WireTimeout, match="stalled"):
        s.recv(timeout=2)
    with pytest.raises(ProtocolError, match="unusable"):
        s.recv(timeout=0.1)


def test_peer_error_surfaced(pair):
    c, s = pair
    s.send_error("stale_base", "base version 3 is older than 5")
    with pytest.raises(PeerError, match="stale_base") as ei:
        c.recv()
    assert ei.value.code == "stale_base" and "older than 5" in ei.value.message


def test_peer_close_surfaced(pair):
    c, s = pair
    c.close()
    with pytest.raises(ProtocolError, match="closed the connection"):
        s.recv(timeout=2)


@pytest.mark.parametrize("data,exc,match", [
    (frame(MsgType.HELLO, b"\x02\x00\x00\x00{}", dig=12345), DigestError, "digest mismatch in HELLO"),
    (frame(MsgType.HELLO, b"\x02\x00\x00\x00{}", magic=b"GET "), FrameError, "bad magic"),
    (frame(MsgType.HELLO, b"\x02\x00\x00\x00{}", version=9), FrameError, "version 9"),
    (frame(MsgType.HELLO, b"", length=1 << 30), FrameError, "HELLO frame announces"),
    (frame(MsgType.PUSH, b"", length=1 << 39), FrameError, "unchunked PUSH frame announces"),
    (frame(MsgType.HELLO, b"\x05\x00\x00\x00{}"), FrameError, "truncated message"),
    (frame(MsgType.CHUNK, b"short"), FrameError, "shorter than its envelope"),
    (frame(MsgType.CHUNK, chunks.pack_envelope(9, MsgType.HELLO, 1 << 30, 0) + b"x"), FrameError,
     "HELLO message 9 announces"),
    (frame(MsgType.CHUNK, chunks.pack_envelope(9, MsgType.PUSH, 100, 0) + b"x", dig=1), DigestError,
     "chunk of PUSH message 9"),
    (frame(MsgType.CHUNK, chunks.pack_envelope(9, MsgType.PUSH, 4, 0) + b"xy") +
     frame(MsgType.CHUNK, chunks.pack_envelope(9, MsgType.PUSH, 4, 1) + b"zw"), FrameError, "overlaps"),
    (frame(MsgType.CHUNK, chunks.pack_envelope(9, MsgType.PUSH, 4, 0) + b"xyzwv"), FrameError, "overflows"),
])
def test_hostile_frames(raw_pair, data, exc, match):
    raw, s = raw_pair
    raw.sendall(data)
    with pytest.raises(exc, match=match):
        s.recv(timeout=2)
    assert s.broken  # the stream cannot be trusted after a framing error
    with pytest.raises(ProtocolError):
        s.recv(timeout=0.1)


def test_receiver_max_payload_override():
    ls = transport.listen("127.0.0.1:0")
    c = transport.connect("127.0.0.1:%d" % ls.getsockname()[1], timeout=5, retries=0, chunk_size=1 << 16)
    s = transport.Connection(ls.accept()[0], timeout=5, max_payload={MsgType.PUSH: 100_000})
    th = threading.Thread(target=lambda: c.send(MsgType.PUSH, {}, b"x" * 200_000))
    th.start()
    with pytest.raises(FrameError, match="PUSH message 1 announces"):
        s.recv()
    th.join(5)
    c.close(), s.close(), ls.close()


def test_set_limits_lowers_the_maxima_for_the_next_message(raw_pair):
    raw, s = raw_pair
    s.set_limits({MsgType.PUSH: 1000, MsgType.HELLO: 1 << 40}, max_reassembly_bytes=3000)
    assert s.max_payload[MsgType.HELLO] == frames.MAX_PAYLOAD[MsgType.HELLO]  # never above the protocol's
    payload = pack_meta({}) + b"x" * 900
    raw.sendall(frame(MsgType.PUSH, payload))
    assert bytes(s.recv(timeout=2)[2]) == b"x" * 900
    # chunked: checked on the envelope, before the message buffer is reserved
    raw.sendall(frame(MsgType.CHUNK, chunks.pack_envelope(3, MsgType.PUSH, 1001, 0) + b"x"))
    with pytest.raises(FrameError, match="PUSH message 3 announces 1001 bytes, above the maximum 1000"):
        s.recv(timeout=2)


def test_set_limits_bounds_the_messages_open_at_once(raw_pair):
    raw, s = raw_pair
    s.set_limits({}, max_reassembly_bytes=3000)
    raw.sendall(frame(MsgType.CHUNK, chunks.pack_envelope(1, MsgType.HELLO, 2000, 0) + b"x") +
                frame(MsgType.CHUNK, chunks.pack_envelope(2, MsgType.HELLO, 2000, 0) + b"x"))
    with pytest.raises(FrameError, match="exceeds the reassembly budget"):
        s.recv(timeout=2)


def test_recv_within_bounds_the_whole_message(raw_pair):
    raw, s = raw_pair  # (stall timeout 1 s: every byte below comes well within it)
    data = frame(MsgType.HELLO, pack_meta({"pad": "x" * 200}))

    def trickle():
        for i in range(len(data)):
            try:
                raw.sendall(data[i:i + 1])
            except OSError:
                return
            time.sleep(0.05)

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    t0 = time.monotonic()
    with pytest.raises(WireTimeout, match="not complete within 0.5s"):
        s.recv(timeout=2, within=0.5)
    assert time.monotonic() - t0 < 1.5 and s.broken
    assert s.sock.gettimeout() == 0.0  # non-blocking: each direction polls with its own deadline
    raw.close()
    th.join(5)


def test_body_iter_length_mismatch_breaks_connection(pair):
    c, s = pair
    with pytest.raises(FrameError, match="yielded"):
        c.send(MsgType.PUSH, {}, body_iter=iter([b"x" * 100_000]), body_len=200_000)
    assert c.broken
    with pytest.raises(FrameError, match="announced"):
        transport.Connection.send(pair[1], MsgType.PUSH, {}, body_iter=iter([b"x" * 10]), body_len=5)


def test_concurrent_senders_do_not_interleave_bytes(pair):
    c, s = pair
    n = 40

    def sender(k):
        for i in range(n):
            c.send(MsgType.PUSH if i % 2 else MsgType.HEARTBEAT, {"k": k, "i": i},
                   np.full(50_000 if i % 2 else 10, k * 1000 + i, np.int32))
    ths = [threading.Thread(target=sender, args=(k,)) for k in range(3)]
    [t.start() for t in ths]
    seen = {}
    for _ in range(3 * n):
        t, meta, body = s.recv()
        arr = np.frombuffer(body, np.int32)
        assert (arr == meta["k"] * 1000 + meta["i"]).all()
        assert meta["i"] == seen.get(meta["k"], -1) + 1
        seen[meta["k"]] = meta["i"]
    [t.join() for t in ths]


def test_connect_retries_with_bounded_backoff():
    from tests.ports import free_port
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(transport.ConnectError, match="after 4 attempts"):
        transport.connect(f"127.0.0.1:{port}", timeout=1, retries=3, backoff=0.05, max_backoff=0.1)
    dt = time.monotonic() - t0
    assert 0.05 * 0.8 + 0.1 * 0.8 * 2 <= dt < 5  # 0.05 + 0.1 + 0.1 (capped), with jitter


def test_connect_succeeds_once_listener_appears():
    from tests.ports import free_port
    port = free_port()   # nothing listens there yet
    box = {}

    def late():
        time.sleep(0.4)
        box["ls"] = transport.listen(f"127.0.0.1:{port}")
    th = threading.Thread(target=late)
    th.start()
    c = transport.connect(f"127.0.0.1:{port}", timeout=1, retries=6, backoff=0.1, max_backoff=0.4)
    th.join()
    c.close()
    box["ls"].close()


def test_parse_address():
    assert transport.parse_address("h:1") == ("h", 1)
    assert transport.parse_address("[::1]:80") == ("::1", 80)
    for bad in ("nohost", ":80", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            transport.parse_address(bad)


def test_send_refuses_chunk_type_and_oversized(pair):
    c, _ = pair
    with pytest.raises(FrameError):
        c.send(MsgType.CHUNK, {})
    with pytest.raises(FrameError, match="exceeds"):
        c.send(MsgType.ERROR, {"m": "x" * (70 << 10)})
    with pytest.raises(FrameError, match="either body or body_iter"):
        c.send(MsgType.PUSH, {}, np.ones(3, np.float32), body_iter=iter([b"x"]), body_len=1)
    with pytest.raises(FrameError, match="needs body_len"):
        c.send(MsgType.PUSH, {}, body_iter=iter([b"x"]))
    assert not c.broken  # refusals before anything was written leave the connection usable
