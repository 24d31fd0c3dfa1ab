"""The benchmark runs and its independent naive implementations agree bit for bit with the codecs; the
documented handshake works over real sockets and refuses wrong keys and replays."""
import importlib.util
import os
import threading

import pytest

from yeto_patch.wire import transport
from yeto_patch.wire.frames import AuthError, MsgType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_benchmark_smoke_and_naive_references_agree(capsys):
    spec = importlib.util.spec_from_file_location("wire_codecs_bench", os.path.join(ROOT, "benchmarks",
                                                                                    "wire_codecs.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # odd size: a partial last block and an odd nibble count
    rc = bench.main(["--mib", "0.37", "--repeat", "1", "--block", "256"])
    out = capsys.readouterr().out
    assert rc == 0, out  # non-zero when a naive encoding/decoding differs from the codec's
    assert "differs" not in out
    for codec in ("f32", "bf16", "int8", "int4", "int4-log"):
        assert f"\n{codec} " in out
    assert "xxh3_64 digest" in out and "targets" in out


@pytest.mark.timeout(120)
def test_security_benchmark_smoke(capsys):
    """benchmarks/wire_security.py runs (its frame keys come from real protocol-3 handshakes) and reports the
    handshake's cost."""
    spec = importlib.util.spec_from_file_location("wire_security_bench", os.path.join(ROOT, "benchmarks",
                                                                                      "wire_security.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--mib", "1", "--repeat", "1", "--handshakes", "3"]) == 0
    out = capsys.readouterr().out
    assert "PUSH     aead" in out and "handshake (protocol 3)" in out, out


# ------------------------------------------------------------------------------------ handshake (docs)
KEY = b"s" * 32


def _hkdf(key, dh, info, n):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=n, salt=key, info=info).derive(dh)


def _doc_syncer(ls, key, box, wrong_dh=False):
    """A syncer written from docs/protocol.md ("Authentication", protocol 3) with cryptography's primitives only:
    it answers one PROBE with a protected WELCOME, or refuses a HELLO whose MAC does not verify."""
    import hashlib
    import hmac
    import json

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    def canon(m):
        return json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    conn = transport.Connection(ls.accept()[0], timeout=5)
    try:
        e = X25519PrivateKey.generate()
        ch = {"nonce": os.urandom(32).hex(), "protocol": 3, "auth": True, "frames": "mac",
              "ephemeral": e.public_key().public_bytes_raw().hex()}
        conn.send(MsgType.CHALLENGE, ch)
        _, hello, _ = conn.recv()
        th = hashlib.sha256(canon(ch) + b"\0" + canon({k: v for k, v in hello.items() if k != "mac"})).digest()
        want = hmac.new(key, b"yeto-patch hello v3\0" + th, hashlib.sha256).digest()
        if not hmac.compare_digest(want, bytes.fromhex(hello["mac"])):
            conn.send_error("auth", "HELLO refused: authentication code mismatch (wrong key, or an altered or "
                                    "replayed handshake)")
            box["refused"] = True
            return
        box["hello"] = hello
        dh = e.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(hello["ephemeral"])))
        if wrong_dh:
            dh = os.urandom(32)
        okm = _hkdf(key, dh, b"yeto-patch frames v3\0mac\0" + th, 64)
        conn.protect(okm[32:], okm[:32], False)
        conn.send(MsgType.WELCOME, {"probe": True, "run_id": "doc-run", "initialized": False})
    finally:
        conn.close()


def _run(key_syncer, island_fn, wrong_dh=False):
    ls = transport.listen("127.0.0.1:0")
    box = {}
    th = threading.Thread(target=_doc_syncer, args=(ls, key_syncer, box, wrong_dh))
    th.start()
    try:
        return island_fn(f"127.0.0.1:{ls.getsockname()[1]}"), box
    finally:
        th.join(10)
        ls.close()


@pytest.mark.timeout(60)
def test_handshake_over_sockets():
    """The island's handshake (wire/handshake.py) against a syncer written from the documentation."""
    from yeto_patch.wire import client
    from yeto_patch.wire.frames import UnverifiedRefusal
    status, box = _run(KEY, lambda addr: client.probe(addr, KEY, island_id="island-a"))
    assert box["hello"]["island_id"] == "island-a" and status["run_id"] == "doc-run" and status["probe"]
    # wrong key: the syncer refuses in the clear; nothing authenticated it, so it is transient for the island
    with pytest.raises(UnverifiedRefusal, match="auth") as e:
        _run(KEY, lambda addr: client.probe(addr, b"w" * 32))
    assert client.recoverable(e.value) and not e.value.sealed
    # a syncer whose session keys are not the island's (a relay that swapped the ephemeral key, say): its first
    # protected frame fails, and that too is transient
    with pytest.raises(AuthError, match="WELCOME failed authentication") as e:
        _run(KEY, lambda addr: client.probe(addr, KEY), wrong_dh=True)
    assert client.recoverable(e.value)
