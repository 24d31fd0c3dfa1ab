"""Authentication: key loading, MACs, replay/alteration refusal, keyless policy."""
import os

import pytest

from yeto_patch.wire import auth
from yeto_patch.wire.frames import AuthError

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


def _handshake(key_c, key_s, *, island="island-a", inc=3, md_c=MD, md_s=MD, server_nonce=None):
    """Run the MAC exchange as both sides would; returns after the client verified the server."""
    sn = server_nonce or auth.new_nonce()  # CHALLENGE
    cn = auth.new_nonce()
    hello_mac = auth.client_mac(key_c, sn, cn, island, inc, md_c)  # HELLO
    auth.verify(auth.client_mac(key_s, sn, cn, island, inc, md_s), hello_mac, "HELLO")  # server side
    welcome_mac = auth.server_mac(key_s, sn, cn, island, inc, md_s)  # WELCOME
    auth.verify(auth.server_mac(key_c, sn, cn, island, inc, md_c), welcome_mac, "WELCOME")
    return sn, cn, hello_mac


def test_handshake_ok_and_wrong_key():
    _handshake(KEY, KEY)
    with pytest.raises(AuthError, match="HELLO refused"):
        _handshake(KEY, b"x" * 32)
    with pytest.raises(AuthError):
        _handshake(KEY, KEY, md_c=auth.manifest_digest([("other", (1,), "float32")]))


def test_replayed_hello_refused():
    sn, cn, hello_mac = _handshake(KEY, KEY)
    fresh_sn = auth.new_nonce()  # the server's next connection has a new nonce
    assert fresh_sn != sn
    with pytest.raises(AuthError, match="replayed"):
        auth.verify(auth.client_mac(KEY, fresh_sn, cn, "island-a", 3, MD), hello_mac, "HELLO")


@pytest.mark.parametrize("field", ["island", "inc", "md", "cn", "sn"])
def test_altered_hello_refused(field):
    sn, cn = auth.new_nonce(), auth.new_nonce()
    mac = auth.client_mac(KEY, sn, cn, "island-a", 3, MD)
    args = dict(server_nonce=sn, client_nonce=cn, island_id="island-a", incarnation=3, manifest_digest=MD)
    alt = {"island": ("island_id", "island-b"), "inc": ("incarnation", 4),
           "md": ("manifest_digest", bytes(32)), "cn": ("client_nonce", auth.new_nonce()),
           "sn": ("server_nonce", auth.new_nonce())}[field]
    args[alt[0]] = alt[1]
    with pytest.raises(AuthError):
        auth.verify(auth.client_mac(KEY, **args), mac)


def test_client_and_server_macs_differ_no_reflection():
    sn, cn = auth.new_nonce(), auth.new_nonce()
    assert auth.client_mac(KEY, sn, cn, "i", 0, MD) != auth.server_mac(KEY, sn, cn, "i", 0, MD)
    with pytest.raises(AuthError):
        auth.verify(auth.server_mac(KEY, sn, cn, "i", 0, MD), auth.client_mac(KEY, sn, cn, "i", 0, MD))


def test_mac_golden_and_input_checks():
    sn, cn = bytes(range(32)), bytes(range(32, 64))
    msg = auth.mac_message(auth.CLIENT_LABEL, sn, cn, "is", 5, bytes(32))
    assert msg == (b"yeto-patch client v1\0" + b"\x01\x00" + sn + cn + b"\x02\x00\x00\x00is" +
                   (5).to_bytes(8, "little") + bytes(32))
    for bad in (dict(server_nonce=b"short"), dict(client_nonce=b""), dict(manifest_digest=b"x" * 31),
                dict(incarnation=-1), dict(incarnation=1 << 64)):
        kw = dict(server_nonce=sn, client_nonce=cn, island_id="i", incarnation=0, manifest_digest=MD)
        kw.update(bad)
        with pytest.raises(AuthError):
            auth.client_mac(KEY, **kw)
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
