"""One island cannot speak for another (issue #13): with per-island keys an id can only be claimed with its own
key; with the shared key a connected id can be claimed again only by its own session (the resumption secret
both sides derived at its handshake), or once that connection is gone; reconnects and restarts keep working."""
import time

import numpy as np
import pytest

from yeto_patch.wire import codecs
from yeto_patch.wire.frames import PeerError

from .helpers import KEY, client, init_values, make_server, running

pytestmark = pytest.mark.timeout(60)
VALUES = init_values()
KA, KB = b"a" * 32, b"b" * 32


def _other_process(addr):
    """The same syncer under another address: a client there holds no resumption secret of this process's
    sessions, as another process (or another key holder) would."""
    return "localhost:" + addr.rsplit(":", 1)[1]


def _ready(c):
    w = c.connect()
    c.wait_ready(20, init_source=lambda f: [VALUES[i] for i in w.layout[f]])
    return w


def test_a_connected_island_id_cannot_be_taken_over_with_the_shared_key():
    server, addr = make_server(islands=2, fragments=1, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a")
        w = _ready(a)
        eve = client(_other_process(addr), "a", connect_retries=0)
        with pytest.raises(PeerError) as e:
            eve.connect()
        assert e.value.code == "island-taken" and "resumption" in e.value.message
        assert server.sessions["a"].conn is a.conn or not server.sessions["a"].closed
        r = a.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.zeros(w.numels[0], np.float32)), wait=True)
        assert r.status == "accepted"   # the real island is undisturbed
        a.close()


def test_the_same_session_reconnects_while_its_old_connection_is_still_open():
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a")
        _ready(a)
        old = server.sessions["a"]
        # the link is cut without the syncer noticing (no FIN): the old connection stays open on its side
        a2 = client(addr, "a", incarnation=a.incarnation)
        a2.connect()
        a2.wait_ready(20)
        assert server.sessions["a"] is not old
        deadline = time.monotonic() + 5
        while not old.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert old.closed   # replaced
        a2.close()
        a.abort()


def test_a_restarted_island_joins_once_its_old_connection_is_gone():
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a")
        _ready(a)
        a.abort()   # the process died: its socket closes, the secret is lost with it
        deadline = time.monotonic() + 10
        while True:
            r = client(_other_process(addr), "a", connect_retries=0)   # new incarnation, no secret
            try:
                r.connect()
                break
            except PeerError as e:
                assert e.code == "island-taken"
                assert time.monotonic() < deadline, "the restarted island was never let in"
                time.sleep(0.1)
        r.wait_ready(20)
        r.close()


def test_per_island_keys():
    server, addr = make_server(islands=3, fragments=1, key=None, island_keys={"a": KA, "b": KB},
                               rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a", key=KA)
        w = _ready(a)
        for island, key in (("b", KA), ("a", KB), ("c", KA), ("c", KEY)):
            with pytest.raises(PeerError) as e:
                client(addr, island, key=key, connect_retries=0).connect()
            assert e.value.code == "auth", (island, e.value)
        b = client(addr, "b", key=KB)
        b.connect()
        b.wait_ready(20)
        r = b.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.zeros(w.numels[0], np.float32)), wait=True)
        assert r.status == "accepted"
        a.close()
        b.close()


def test_island_key_directory(tmp_path):
    from yeto_patch.syncer import cli
    from yeto_patch.wire import auth
    from yeto_patch.wire.frames import AuthError
    for name, key in (("a.key", KA), ("b.key", KB), ("notes.txt", b"ignored")):
        p = tmp_path / name
        p.write_bytes(key + b"\n")
        p.chmod(0o600)
    assert auth.load_island_keys(str(tmp_path)) == {"a": KA, "b": KB}
    cfg = cli.config_from_args(cli.build_parser().parse_args(["--island-keys", str(tmp_path), "--listen",
                                                              "0.0.0.0:0", "--encrypt"]))
    assert cfg.island_keys == {"a": KA, "b": KB} and cfg.encrypt
    (tmp_path / "b.key").chmod(0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        auth.load_island_keys(str(tmp_path))
    with pytest.raises(AuthError, match="cannot read the island key directory"):
        auth.load_island_keys(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AuthError, match="no <island id>.key"):
        auth.load_island_keys(str(tmp_path / "empty"))


def _hkdf(salt, ikm, info, n):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=n, salt=salt, info=info).derive(ikm)


