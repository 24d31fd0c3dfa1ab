"""Frame protection (wire/secure.py) on real loopback connections: both modes deliver what was sent (single and
chunked frames, interleaved), and any altered, replayed, reordered, dropped or injected frame fails."""
import os
import socket
import struct
import threading

import numpy as np
import pytest

from yeto_patch.wire import secure, transport
from yeto_patch.wire.frames import FrameAuthError, FrameError, MsgType, PeerError

pytestmark = pytest.mark.timeout(60)
K1, K2 = os.urandom(32), os.urandom(32)


def _pair(chunk=64 << 10):
    ls = transport.listen("127.0.0.1:0")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("s", ls.accept()[0]))
    t.start()
    c = transport.connect("127.0.0.1:%d" % ls.getsockname()[1], timeout=5, retries=0, chunk_size=chunk)
    t.join(5)
    ls.close()
    return c, transport.Connection(box["s"], timeout=5, chunk_size=chunk)


@pytest.mark.parametrize("encrypt", [False, True])
def test_protected_messages_round_trip(encrypt):
    c, s = _pair()
    c.protect(K1, K2, encrypt)
    s.protect(K2, K1, encrypt)
    body = np.random.default_rng(0).integers(0, 255, 300_000, dtype=np.uint8).tobytes()   # chunked
    th = threading.Thread(target=lambda: [c.send(MsgType.PUSH, {"i": i}, body) for i in range(3)])
    th.start()
    c.send(MsgType.HEARTBEAT, {"step": 1})
    got = [s.recv(timeout=5) for _ in range(4)]
    th.join(10)
    assert sorted(m.get("i", -1) for _, m, _ in got) == [-1, 0, 1, 2]
    assert all(bytes(b) == body for t, m, b in got if t == MsgType.PUSH)
    s.send(MsgType.ERROR, {"code": "x", "message": "y"})
    with pytest.raises(PeerError):
        c.recv(timeout=5)
    assert c.protection == ("aead" if encrypt else "mac")
    c.close()
    s.close()


def _capture_frames(encrypt, n=3):
    """Raw bytes of ``n`` frames a protected sender writes (single-frame HEARTBEATs)."""
    a, b = socket.socketpair()
    conn = transport.Connection(a, timeout=5)
    conn.protect(K1, K2, encrypt)
    frames = []
    for i in range(n):
        conn.send(MsgType.HEARTBEAT, {"step": i, "pad": "secret" * 10})
        hdr = b.recv(28, socket.MSG_WAITALL)
        length = struct.unpack_from("<Q", hdr, 12)[0]
        frames.append(hdr + b.recv(length + 16, socket.MSG_WAITALL))
    conn.close()
    b.close()
    return frames


def _deliver(raw: bytes, encrypt, clear_error_first=False):
    a, b = socket.socketpair()
    conn = transport.Connection(b, timeout=2)
    conn.protect(K2, K1, encrypt, clear_error_first=clear_error_first)
    a.sendall(raw)
    a.shutdown(socket.SHUT_WR)
    out = []
    try:
        while True:
            out.append(conn.recv(timeout=2)[1])
    except FrameAuthError as e:
        out.append(e)
    except Exception as e:  # noqa: BLE001 - the end of the stream
        out.append(e)
    a.close()
    conn.close()
    return out


@pytest.mark.parametrize("encrypt", [False, True])
def test_any_change_to_the_frame_sequence_is_detected(encrypt):
    f = _capture_frames(encrypt)
    ok = _deliver(b"".join(f), encrypt)
    assert [m["step"] for m in ok[:3]] == [0, 1, 2]
    assert (b"secret" in f[0]) is (not encrypt)
    flipped = bytearray(f[1])
    flipped[40] ^= 1
    bad_header = bytearray(f[1])
    bad_header[8] |= 4   # an unknown flag bit is authenticated too
    for name, stream in {"altered": f[0] + bytes(flipped) + f[2], "replayed": f[0] + f[0] + f[1],
                         "reordered": f[0] + f[2] + f[1], "dropped": f[0] + f[2],
                         "header": f[0] + bytes(bad_header), "truncated tag": f[0] + f[1][:-1]}.items():
        out = _deliver(stream, encrypt)
        assert out[0]["step"] == 0, name
        if name == "truncated tag":
            assert "closed the connection" in str(out[1])
        else:
            assert isinstance(out[1], FrameAuthError) and "frame authentication failed" in str(out[1]), (name, out)


def test_unprotected_frames_are_refused_once_protection_is_on():
    from yeto_patch.wire.message import pack_meta
    import xxhash
    p = pack_meta({"code": "auth", "message": "refused"})
    clear_error = struct.pack("<4sHHIQQ", b"YETO", 1, MsgType.ERROR, 0, len(p), xxhash.xxh3_64_intdigest(p)) + p
    p2 = pack_meta({"last_step": 1})
    clear_final = struct.pack("<4sHHIQQ", b"YETO", 1, MsgType.FINAL, 0, len(p2), xxhash.xxh3_64_intdigest(p2)) + p2
    out = _deliver(clear_final, False)
    assert isinstance(out[0], FrameAuthError) and "not authenticated" in str(out[0])
    out = _deliver(clear_error, False, clear_error_first=True)   # a refusal sent before the peer switched
    assert isinstance(out[0], PeerError) and out[0].code == "auth"
    out = _deliver(clear_error + clear_error, False, clear_error_first=False)
    assert isinstance(out[0], FrameAuthError)


def test_keys_depend_on_every_handshake_input():
    ch = {"nonce": "00" * 32, "protocol": 3, "auth": True, "frames": "mac", "ephemeral": "01" * 32}
    hello = {"island_id": "a", "incarnation": 1, "nonce": "11" * 32, "ephemeral": "22" * 32, "mac": "ff"}
    dh = b"\3" * 32
    base = secure.derive_keys(K1, dh, "mac", secure.transcript(ch, hello))
    assert base[0] != base[1]
    variants = [secure.derive_keys(K2, dh, "mac", secure.transcript(ch, hello)),
                secure.derive_keys(K1, b"\4" * 32, "mac", secure.transcript(ch, hello)),
                secure.derive_keys(K1, dh, "aead", secure.transcript(ch, hello)),
                secure.derive_keys(K1, dh, "mac", secure.transcript(dict(ch, frames="aead"), hello)),
                secure.derive_keys(K1, dh, "mac", secure.transcript(dict(ch, ephemeral="05" * 32), hello)),
                secure.derive_keys(K1, dh, "mac", secure.transcript(ch, dict(hello, held=["0" * 16])))]
    assert all(v != base for v in variants)
    assert secure.derive_resumption(K1, dh, secure.transcript(ch, hello)) not in base
    # the MAC field itself is not part of the transcript (it is checked on its own)
    assert secure.transcript(ch, hello) == secure.transcript(ch, dict(hello, mac="00"))
    with pytest.raises(ValueError):
        secure.derive_keys(K1, dh, "none", b"")
    with pytest.raises(FrameError):   # a protected frame where no keys were agreed
        a, b = socket.socketpair()
        conn = transport.Connection(b, timeout=2)
        a.sendall(_capture_frames(False, 1)[0])
        try:
            conn.recv(timeout=2)
        finally:
            a.close()
            conn.close()
