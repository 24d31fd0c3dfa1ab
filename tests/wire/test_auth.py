"""Authentication: key loading, the HELLO's MAC and the session keys of protocol 3, replay/alteration refusal,
keyless policy."""
import os

import pytest

from yeto_patch.wire import auth, secure
from yeto_patch.wire.frames import AuthError
from yeto_patch.wire.handshake import IslandHello

KEY = b"k" * 32
MD = auth.manifest_digest([("embedding.word_embeddings.weight", (128, 64), "float32"),
                           ("decoder.layers.0.mlp.linear_fc1.weight", (256, 64), "float32")])


def test_key_from_file(tmp_path, monkeypatch):
    monkeypatch.delenv("YETO_KEY", raising=False)
    p = tmp_path / "key"
    p.write_bytes(b"0123456789abcdef0123\n")
    os.chmod(p, 0o600)
    assert auth.load_key(str(p)) == b"0123456789abcdef0123"
    os.chmod(p, 0o400)
    assert auth.load_key(str(p)) == b"0123456789abcdef0123"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o620])
def test_key_file_mode_refused(tmp_path, mode):
    p = tmp_path / "key"
    p.write_bytes(b"0123456789abcdef0123")
    os.chmod(p, mode)
    with pytest.raises(AuthError, match=rf"accessible by group/others \(mode {mode:04o}\).*chmod 600"):
        auth.load_key(str(p))


def test_key_refusals(tmp_path, monkeypatch):
    with pytest.raises(AuthError, match="cannot read key file"):
        auth.load_key(str(tmp_path / "missing"))
    with pytest.raises(AuthError, match="not a regular file"):
        auth.load_key(str(tmp_path))
    p = tmp_path / "short"
    p.write_bytes(b"short")
    os.chmod(p, 0o600)
    with pytest.raises(AuthError, match="at least 16"):
        auth.load_key(str(p))
    monkeypatch.setenv("YETO_KEY", "  abcdefghijklmnopqrstuvwxyz  ")
    assert auth.load_key() == b"abcdefghijklmnopqrstuvwxyz"
    monkeypatch.setenv("YETO_KEY", "tiny")
    with pytest.raises(AuthError, match="YETO_KEY"):
        auth.load_key()
    monkeypatch.setenv("YETO_KEY", "")
    assert auth.load_key() is None
    monkeypatch.delenv("YETO_KEY")
    assert auth.load_key() is None


def test_manifest_digest_canonical():
    m = [("a", (2, 3), "float32"), ("b", (), "bfloat16")]
    d = auth.manifest_digest(m)
    assert len(d) == 32 and d == auth.manifest_digest([("a", [2, 3], "float32"), ("b", (), "bfloat16")])
    assert d != auth.manifest_digest([("a", (3, 2), "float32"), ("b", (), "bfloat16")])
    assert d != auth.manifest_digest([("b", (), "bfloat16"), ("a", (2, 3), "float32")])
    assert d != auth.manifest_digest([("a", (2, 3), "float16"), ("b", (), "bfloat16")])
    # length-prefixed: moving a character between name and dtype changes the digest
    assert auth.manifest_digest([("ab", (1,), "c")]) != auth.manifest_digest([("a", (1,), "bc")])
    # golden: the canonical encoding must not drift
    assert auth.manifest_digest([("w", (2, 3), "float32")]).hex() == GOLDEN_MANIFEST
    with pytest.raises(AuthError):
        auth.manifest_digest([("a", (-1,), "float32")])
    with pytest.raises(AuthError):
        auth.manifest_digest([("a",)])


GOLDEN_MANIFEST = __import__("hashlib").sha256(
    b"yeto-manifest v1\0" + bytes.fromhex("01000000" "01000000") + b"w" + bytes.fromhex(
        "02000000" "0200000000000000" "0300000000000000" "07000000") + b"float32").hexdigest()


def _pair(key_island=KEY, key_syncer=KEY, resume=None, **fields):
    """Both halves of a handshake as documented (protocol 3): the syncer's CHALLENGE with its ephemeral key, the
    island's HELLO (IslandHello), the syncer's MAC check and both sides' session keys."""
    e_s = secure.Ephemeral()
    ch = {"nonce": auth.new_nonce().hex(), "protocol": 3, "auth": True, "frames": "mac", "ephemeral": e_s.public.hex()}
    hello = IslandHello(ch, key_island, "island-a", 3, MD, resume=resume, **fields)
    th = secure.transcript(ch, hello.meta)
    auth.verify(secure.hello_mac(key_syncer, th), bytes.fromhex(hello.meta["mac"]), "HELLO")
    syncer = secure.SessionKeys(key_syncer, e_s.shared(bytes.fromhex(hello.meta["ephemeral"])), "mac", th)
    return ch, hello, syncer


def test_handshake_ok_and_wrong_key():
    ch, hello, syncer = _pair()
    island = hello.session()
    assert (island.c2s, island.s2c, island.resumption) == (syncer.c2s, syncer.s2c, syncer.resumption)
    assert len({island.c2s, island.s2c, island.resumption}) == 3
    with pytest.raises(AuthError, match="HELLO refused"):
        _pair(key_syncer=b"x" * 32)


