"""Hostile handshakes and pushes against a running, initialized syncer: each is refused with an error that names
its cause on the island's side, and the syncer's state (committed and pending) is unchanged."""
import contextlib
import logging
import os
import socket
import struct
import time

import numpy as np
import pytest
import xxhash

from yeto_patch.wire import auth, codecs, secure
from yeto_patch.wire import transport as transport_mod
from yeto_patch.wire.client import SyncerRefusal
from yeto_patch.wire.frames import MsgType, PeerError, ProtocolError
from yeto_patch.wire.message import pack_meta
from yeto_patch.wire.transport import connect

from .helpers import (KEY, MANIFEST, SealedFrames, client, init_values, make_server, manifest_meta, raw_hello, running,
                      state_of)

pytestmark = pytest.mark.timeout(60)
DIGEST = auth.manifest_digest(MANIFEST)


@pytest.fixture
def run():
    """Island a initialized the run and merged one round of each fragment (versions [1, 1, 1]); island b (it
    holds the key, and is the hostile one) has joined. Yields (server, addr, a, b, b's recorded HELLO meta)."""
    server, addr = make_server(islands=2, fragments=3, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        values = init_values()
        a = client(addr, "a")
        wa = a.connect()
        a.wait_ready(20, init_source=lambda f: [values[i] for i in wa.layout[f]])
        for f in range(3):
            a.push(f, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(wa.numels[f], 0.01, np.float32)), wait=True)
            a.wait_base(f, 1, 10)
        sent = []
        real_send = transport_mod.Connection.send

        def recording_send(self, msg_type, meta=None, *args, **kw):
            if msg_type == MsgType.HELLO:
                sent.append(dict(meta))
            return real_send(self, msg_type, meta, *args, **kw)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(transport_mod.Connection, "send", recording_send)
            b = client(addr, "b")
            b.connect()
        b.wait_ready(20)
        yield server, addr, a, b, sent[0]
        for c in (a, b):
            c.close()


def push_meta(fragment, base_version, numel, codec="f32", **kw):
    return {"fragment": fragment, "base_version": base_version, "local_step": 1, "steps": 1, "tokens": 1,
            "codec": codec, "block": 256, "numel": numel, "final": False, **kw}


def raw_push(c, meta, body, timeout=10.0) -> SyncerRefusal:
    """Send a PUSH that SyncerClient.push would not build; return the SyncerRefusal the client then raises."""
    c.conn.send(MsgType.PUSH, meta, body)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c.wait_event(0.2)
        except SyncerRefusal as e:
            return e
    raise AssertionError(f"no refusal of the push {meta}")


def handshake_error(addr, meta, msg_type=MsgType.HELLO, key=None) -> PeerError:
    """Send ``meta`` as HELLO (signed with ``key`` against this connection's challenge if given)."""
    conn = connect(addr, timeout=5, retries=0)
    try:
        _, ch, _ = conn.recv(timeout=5)
        if key is not None:
            meta = dict(meta, nonce=auth.new_nonce().hex(), ephemeral=secure.Ephemeral().public.hex())
            meta["mac"] = secure.hello_mac(key, secure.transcript(ch, meta)).hex()
        conn.send(msg_type, meta)
        with pytest.raises(PeerError) as e:
            conn.recv(timeout=5)
        return e.value
    finally:
        conn.close()


