"""The benchmark runs and its independent naive implementations agree bit for bit with the codecs; the
documented handshake works over real sockets and refuses wrong keys and replays."""
import importlib.util
import os
import threading

import pytest

from yeto_patch.wire import auth, transport
from yeto_patch.wire.frames import AuthError, MsgType, PeerError

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


# ------------------------------------------------------------------------------------ handshake (docs)
KEY = b"s" * 32
MANIFEST = [("decoder.layers.0.self_attention.linear_qkv.weight", (96, 32), "float32")]


def _server(ls, key, box, nonce=None):
    conn = transport.Connection(ls.accept()[0], timeout=5)
    try:
        sn = nonce or auth.new_nonce()
        conn.send(MsgType.CHALLENGE, {"nonce": sn.hex(), "protocol": 2})
        _, hello, _ = conn.recv()
        args = (sn, bytes.fromhex(hello["nonce"]), hello["island"], hello["incarnation"],
                bytes.fromhex(hello["manifest_digest"]))
        try:
            auth.verify(auth.client_mac(key, *args), bytes.fromhex(hello["mac"]), "HELLO")
        except AuthError as e:
            conn.send_error("auth", str(e))
            box["refused"] = str(e)
            return
        box["hello"] = hello
        conn.send(MsgType.WELCOME, {"mac": auth.server_mac(key, *args).hex()})
    finally:
        conn.close()


def _client(port, key, island="island-a", incarnation=1, record=None):
    conn = transport.connect(f"127.0.0.1:{port}", timeout=5, retries=2, backoff=0.05)
    try:
        _, ch, _ = conn.recv()
        sn, cn, md = bytes.fromhex(ch["nonce"]), auth.new_nonce(), auth.manifest_digest(MANIFEST)
        hello = {"island": island, "incarnation": incarnation, "nonce": cn.hex(), "manifest_digest": md.hex(),
                 "mac": auth.client_mac(key, sn, cn, island, incarnation, md).hex()}
        if record is not None:
            hello = record  # replay an earlier HELLO verbatim
        conn.send(MsgType.HELLO, hello)
        _, welcome, _ = conn.recv()
        auth.verify(auth.server_mac(key, sn, cn, island, incarnation, md), bytes.fromhex(welcome["mac"]),
                    "WELCOME")
        return hello
    finally:
        conn.close()


def _run(key_server, client_fn):
    ls = transport.listen("127.0.0.1:0")
    box = {}
    th = threading.Thread(target=_server, args=(ls, key_server, box))
    th.start()
    try:
        return client_fn(ls.getsockname()[1]), box
    finally:
        th.join(10)
        ls.close()


@pytest.mark.timeout(60)
def test_handshake_over_sockets():
    hello, box = _run(KEY, lambda port: _client(port, KEY))
    assert box["hello"]["island"] == "island-a"
    # wrong key: the server refuses with an ERROR the client sees as PeerError
    with pytest.raises(PeerError, match="auth"):
        _run(KEY, lambda port: _client(port, b"w" * 32))
    # a recorded HELLO replayed on a new connection (new server nonce) is refused
    with pytest.raises(PeerError, match="replayed"):
        _run(KEY, lambda port: _client(port, KEY, record=hello))