def test_replayed_hello_refused():
    ch, hello, _ = _pair()
    fresh = dict(ch, nonce=auth.new_nonce().hex(), ephemeral=secure.Ephemeral().public.hex())   # a new connection
    with pytest.raises(AuthError, match="replayed"):
        auth.verify(secure.hello_mac(KEY, secure.transcript(fresh, hello.meta)), bytes.fromhex(hello.meta["mac"]),
                    "HELLO")


@pytest.mark.parametrize("field,value", [("island_id", "island-b"), ("incarnation", 4), ("manifest_digest", "00" * 32),
                                         ("nonce", "11" * 32), ("ephemeral", "22" * 32), ("resume", "33" * 32),
                                         ("protocol", 2)])
def test_altered_hello_refused(field, value):
    ch, hello, _ = _pair()
    altered = dict(hello.meta, **{field: value})
    with pytest.raises(AuthError):
        auth.verify(secure.hello_mac(KEY, secure.transcript(ch, altered)), bytes.fromhex(hello.meta["mac"]))
    with pytest.raises(AuthError):   # a CHALLENGE altered on the way (frames offered, nonce, ephemeral) as well
        auth.verify(secure.hello_mac(KEY, secure.transcript(dict(ch, frames="aead"), hello.meta)),
                    bytes.fromhex(hello.meta["mac"]))


def test_session_keys_need_an_ephemeral_private_key():
    """What a key holder who recorded the handshake can compute (the key, both nonces, both public ephemeral keys,
    the transcript) does not give the session: every derivation takes the X25519 result as input."""
    ch, hello, syncer = _pair()
    th = secure.transcript(ch, hello.meta)
    public = [bytes.fromhex(ch["ephemeral"]), bytes.fromhex(hello.meta["ephemeral"]), bytes.fromhex(ch["nonce"]),
              bytes.fromhex(hello.meta["nonce"]), bytes(32)]
    for guess in public:
        assert secure.SessionKeys(KEY, guess, "mac", th).resumption != syncer.resumption
        assert secure.derive_keys(KEY, guess, "mac", th) != (syncer.c2s, syncer.s2c)
    # a resumption proof is bound to the handshake it is sent in
    ch2, hello2, _ = _pair(resume=syncer.resumption)
    proof = secure.resumption_proof(syncer.resumption, bytes.fromhex(ch2["nonce"]), bytes.fromhex(hello2.meta["nonce"]),
                                    bytes.fromhex(ch2["ephemeral"]), bytes.fromhex(hello2.meta["ephemeral"]), "island-a")
    assert hello2.meta["resume"] == proof.hex()
    assert secure.resumption_proof(syncer.resumption, bytes.fromhex(ch["nonce"]), bytes.fromhex(hello2.meta["nonce"]),
                                   bytes.fromhex(ch2["ephemeral"]), bytes.fromhex(hello2.meta["ephemeral"]),
                                   "island-a") != proof


def test_mac_golden_and_input_checks():
    import hashlib
    import hmac
    ch = {"nonce": "00" * 32, "protocol": 3, "auth": True, "frames": "mac", "ephemeral": "01" * 32}
    hello = {"island_id": "is", "incarnation": 5, "mac": "ff"}
    th = hashlib.sha256(b'{"auth":true,"ephemeral":"' + b"01" * 32 + b'","frames":"mac","nonce":"' + b"00" * 32
                        + b'","protocol":3}\0{"incarnation":5,"island_id":"is"}').digest()
    assert secure.transcript(ch, hello) == th
    assert secure.hello_mac(KEY, th) == hmac.new(KEY, b"yeto-patch hello v3\0" + th, hashlib.sha256).digest()
    e = secure.Ephemeral()
    for bad in (b"short", bytes(32), b"\1" + bytes(31)):   # malformed and low-order keys give no secret
        with pytest.raises(ValueError):
            e.shared(bad)
    with pytest.raises(AuthError):
        auth.verify(b"a" * 32, "not bytes")
    assert len(auth.new_nonce()) == 32 and auth.new_nonce() != auth.new_nonce()


@pytest.mark.parametrize("addr,loop", [("127.0.0.1:5000", True), ("127.3.4.5:1", True), ("localhost:9", True),
                                       ("[::1]:5000", True), ("::1", True), ("10.0.0.1:5000", False),
                                       ("0.0.0.0:5000", False), ("syncer.example.com:5000", False),
                                       ("[2001:db8::1]:80", False)])
def test_loopback_and_insecure_policy(addr, loop):
    assert auth.is_loopback(addr) is loop
    with pytest.raises(AuthError, match="no key configured"):
        auth.check_insecure(addr, False)
    if loop:
        auth.check_insecure(addr, True)
    else:
        with pytest.raises(AuthError, match="non-loopback"):
            auth.check_insecure(addr, True)