def closed_by_syncer(sock, timeout=5.0) -> float:
    """Seconds until the syncer closed ``sock`` (fails if it stays open)."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_wrong_key_is_refused_naming_the_cause(run):
    server, addr, a, b, _ = run
    before = state_of(server)
    for island in ("a", "c"):  # a member's id, and a new one
        with pytest.raises(PeerError) as e:
            client(addr, island, key=b"w" * 32, connect_retries=0).connect()
        assert e.value.code == "auth" and "wrong key" in e.value.message
    assert state_of(server) == before
    a.check()  # the member whose id was used is undisturbed


def test_replayed_handshake_is_refused(run):
    server, addr, a, b, recorded = run
    before = state_of(server)
    e = handshake_error(addr, recorded)  # island b's own, valid HELLO, against a new challenge
    assert e.code == "auth" and "replayed" in e.message
    e = handshake_error(addr, recorded, MsgType.PROBE)
    assert e.code == "auth" and "replayed" in e.message
    assert state_of(server) == before
    b.check()


def test_manifest_mismatch_is_refused_naming_the_entry(run):
    server, addr, a, b, recorded = run
    before = state_of(server)
    other = list(MANIFEST)
    other[2] = ("decoder.layers.0.mlp.linear_fc1.weight", (33, 16), "float32")
    with pytest.raises(PeerError) as e:
        client(addr, "b", manifest=other, connect_retries=0).connect()
    assert e.value.code == "manifest" and "entry 2" in e.value.message and "[33, 16]" in e.value.message
    # signed with the key, but not a manifest the syncer can even digest: a refusal, not an internal error
    for bad, what in (([["w", [1 << 64], "float32"]], "shape"), ("x", "entry 0"), ([], "empty")):
        conn, _, _ = raw_hello(addr, "b", os.urandom(32), incarnation=recorded["incarnation"])
        try:
            assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK
            conn.send(MsgType.MANIFEST, {"manifest": bad})
            with pytest.raises(PeerError) as e:
                conn.recv(timeout=5)
        finally:
            conn.close()
        assert e.value.code == "manifest" and what in e.value.message
    assert state_of(server) == before


def test_push_for_an_unknown_fragment_is_refused(run):
    server, addr, a, b, _ = run
    before = state_of(server)
    n = b.welcome.numels[0]
    with pytest.raises(ProtocolError, match="fragment 99"):  # refused by the island's client before sending
        b.push(99, base_version=1, local_step=1, steps=1, tokens=1, codec="f32", body=np.zeros(n, np.float32))
    for frag in (99, 3, -1, "0", None, 1.5, True):  # ... and by the syncer (True is not fragment 1)
        e = raw_push(b, push_meta(frag, 1, n), np.zeros(b.welcome.numels[1] if frag is True else n, np.float32))
        assert e.code == "bad-fragment" and f"fragment {frag!r}" in e.message and "3 fragments" in e.message
    e = raw_push(b, push_meta(1, True, n), np.zeros(b.welcome.numels[1], np.float32))  # True is not base v1
    assert e.code == "bad-base" and "True" in e.message
    assert state_of(server) == before


def test_nan_push_is_refused_and_leaves_no_trace(run):
    server, addr, a, b, _ = run
    before = state_of(server)
    n = b.welcome.numels[0]
    bad = np.zeros(n, np.float32)
    bad[5] = np.nan
    for base in (1, 0):  # folded at once (lag 0), or held for the next round (lag 1)
        with pytest.raises(SyncerRefusal, match="non-finite value at index 5") as e:
            b.push(0, base_version=base, local_step=99, steps=1, tokens=1, codec="f32", body=bad.view(np.uint8),
                   final=True, wait=True)
        assert e.value.code == "nonfinite"
    scaled = codecs.encode("int8", np.ones(n, np.float32)).copy()
    scaled[:4] = np.frombuffer(np.float32(1e38).tobytes(), np.uint8)  # finite, but above the int8 maximum
    for base in (1, 0):
        with pytest.raises(SyncerRefusal, match="invalid scale") as e:
            b.push(0, base_version=base, local_step=99, steps=1, tokens=1, codec="int8", body=scaled, wait=True)
        assert e.value.code == "nonfinite"
    # not even the island's ledger (last step) or its final fragments moved
    assert state_of(server) == before


def test_push_larger_than_its_fragment_is_refused(run):
    server, addr, a, b, recorded = run
    before = state_of(server)
    n = b.welcome.numels[1]
    big = np.zeros(n + 1, np.float32)
    with pytest.raises(ProtocolError, match=f"is {4 * n} bytes, got {4 * n + 4}"):  # the island's own check
        b.push(1, base_version=1, local_step=1, steps=1, tokens=1, codec="f32", body=big)
    for base in (1, 0):
        e = raw_push(b, push_meta(1, base, n), big)
        assert e.code == "bad-push" and f"must be {4 * n} bytes, got {4 * n + 4}" in e.message
    assert state_of(server) == before


def test_malformed_final_is_a_protocol_refusal(run, caplog):
    server, addr, a, b, _ = run
    before = state_of(server)
    b.conn.send(MsgType.FINAL, {"last_step": "many"})
    with pytest.raises(PeerError) as e:
        for _ in range(50):
            b.wait_event(0.2)
    assert e.value.code == "protocol" and "last_step" in e.value.message
    assert state_of(server) == before
    assert "Traceback" not in caplog.text


@contextlib.contextmanager
def raw_socket(addr):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    try:
        yield s
    finally:
        s.close()


def logged(caplog, text, timeout=5.0) -> bool:
    """Whether ``text`` is logged within ``timeout`` (the syncer shuts the socket before it logs why)."""
    deadline = time.monotonic() + timeout
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.02)
    return text in caplog.text


def chunk_frame(inner, total, data, msg_id=1):
    payload = struct.pack("<QHHQQ", msg_id, inner, 0, total, 0) + data
    return struct.pack("<4sHHIQQ", b"YETO", 1, MsgType.CHUNK, 0, len(payload),
                       xxhash.xxh3_64_intdigest(payload)) + payload


def manual_join(addr, recorded):
    """Island b's handshake by hand, up to its MANIFEST; returns (connection, SealedFrames for its next raw frames,
    which follow the MANIFEST in its sequence)."""
    from yeto_patch.wire import handshake
    conn = connect(addr, timeout=5, retries=0)
    _, ch, _ = conn.recv(timeout=5)
    # island b is connected: only its own session may take the id over (the proof its process would send)
    hello = handshake.IslandHello(ch, KEY, "b", recorded["incarnation"], DIGEST, resume=handshake._RESUME[(addr, "b")])
    conn.send(MsgType.HELLO, hello.meta)
    sess = hello.session()
    handshake._RESUME[(addr, "b")] = sess.resumption
    conn.protect(sess.c2s, sess.s2c, sess.encrypt)
    assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK
    frames = SealedFrames(sess.c2s, sess.encrypt)
    conn.sock.sendall(frames.message(MsgType.MANIFEST, manifest_meta(MANIFEST)))
    return conn, frames


def test_messages_larger_than_an_island_may_send_are_refused_from_their_header(run, caplog):
    server, addr, a, b, recorded = run
    before = state_of(server)
    caplog.set_level(logging.WARNING, "yeto")
    # before the handshake only a HELLO or PROBE may come, and no larger than a HELLO
    # (64 KiB): nor a MANIFEST of more, which only a peer whose HELLO passed may send
    for inner, total in ((MsgType.INIT, 1 << 30), (MsgType.PUSH, 1 << 34), (MsgType.HELLO, (64 << 10) + 1),
                         (MsgType.MANIFEST, (64 << 10) + 1)):
        with raw_socket(addr) as s:
            s.sendall(chunk_frame(inner, total, b"\0" * 1024))
            assert closed_by_syncer(s) < 3
        assert logged(caplog, f"{inner.name} message 1 announces {total} bytes, above the maximum")
    # after it, a PUSH or INIT is at most a whole fragment in its largest encoding (plus 1 MiB)
    limit = codecs.encoded_nbytes("int8", max(b.welcome.numels), 1) + (1 << 20)
    for total in (limit, limit + 1):
        conn, sealed = manual_join(addr, recorded)  # as island b again (its new connection replaces the old)
        assert conn.recv(timeout=5)[0] == MsgType.WELCOME
        conn.sock.sendall(sealed.chunk(1, MsgType.PUSH, total, 0, b"\0" * 1024))
        if total == limit:  # taken: the syncer waits for the rest of the message
            with pytest.raises(socket.timeout):
                closed_by_syncer(conn.sock, timeout=0.5)
        else:  # refused from the envelope (not after waiting, up to the io timeout, for the rest)
            assert closed_by_syncer(conn.sock) < 3
        conn.close()
    assert state_of(server) == before


def test_a_trickled_handshake_is_cut_off_at_the_handshake_timeout(run):
    server, addr, a, b, recorded = run
    server.cfg.handshake_timeout_s = 1.0  # (the io timeout stays 120 s: every byte below comes well within it)
    hello = pack_meta(recorded)
    frame = struct.pack("<4sHHIQQ", b"YETO", 1, MsgType.HELLO, 0, len(hello), xxhash.xxh3_64_intdigest(hello)) + hello
    with raw_socket(addr) as s:
        t0 = time.monotonic()
        s.settimeout(0.2)
        for i in range(len(frame)):
            try:
                s.sendall(frame[i:i + 1])
                if s.recv(1 << 16) == b"":
                    break
            except socket.timeout:
                pass
            except OSError:
                break
            if time.monotonic() - t0 > 10:
                break
        took = time.monotonic() - t0
    assert took < 4, f"an unauthenticated peer held its connection open for {took:.1f}s"


def test_strangers_cannot_hold_more_than_the_handshake_limit():
    """Connections that never finish their handshake are capped (per address and in all): more are closed at
    once, so strangers cannot make the syncer hold unbounded buffers and threads; islands get in once the
    strangers' handshake timeout ends."""
    server, addr = make_server(islands=1, fragments=2, max_handshakes=4, max_handshakes_per_host=2,
                               handshake_timeout_s=60.0)
    host, port = addr.rsplit(":", 1)
    with running(server):
        squat = [socket.create_connection((host, int(port))) for _ in range(2)]
        for s in squat:
            s.settimeout(5)
            assert s.recv(28)[:4] == b"YETO"   # each got its CHALLENGE and holds a handshake slot
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(5)
        assert extra.recv(100) == b""           # closed at once: over the per-address limit
        extra.close()
        c = client(addr, "a", connect_retries=0)
        with pytest.raises(ProtocolError):
            c.connect()
        for s in squat:
            s.close()
        time.sleep(0.5)
        c = client(addr, "a")
        w = c.connect()
        vals = init_values()
        c.wait_ready(10, init_source=lambda f: [vals[i] for i in w.layout[f]])
        c.close()
