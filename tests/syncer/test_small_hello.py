"""Authenticate before reading big things (issue #13): a HELLO is at most 64 KiB, and the manifest (up to 16 MiB)
follows in a protected MANIFEST frame only once the syncer checked the HELLO's MAC and answered HELLO_OK. So a
stranger cannot make the syncer read (or JSON-parse) more than 64 KiB, and a MANIFEST is parsed only after its
frame authentication and checked against the digest the HELLO's MAC covered (docs/protocol.md, "Handshake")."""
import contextlib
import socket
import threading
import time

import pytest

from yeto_patch.syncer.net import handshake as handshake_mod
from yeto_patch.wire import auth
from yeto_patch.wire import transport as transport_mod
from yeto_patch.wire.frames import HEADER, MAGIC, MAX_PAYLOAD, VERSION, MsgType, PeerError, ProtocolError
from yeto_patch.wire.message import pack_meta
from yeto_patch.wire.transport import connect, listen

from .helpers import (KEY, MANIFEST, SealedFrames, client, hello_meta, make_server, manifest_meta, raw_hello,
                      running)

pytestmark = pytest.mark.timeout(60)
DIGEST = auth.manifest_digest(MANIFEST)


@pytest.fixture
def syncer(monkeypatch):
    """A keyed syncer; yields (server, address, counters): bytes the syncer's connections read, and how many
    manifests it parsed."""
    counts = {"read": 0, "parsed": 0}
    real_recv_into, real_normalize = transport_mod.Connection._recv_into, handshake_mod.normalize_manifest
    server, addr = make_server(islands=2, fragments=2)

    def counting_recv_into(self, view, *a, **kw):
        if self.peer != addr:   # the syncer's side of a connection (its peer is the test's ephemeral port)
            counts["read"] += len(view)
        return real_recv_into(self, view, *a, **kw)

    def counting_normalize(manifest):
        counts["parsed"] += 1
        return real_normalize(manifest)

    monkeypatch.setattr(transport_mod.Connection, "_recv_into", counting_recv_into)
    monkeypatch.setattr(handshake_mod, "normalize_manifest", counting_normalize)
    with running(server):
        yield server, addr, counts


