"""What strangers and key holders send is never logged raw and never crashes the handshake (issue #13, bugs 3
and 5): island ids that are not printable UTF-8 are refused at HELLO with a clear ERROR; ERROR frames and
framing garbage from unauthenticated peers are logged escaped, truncated and rate-limited."""
import json
import logging
import time

import pytest
import xxhash

from yeto_patch.wire import auth, frames
from yeto_patch.wire.frames import MsgType, PeerError
from yeto_patch.wire.message import META_LEN
from yeto_patch.wire.text import check_island_id, printable
from yeto_patch.wire.transport import connect

from .helpers import KEY, MANIFEST, make_server, running

pytestmark = pytest.mark.timeout(60)
DIGEST = auth.manifest_digest(MANIFEST)
BAD_IDS = ["\ud800", "a\udfffb", "line1\nINFO forged", "cr\rx", "\x1b[31mred", "nul\x00", "bidi\u202etxe", "tab\t"]


def raw_frame(msg_type, meta: dict) -> bytes:
    """A frame whose JSON is ASCII with \\u escapes (so lone surrogates survive, as a hostile peer sends them)."""
    raw = json.dumps(meta).encode("ascii")
    payload = META_LEN.pack(len(raw)) + raw
    return frames.encode_header(msg_type, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def hello_with(addr, island, key=KEY):
    conn = connect(addr, timeout=5, retries=0)
    try:
        _, ch, _ = conn.recv(timeout=5)
        nonce = auth.new_nonce()
        meta = {"island_id": island, "incarnation": 7, "nonce": nonce.hex(), "manifest_digest": DIGEST.hex(),
                "mac": "00" * 32, "insecure": key is None, "protocol": 3, "ephemeral": "00" * 32}
        conn.sock.sendall(raw_frame(MsgType.HELLO, meta))
        with pytest.raises(PeerError) as e:
            conn.recv(timeout=5)
        return e.value
    finally:
        conn.close()


class _Trap(logging.Handler):
    """Records what reaches a handler, and whether formatting/writing it failed (as a --log file would)."""

    def __init__(self):
        super().__init__()
        self.lines, self.errors = [], 0

    def emit(self, record):
        try:
            line = self.format(record)
            line.encode("utf-8")   # what a FileHandler does with it
            self.lines.append(line)
        except Exception:  # noqa: BLE001
            self.handleError(record)

    def handleError(self, record):
        self.errors += 1


@pytest.fixture
def trap():
    h = _Trap()
    lg = logging.getLogger("yeto")
    old = lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(h)
    yield h
    lg.removeHandler(h)
    lg.setLevel(old)


@pytest.mark.parametrize("keyed", [True, False])
def test_island_ids_that_are_not_printable_utf8_are_refused_at_hello(trap, keyed):
    server, addr = make_server(islands=2, fragments=1, key=KEY if keyed else None)
    with running(server):
        for bad in BAD_IDS:
            e = hello_with(addr, bad, key=KEY if keyed else None)
            assert e.code == "protocol" and "island_id" in e.message, (bad, e)
        time.sleep(0.2)
    assert trap.errors == 0
    assert not [ln for ln in trap.lines if "internal" in ln or "Traceback" in ln]
    for ln in trap.lines:   # nothing a peer sent reaches the log raw
        assert ln.isprintable(), repr(ln)
    assert not server.sessions


def test_check_island_id_and_printable():
    assert check_island_id("island-7 (Zürich)") == "island-7 (Zürich)"
    for bad in BAD_IDS + ["", "x" * 257, 5]:
        with pytest.raises(ValueError):
            check_island_id(bad)
    assert printable("a\nb\r\x1b[1m\ud800\\", 100) == "a\\x0ab\\x0d\\x1b[1m\\ud800\\\\"
    assert printable("x" * 300, 10) == "x" * 10 + "...(+290 chars)"


def _stranger_error(addr, message):
    conn = connect(addr, timeout=5, retries=0)
    try:
        conn.recv(timeout=5)   # CHALLENGE
        conn.send(MsgType.ERROR, {"code": "x\nyeto-syncer INFO forged", "message": message})
        try:
            conn.recv(timeout=2)
        except Exception:  # noqa: BLE001 - the syncer closes
            pass
    finally:
        conn.close()


def test_a_strangers_error_frames_are_logged_escaped_truncated_and_rate_limited(trap):
    server, addr = make_server(islands=1, fragments=1)
    forged = "\n2026-12-01 12:00:00 yeto-syncer INFO merged fragment 0 -> v9\r\x1b[2K" + "A" * 60000
    with running(server):
        t0 = time.monotonic()
        for _ in range(120):
            _stranger_error(addr, forged)
        time.sleep(0.3)
        took = time.monotonic() - t0
    text = "\n".join(trap.lines)
    assert trap.errors == 0
    assert all(ln.isprintable() for ln in trap.lines)          # no forged lines, no escapes reach the log
    assert not any(ln.startswith("2026-12-01") or "\n" in ln for ln in trap.lines)
    assert max(len(ln) for ln in trap.lines) < 1000            # 60 KB messages are cut
    windows = took / 10.0 + 1
    stranger_lines = [ln for ln in trap.lines if "unauthenticated peer" in ln]
    assert 1 <= len(stranger_lines) <= 10 * windows + 1, len(stranger_lines)   # rate-limited (old: 120)
    assert len(text) < 20_000, len(text)                       # old code: ~7 MB for 120 connections


def test_an_islands_error_text_is_escaped_in_the_log(trap):
    from .helpers import client, init_values
    server, addr = make_server(islands=1, fragments=1)
    with running(server):
        c = client(addr, "a")
        w = c.connect()
        vals = init_values()
        c.wait_ready(20, init_source=lambda f: [vals[i] for i in w.layout[f]])
        c.conn.send(MsgType.ERROR, {"code": "c", "message": "bye\nyeto-syncer INFO forged\x1b[0m"})
        deadline = time.monotonic() + 5
        while not [ln for ln in trap.lines if "sent an error" in ln] and time.monotonic() < deadline:
            time.sleep(0.05)
        c.abort()
    lines = [ln for ln in trap.lines if "sent an error" in ln]
    assert lines and "bye\\x0ayeto-syncer INFO forged\\x1b[0m" in lines[0]
    assert all(ln.isprintable() for ln in trap.lines)