def _canon(meta):
    import json
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _key_holder_guesses(challenge, hello, label, n):
    """Every secret a holder of the shared key can compute from a recorded handshake: the derivations of protocol
    2 (the key, the nonces and the transcript) and of protocol 3 with each public value in place of the X25519
    result it does not have."""
    import hashlib
    th = hashlib.sha256(_canon(challenge) + b"\0" + _canon({k: v for k, v in hello.items() if k != "mac"})).digest()
    sn, cn = bytes.fromhex(challenge["nonce"]), bytes.fromhex(hello["nonce"])
    out = [_hkdf(sn + cn, KEY, label(1) + th, n)]
    for public in (challenge.get("ephemeral"), hello.get("ephemeral"), challenge["nonce"], hello["nonce"]):
        if public:
            out.append(_hkdf(KEY, bytes.fromhex(public), label(3) + th, n))
    return out


def test_a_key_holder_that_recorded_a_handshake_can_neither_resume_it_nor_read_its_traffic():
    """Issue 26, finding 1: under the shared key a passive key holder X recorded island L1's whole handshake and
    its encrypted PUSH. X cannot take over L1's connection with a resumption proof made from the recording (L1 stays
    connected and keeps pushing), and cannot decrypt the PUSH: the session keys come from an ephemeral key
    exchange (docs/protocol.md, Authentication)."""
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from yeto_patch.wire import handshake
    from yeto_patch.wire.message import unpack

    from .relay import FrameRelay
    server, addr = make_server(islands=2, fragments=1, encrypt=True, rounds={"quorum": 2, "grace_s": 0.0})
    tape = []

    def record(way, idx, n, hdr, rest):
        tape.append((way, idx, n, hdr, rest))
        return [hdr + rest]
    with running(server):
        relay = FrameRelay(int(addr.rsplit(":", 1)[1]), record)
        l1 = client(relay.address, "L1")
        w = _ready(l1)
        delta = (np.arange(w.numels[0], dtype=np.float32) % 97 + 1) * np.float32(1e-3)
        body = codecs.encode("f32", delta)
        r = l1.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32", body=body, wait=True)
        assert r.status == "accepted"
        challenge = dict(unpack(memoryview(tape[[t[:3] for t in tape].index(("down", 0, 0))][4]))[0])
        hello = dict(unpack(memoryview(tape[[t[:3] for t in tape].index(("up", 0, 0))][4]))[0])
        up = [(hdr, rest) for way, idx, n, hdr, rest in tape if way == "up" and idx == 0 and n > 0]
        assert body.tobytes()[:256] not in b"".join(rest for _, rest in up)   # encrypted on the wire

        # 1. resume as L1 with each secret the recording gives a key holder (as a client of another process)
        for guess in _key_holder_guesses(challenge, hello, lambda v: b"yeto-patch resume v%d\0" % v, 32):
            with handshake._RESUME_LOCK:
                handshake._RESUME[(_other_process(addr), "L1")] = guess
            x = client(_other_process(addr), "L1", incarnation=l1.incarnation, connect_retries=0)
            with pytest.raises(PeerError) as e:
                x.connect()
            assert e.value.code == "island-taken", e.value
        assert server.sessions["L1"].conn is not None and not server.sessions["L1"].closed
        l1.check()   # L1's link is undisturbed

        # 2. decrypt L1's frames (its PUSH among them) with each frame key the recording gives a key holder
        for guess in _key_holder_guesses(challenge, hello, lambda v: b"yeto-patch frames v%d\0aead\0" % v, 64):
            aead = AESGCM(guess[:32])
            for seq, (hdr, rest) in enumerate(up):
                with pytest.raises(Exception):   # InvalidTag: not the key L1 sealed with
                    aead.decrypt(struct.pack("<IQ", 0, seq), rest, hdr)
        l1.close()
        relay.close()