def frame(msg_type, meta: dict, pad: int = 0) -> bytes:
    """An unprotected frame whose meta is ``meta`` (plus ``pad`` bytes of padding in it), of any length (a
    hostile peer's: encode_header would refuse one above the type's maximum)."""
    import xxhash
    payload = pack_meta(dict(meta, pad="x" * pad) if pad else meta)
    return HEADER.pack(MAGIC, VERSION, msg_type, 0, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def send_in_background(sock, data: bytes) -> threading.Thread:
    """Write ``data`` without blocking the test (the syncer may stop reading, or reset the connection)."""
    def run():
        with contextlib.suppress(OSError):
            sock.sendall(data)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def wait_closed(sock, timeout=5.0) -> bytes:
    """Everything the syncer sent until it closed ``sock`` (fails if it stays open)."""
    sock.settimeout(timeout)
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while True:
            piece = sock.recv(1 << 16)
            if not piece:
                return got
            got += piece
    return got


def no_join(server):
    st = server.status()
    assert not st["members"] and st["manifest_digest"] is None, st   # nobody joined, no manifest was fixed
    assert not [s for s in server.sessions.values() if not s.closed]


def test_the_limits():
    assert MAX_PAYLOAD[MsgType.HELLO] == MAX_PAYLOAD[MsgType.PROBE] == 64 << 10
    assert MAX_PAYLOAD[MsgType.MANIFEST] == 16 << 20


def test_a_strangers_1_mib_hello_is_refused_from_its_header(syncer):
    server, addr, counts = syncer
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        assert s.recv(28)[:4] == b"YETO"   # the CHALLENGE's header
        hello = frame(MsgType.HELLO, hello_meta({"nonce": "00" * 32}, "mallory", 1, auth.new_nonce(), DIGEST),
                      pad=1 << 20)
        assert len(hello) > 1 << 20
        th = send_in_background(s, hello)
        t0 = time.monotonic()
        wait_closed(s)
        assert time.monotonic() - t0 < 3
        th.join(5)
    time.sleep(0.2)
    assert counts["read"] <= 28, counts   # the header only: refused before a byte of its payload was read
    assert counts["parsed"] == 0
    no_join(server)


def test_a_hello_with_a_wrong_mac_is_refused_before_its_manifest_is_read(syncer):
    server, addr, counts = syncer
    conn = connect(addr, timeout=5, retries=0)
    try:
        _, ch, _ = conn.recv(timeout=5)
        hello = hello_meta(ch, "mallory", 1, auth.new_nonce(), DIGEST, key=b"w" * 32)   # the wrong key's MAC
        sealed = SealedFrames(b"w" * 32)
        big = manifest_meta([(f"t{i}", (4, 4), "float32") for i in range(40000)])   # ~1 MiB of JSON
        huge = b"".join(sealed.chunk(1, MsgType.MANIFEST, len(pack_meta(big)), off, piece)
                        for off, piece in _pieces(pack_meta(big), 60 << 10))
        th = send_in_background(conn.sock, frame(MsgType.HELLO, hello) + huge)
        with pytest.raises(PeerError) as e:
            conn.recv(timeout=5)
        assert e.value.code == "auth" and "wrong key" in e.value.message
        th.join(5)
    finally:
        conn.close()
    time.sleep(0.2)
    assert counts["parsed"] == 0
    assert counts["read"] < 64 << 10, counts   # the HELLO (and at most what the socket had buffered: nothing)
    no_join(server)


def _pieces(data: bytes, size: int):
    for off in range(0, len(data), size):
        yield off, data[off:off + size]


def test_an_island_joins_with_hello_ok_then_its_manifest(syncer):
    server, addr, counts = syncer
    c = client(addr, "a")
    w = c.connect()
    assert w.island_id == "a" and counts["parsed"] == 1
    c.close()


def test_a_manifest_that_does_not_match_the_hellos_digest_is_refused(syncer):
    server, addr, counts = syncer
    conn, _, _ = raw_hello(addr, "a", DIGEST)
    try:
        assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK
        other = manifest_meta(MANIFEST)
        other["manifest"][1][1] = [49, 16]
        conn.send(MsgType.MANIFEST, other)
        with pytest.raises(PeerError) as e:
            conn.recv(timeout=5)
        assert e.value.code == "auth" and "authenticated manifest digest" in e.value.message
    finally:
        conn.close()
    no_join(server)


@pytest.mark.parametrize("how", ["wrong-key", "unprotected"])
def test_a_manifest_failing_frame_authentication_is_refused_unparsed(syncer, how):
    server, addr, counts = syncer
    conn, _, _ = raw_hello(addr, "a", DIGEST)
    try:
        assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK
        m = manifest_meta(MANIFEST)
        data = SealedFrames(b"z" * 32).message(MsgType.MANIFEST, m) if how == "wrong-key" else \
            frame(MsgType.MANIFEST, m)
        conn.sock.sendall(data)
        wait_closed(conn.sock)
    finally:
        conn.close()
    time.sleep(0.2)
    assert counts["parsed"] == 0
    no_join(server)


def test_something_else_than_a_manifest_after_hello_ok_is_a_protocol_refusal(syncer):
    server, addr, counts = syncer
    conn, _, _ = raw_hello(addr, "a", DIGEST)
    try:
        assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK
        conn.send(MsgType.HEARTBEAT, {})
        with pytest.raises(PeerError) as e:
            conn.recv(timeout=5)
        assert e.value.code == "protocol" and "expected MANIFEST" in e.value.message
    finally:
        conn.close()
    no_join(server)


def test_an_old_islands_hello_with_its_manifest_is_refused_naming_the_change(syncer):
    server, addr, counts = syncer
    conn = connect(addr, timeout=5, retries=0)
    try:
        _, ch, _ = conn.recv(timeout=5)
        hello = hello_meta(ch, "a", 1, auth.new_nonce(), DIGEST)
        del hello["protocol"]
        hello.update(manifest_meta(MANIFEST))   # protocol 1: the manifest inside the HELLO
        conn.send(MsgType.HELLO, hello)
        with pytest.raises(PeerError) as e:
            conn.recv(timeout=5)
        assert e.value.code == "protocol" and "protocol 1" in e.value.message and "MANIFEST" in e.value.message
    finally:
        conn.close()
    assert counts["parsed"] == 0
    no_join(server)


def test_an_island_refuses_a_syncer_of_another_protocol():
    srv = listen("127.0.0.1:0")
    addr = "127.0.0.1:%d" % srv.getsockname()[1]

    def old_syncer():
        s, _ = srv.accept()
        c = transport_mod.Connection(s, timeout=5)
        c.send(MsgType.CHALLENGE, {"nonce": auth.new_nonce().hex(), "protocol": 1, "auth": True, "frames": "mac"})
        with contextlib.suppress(Exception):
            c.recv(timeout=5)
        c.close()

    th = threading.Thread(target=old_syncer, daemon=True)
    th.start()
    try:
        with pytest.raises(ProtocolError, match="handshake protocol 1, this island speaks 3"):
            client(addr, "a", connect_retries=0).connect()
    finally:
        th.join(10)
        srv.close()


def test_keyless_islands_join_in_the_same_order():
    server, addr = make_server(islands=1, fragments=2, key=None)
    with running(server):
        c = client(addr, "a", key=None)
        assert c.connect().island_id == "a"
        c.close()


def test_probe_sends_no_manifest(syncer):
    from yeto_patch.wire.client import probe
    server, addr, counts = syncer
    assert probe(addr, KEY)["probe"]
    assert counts["parsed"] == 0 and counts["read"] < 64 << 10


def test_a_manifest_above_64_kib_is_read_once_the_hello_passed(syncer):
    server, addr, counts = syncer
    big = [(f"decoder.layers.{i}.weight", (4,), "float32") for i in range(30000)]   # ~1.2 MiB of JSON
    c = client(addr, "a", manifest=big)
    c.connect()
    assert counts["parsed"] == 1 and counts["read"] > 1 << 20
    assert server.status()["manifest_digest"] == auth.manifest_digest(big).hex()
    c.close()
