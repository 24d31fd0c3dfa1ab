#!/usr/bin/env python
"""Hostile-input fuzzer for the syncer (loopback only).

    python benchmarks/fuzz_syncer.py [--frames 100000] [--seconds 900] [--seed 0] [--quick] [--json out.json]

Starts a real syncer (this script with --serve, in a subprocess) with a running, initialized run: a legitimate
island INITs it and merges two rounds of every fragment (a checkpoint is written after each merge), and three
hostile islands that hold the key join it. Then it sends hostile inputs, each processed by the syncer on its own:

  pushes      bad PUSHes on one authenticated connection, refused one by one (PUSH_REPLY "refused") without
              closing it: unknown fragment, NaN/Inf values or scales, a body larger or smaller than the
              fragment, bad codec or block, bad or stale base version, bad counters, missing fields; junk
              HEARTBEAT/ACK messages (ignored) in between
  header ...  one connection each, before the handshake: bad magic/version/type and garbage (header),
              lengths above the maxima (oversize), frames cut short then closed (truncated), flipped payload
              or digest bits (digest), malformed CHUNK envelopes and sequences (chunk), malformed meta
              (meta), garbage HELLOs (hello), wrong key, replayed handshakes or a swapped ephemeral key,
              another manifest, one island too many (auth)
  post-auth   one connection each, after an authenticated handshake: framing errors and unexpected messages
  slow        slow-loris: silence, partial frames, a HELLO trickled a byte (or an 8-byte chunk) at a time
  memory      chunked INIT/PUSH messages announcing gigabytes, followed by tens of MiB of data; the largest
              HELLO allowed, held one byte short of complete

and checks: the syncer process is alive and logged no internal error; the legitimate island pushes and
receives the merged base afterwards, bit-exact against a numpy Nesterov step from the pre-fuzz checkpoint; the
syncer's RSS grows by less than --max-rss-mib; every hostile connection is closed by the syncer (with an ERROR
frame or plainly) within its timeouts; the committed state is unchanged (xxh3 of every base/momentum array,
versions, merges_total, the island ledger; sha256 of the checkpoint file); every hostile push is refused with
the expected code. Prints one row per category and exits 1 on any violation.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np
import psutil
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from yeto_patch.syncer.model.checkpoint import read_checkpoint  # noqa: E402
from yeto_patch.wire import auth, codec_names, codecs, secure, sparse  # noqa: E402
from yeto_patch.wire.client import SyncerClient  # noqa: E402
from yeto_patch.wire.frames import HEADER, HEADER_SIZE, MAGIC, MAX_PAYLOAD, MsgType, ProtocolError  # noqa: E402
from yeto_patch.wire.handshake import PROTOCOL, IslandHello  # noqa: E402
from yeto_patch.wire.message import pack_meta, unpack  # noqa: E402
from yeto_patch.wire.transport import connect  # noqa: E402

MANIFEST = [("embedding.word_embeddings.weight", (256, 64), "float32"),
            ("decoder.layers.0.self_attention.linear_qkv.weight", (192, 64), "float32"),
            ("decoder.layers.0.mlp.linear_fc1.weight", (128, 64), "float32"),
            ("decoder.layers.0.mlp.linear_fc1.bias", (128,), "float32"),
            ("decoder.layers.0.mlp.linear_fc2.weight", (64, 128), "float32"),
            ("decoder.final_layernorm.weight", (64,), "float32")]
MANIFEST_JSON = [[n, list(s), d] for n, s, d in MANIFEST]
DIGEST = auth.manifest_digest(MANIFEST)
FRAGMENTS = 3
LEGIT = "island-a"
HOSTILE = {"push": "mallory-push", "frame": "mallory-frame", "slow": "mallory-slow"}
INIT_ISLAND = "mallory-init"  # joins first, INITs one fragment and then only heartbeats (its claim must lapse)
INCARNATION = 77
ROUNDS = 6  # legitimate merges of every fragment before the fuzz (versions 6: a base-0 push lags more than
#            the default --max-base-lag 4, so it is refused as stale rather than carried)
PRE_AUTH = ("header", "oversize", "truncated", "digest", "chunk", "meta", "hello", "auth")


# ------------------------------------------------------------------------------------------ the syncer side
def serve(cfg: dict) -> None:
    """Child mode: run the syncer; answer "state" on stdin with a JSON line (hashes of the committed state)."""
    from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
    from yeto_patch.syncer.model.snapshot import capture
    from yeto_patch.syncer.net.server import ServerConfig, SyncerServer

    logging.basicConfig(level=cfg["log_level"], stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(levelname)s %(message)s")
    islands = 2 + len(HOSTILE)
    server = SyncerServer(ServerConfig(
        listen="127.0.0.1:0", islands=islands, fragments=FRAGMENTS, key=bytes.fromhex(cfg["key"]),
        merge=MergeSettings(), rounds=RoundSettings(islands=islands, quorum=1, grace_s=0.0, lease_s=3600.0),
        checkpoint=cfg["checkpoint"], checkpoint_every=1, merge_threads=1, init_timeout_s=cfg["init_timeout"],
        initializer="first",   # (as before the lowest-id default: the roster never all joins here)
        io_timeout_s=cfg["io_timeout"], handshake_timeout_s=cfg["handshake_timeout"],
        # every input is to reach the handshake code: the flood cap (tested on its own) must not trip
        max_handshakes=100_000, max_handshakes_per_host=100_000))
    host, port = server.start()
    print(json.dumps({"port": port}), flush=True)
    for line in sys.stdin:
        if line.strip() != "state":
            break
        snap = capture(server.coord)
        h = xxhash.xxh3_128()
        for arrays in snap.arrays:
            for name in sorted(arrays):
                h.update(name.encode())
                h.update(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))
        print(json.dumps({"arrays": h.hexdigest(), "versions": [f["version"] for f in snap.meta["fragments"]],
                          "merges_total": snap.meta["merges_total"], "ledger": snap.meta["ledger"],
                          "sessions": len(server.all_sessions), "threads_alive": all(
                              t.is_alive() for t in server._threads), "checkpoints": server.writer.writes}),
              flush=True)
    server.stop()


class Syncer:
    def __init__(self, cfg: dict, log_path: str):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env={**os.environ, "PYTHONPATH": ROOT})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the syncer did not start (see {log_path})")
        self.addr = ("127.0.0.1", json.loads(line)["port"])
        self.ps = psutil.Process(self.proc.pid)
        self._lock = threading.Lock()

    def state(self) -> dict:
        with self._lock:
            self.proc.stdin.write(b"state\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the syncer process died")
        return json.loads(line)

    def stop(self) -> int:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


class RssSampler(threading.Thread):
    def __init__(self, ps: psutil.Process, period: float = 0.02):
        super().__init__(daemon=True)
        self.ps, self.period = ps, period
        self.base = self.peak = ps.memory_info().rss
        self.peak_threads = ps.num_threads()
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(self.period):
            try:
                self.peak = max(self.peak, self.ps.memory_info().rss)
                self.peak_threads = max(self.peak_threads, self.ps.num_threads())
            except psutil.Error:
                return


# ------------------------------------------------------------------------------------------ frame builders
def frame(t: int, payload: bytes = b"", *, magic: bytes = MAGIC, version: int = 1, length=None, digest=None,
          flags: int = 0) -> bytes:
    return HEADER.pack(magic, version, t, flags, len(payload) if length is None else length,
                       xxhash.xxh3_64_intdigest(payload) if digest is None else digest) + payload


def message(t: int, meta: dict, body: bytes = b"") -> bytes:
    return frame(t, pack_meta(meta) + body)


def chunk(msg_id: int, inner: int, total: int, offset: int, data: bytes, reserved: int = 0) -> bytes:
    return frame(MsgType.CHUNK, struct.pack("<QHHQQ", msg_id, inner, reserved, total, offset) + data)


def some_challenge() -> dict:
    """A CHALLENGE as a keyed syncer sends it (for HELLOs built without a connection)."""
    return {"nonce": auth.new_nonce().hex(), "protocol": PROTOCOL, "auth": True, "frames": "mac",
            "ephemeral": secure.Ephemeral().public.hex()}


def hello_meta(key: bytes, ch: dict, island: str, incarnation: int = INCARNATION, digest: bytes = DIGEST) -> dict:
    """A HELLO answering challenge ``ch``, its MAC made with ``key``."""
    return IslandHello(ch, key, island, incarnation, digest).meta


def hello_and_manifest(key: bytes, ch: dict, island: str, manifest=MANIFEST_JSON, digest: bytes = DIGEST) -> bytes:
    """A HELLO for challenge ``ch`` and, right after it, the MANIFEST sealed with the session keys it agrees (the
    syncer reads the MANIFEST only once the HELLO passed, after its HELLO_OK)."""
    hello = IslandHello(ch, key, island, INCARNATION, digest)
    body = pack_meta({"manifest": manifest})
    header = HEADER.pack(MAGIC, 1, MsgType.MANIFEST, secure.FLAG_AUTH, len(body), 0)
    out, tag = secure.Sealer(hello.session().c2s, False).seal(header, [body], clear=0)
    return message(MsgType.HELLO, hello.meta) + header + b"".join(bytes(x) for x in out) + tag


def split_frames(buf: bytes) -> list:
    """(type, payload) of the complete frames in ``buf`` (stops at anything malformed)."""
    out, pos = [], 0
    while pos + HEADER_SIZE <= len(buf):
        magic, _, t, flags, n, _ = HEADER.unpack_from(buf, pos)
        tag = secure.TAG_SIZE if flags & secure.FLAG_AUTH else 0   # an authenticated frame: its tag follows
        if magic != MAGIC or pos + HEADER_SIZE + n + tag > len(buf):
            break
        out.append((t, buf[pos + HEADER_SIZE: pos + HEADER_SIZE + n]))
        pos += HEADER_SIZE + n + tag
    return out


def error_code(buf: bytes):
    for t, payload in split_frames(buf):
        if t == MsgType.ERROR:
            try:
                return str(unpack(payload)[0].get("code"))
            except Exception:  # noqa: BLE001
                return "?"
    return None


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            raise ConnectionError("closed")
        buf += b
    return bytes(buf)


def read_frame(sock: socket.socket):
    hdr = recv_exact(sock, HEADER_SIZE)
    _, _, t, _, n, _ = HEADER.unpack(hdr)
    return t, recv_exact(sock, n)


def wait_closed(sock: socket.socket, timeout: float):
    """Read until the peer closes: (bytes received, seconds until closed or None if still open)."""
    buf, t0 = bytearray(), time.monotonic()
    while True:
        left = t0 + timeout - time.monotonic()
        if left <= 0:
            return bytes(buf), None
        sock.settimeout(left)
        try:
            b = sock.recv(1 << 16)
        except socket.timeout:
            return bytes(buf), None
        except OSError:  # reset: closed with data of ours unread
            return bytes(buf), time.monotonic() - t0
        if not b:
            return bytes(buf), time.monotonic() - t0
        buf += b


_SESSIONS: dict = {}   # island id -> resumption secret of its last handshake here


def handshake(addr, key: bytes, island: str, record: list = None):
    """An authenticated handshake (a transport Connection); returns (conn, welcome meta)."""
    conn = connect("%s:%d" % addr, timeout=10, retries=3)
    _, ch, _ = conn.recv()
    # the id may still be connected: prove it is this process's session
    hello = IslandHello(ch, key, island, INCARNATION, DIGEST, resume=_SESSIONS.get(island))
    raw = message(MsgType.HELLO, hello.meta)
    conn.sock.sendall(raw)
    # every later frame is authenticated with the session keys of this handshake (wire/secure.py)
    sess = hello.session()
    conn.protect(sess.c2s, sess.s2c, sess.encrypt, clear_error_first=True)   # (a refusal comes clear)
    t, _, _ = conn.recv()
    if t != MsgType.HELLO_OK:
        raise ProtocolError(f"expected HELLO_OK, got {t.name}")
    _SESSIONS[island] = sess.resumption   # (only a session the syncer accepted can be resumed)
    conn.send(MsgType.MANIFEST, {"manifest": MANIFEST_JSON})
    t, welcome, _ = conn.recv()
    if record is not None:
        record.append((raw, welcome))
    return conn, welcome


# ------------------------------------------------------------------------------------------ hostile cases
@dataclass
class Case:
    cat: str
    send: Union[bytes, Callable]  # bytes, or a function of the CHALLENGE meta returning bytes
    expect: str = "close"         # "close" (any refusal), or the ERROR code the syncer must send
    frames: int = 1               # frames the syncer reads, the last one being refused
    shut: bool = False            # half-close after sending (the syncer sees the end mid-frame)


class Cases:
    def __init__(self, rng: random.Random, key: bytes, replay: list):
        self.rng, self.key, self.replay = rng, key, replay
        self.hello_frame = message(MsgType.HELLO, hello_meta(key, some_challenge(), "eve"))
        self.payload = self.hello_frame[HEADER_SIZE:]

    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def header(self) -> Case:
        r, h = self.rng, self.hello_frame
        kind = r.randrange(5)
        if kind == 0:
            return Case("header", bytes(r.getrandbits(8) for _ in range(4)).replace(b"Y", b"y") + h[4:])
        if kind == 1:
            return Case("header", frame(MsgType.HELLO, self.payload, version=self.pick([0, 2, 3, 255, 65535])))
        if kind == 2:
            t = self.pick([0, 3, 9, 13, 19, 30, 99, 1000, 65535])
            return Case("header", frame(t, self.payload))
        if kind == 3:
            return Case("header", self.pick([b"GET / HTTP/1.1\r\nHost: syncer\r\n\r\n",
                                             b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 40,
                                             b"SSH-2.0-OpenSSH_9.6\r\n" + b"\0" * 16]))
        return Case("header", bytes(r.getrandbits(8) for _ in range(r.randrange(28, 200))))

    def oversize(self) -> Case:
        r = self.rng
        t = self.pick([MsgType.HELLO, MsgType.PROBE, MsgType.CHUNK, MsgType.PUSH, MsgType.INIT, MsgType.ERROR,
                       MsgType.HEARTBEAT, MsgType.MANIFEST])
        lim = MAX_PAYLOAD[t]
        if t in (MsgType.PUSH, MsgType.INIT) and r.random() < 0.5:  # within the type's maximum, but unchunked
            n = r.randrange(MAX_PAYLOAD[MsgType.CHUNK] + 1, lim)
        else:
            n = self.pick([lim + 1, lim + r.randrange(1, 1 << 20), 1 << 62, (1 << 64) - 1])
        return Case("oversize", frame(t, b"", length=n, digest=0) + self.payload[:r.randrange(0, 64)])

    def truncated(self) -> Case:
        cut = self.rng.randrange(1, len(self.hello_frame))
        return Case("truncated", self.hello_frame[:cut], shut=True)

    def digest(self) -> Case:
        r, h = self.rng, bytearray(self.hello_frame)
        if r.random() < 0.7:
            i = r.randrange(HEADER_SIZE, len(h))
        else:
            i = r.randrange(20, 28)  # the digest field itself
        h[i] ^= 1 << r.randrange(8)
        return Case("digest", bytes(h))

    def chunk(self) -> Case:
        r, p = self.rng, self.payload
        n, H, mid = len(p), MsgType.HELLO, r.randrange(64, 256)
        first = chunk(1, H, n, 0, p[:mid])
        kind = r.randrange(15)
        if kind == 0:
            off = r.randrange(1, mid)
            return Case("chunk", chunk(1, H, n, off, p[off:mid]))                       # first chunk not at 0
        if kind == 1:
            return Case("chunk", first + chunk(1, H, n, mid + r.randrange(1, 64), p[mid + 64:mid + 128]), frames=2)
        if kind == 2:
            return Case("chunk", first + chunk(1, H, n, mid - r.randrange(1, mid), p[mid:mid + 64]), frames=2)
        if kind == 3:
            return Case("chunk", first + chunk(1, H, n, mid, p[mid:] + b"x" * r.randrange(1, 64)), frames=2)
        if kind == 4:
            return Case("chunk", chunk(1, H, mid - 1, 0, p[:mid]))                      # overflows its total
        if kind == 5:
            frames = b"".join(chunk(i, H, n, 0, p[:16]) for i in range(1, 6))            # 5 open, max 4
            return Case("chunk", frames, frames=5)
        if kind == 6:
            return Case("chunk", chunk(1, H, n, 0, p[:mid], reserved=r.randrange(1, 65536)))
        if kind == 7:
            return Case("chunk", chunk(1, self.pick([MsgType.CHUNK, 0, 3, 99, 65535]), n, 0, p[:mid]))
        if kind == 8:
            return Case("chunk", chunk(1, H, 0, 0, p[:mid]))                            # total 0
        if kind == 9:
            return Case("chunk", chunk(1, H, n, 0, b""))                                # empty chunk
        if kind == 10:
            return Case("chunk", first + chunk(1, self.pick([H, MsgType.PROBE]), n + 1, mid, p[mid:]), frames=2)
        if kind == 11:
            t = self.pick([H, MsgType.PUSH, MsgType.INIT, MsgType.HEARTBEAT])
            return Case("chunk", chunk(1, t, self.pick([MAX_PAYLOAD[t] + 1, (1 << 64) - 1]), 0, p[:mid]))
        if kind == 12:
            env = bytes(r.getrandbits(8) for _ in range(r.randrange(0, 28)))
            return Case("chunk", frame(MsgType.CHUNK, env))                             # short envelope
        if kind == 13:
            c = bytearray(chunk(1, H, n, 0, p[:mid]))
            c[r.randrange(HEADER_SIZE, len(c))] ^= 1 << r.randrange(8)
            return Case("chunk", bytes(c))                                              # digest of a chunk
        # a complete chunked HELLO, signed with a wrong key: reassembled, then refused by authentication
        bad = pack_meta(hello_meta(os.urandom(32), some_challenge(), "eve"))
        pieces = [bad[o:o + 97] for o in range(0, len(bad), 97)]
        data = b"".join(chunk(9, H, len(bad), 97 * i, x) for i, x in enumerate(pieces))
        return Case("chunk", data, expect="auth", frames=len(pieces))

    def meta(self) -> Case:
        r = self.rng
        raws = [b"", b"\x01\x00", struct.pack("<I", 100) + b"{}", struct.pack("<I", (16 << 20) + 1) + b"{}"]
        texts = [b"\xff\xfe{}", b"[1, 2]", b"\"hello\"", b"42", b"null", b'{"a": NaN}', b'{"a": Infinity}',
                 b'{"a": 1, "a": 2}', b"[" * 100000 + b"]" * 100000, b'{"a": ' + b"9" * 5000 + b"}",
                 b'{"a": "\\ud800"', b"{" + b"x" * 64, b'{"island_id": "x",}', b"\xc3\x28"]
        if r.random() < 0.25:
            payload = self.pick(raws)
        else:
            text = self.pick(texts)
            payload = struct.pack("<I", len(text)) + text
        return Case("meta", frame(self.pick([MsgType.HELLO, MsgType.PROBE]), payload))

    def hello(self) -> Case:
        r = self.rng
        m = hello_meta(os.urandom(32), some_challenge(), "eve")
        variants = [  # (field, value, expected ERROR code); None as value: the field is missing
            ("island_id", None, "protocol"), ("incarnation", None, "protocol"), ("nonce", None, "protocol"),
            ("manifest_digest", None, "protocol"), ("island_id", "", "protocol"), ("island_id", 7, "protocol"),
            ("island_id", ["eve"], "protocol"), ("island_id", "e" * 257, "protocol"), ("nonce", "zz", "protocol"),
            ("nonce", 12, "protocol"), ("nonce", "abc", "protocol"), ("manifest_digest", "xyz", "protocol"),
            ("mac", "not hex", "protocol"), ("mac", 5, "protocol"), ("nonce", "00" * 16, "protocol"),
            ("manifest_digest", "00" * 31, "protocol"), ("incarnation", -1, "protocol"),
            ("incarnation", 1 << 64, "protocol"), ("incarnation", "1", "protocol"), ("incarnation", 1.5, "protocol"),
            ("incarnation", [1], "protocol"), ("incarnation", True, "protocol"), ("ephemeral", "zz", "protocol"),
            ("ephemeral", 5, "protocol"), ("ephemeral", None, "auth"), ("ephemeral", "00" * 32, "auth"),
            ("mac", "", "auth"), ("mac", "00" * 32, "auth"), ("mac", os.urandom(32).hex(), "auth"),
            ("island_id", "ev\u00e9\u2603", "auth"), ("insecure", True, "keyless"), ("protocol", None, "protocol"),
            ("protocol", 1, "protocol"), ("protocol", 2, "protocol"), ("manifest", MANIFEST_JSON, "protocol"),
        ]
        field, value, code = self.pick(variants)
        if code == "keyless":
            m.update(mac="", insecure=True)
            code = "auth"
        elif value is None:
            del m[field]
        else:
            m[field] = value
        if r.random() < 0.15:  # some other message where HELLO belongs
            t = self.pick([MsgType.PUSH, MsgType.HEARTBEAT, MsgType.WELCOME, MsgType.INIT, MsgType.BYE,
                           MsgType.CHALLENGE, MsgType.FINAL, MsgType.ACK])
            return Case("hello", message(t, {"step": 1}), expect="protocol")
        return Case("hello", message(self.pick([MsgType.HELLO, MsgType.PROBE]) if code == "auth" else MsgType.HELLO,
                                     m), expect=code)

    def auth(self) -> Case:
        r, key = self.rng, self.key
        kind = r.randrange(8)
        if kind == 0:  # a recorded, valid HELLO replayed against a new challenge
            return Case("auth", self.pick(self.replay)[0], expect="auth")
        if kind == 1:  # a recorded HELLO with a relay's own ephemeral key in place of the island's (MAC kept)
            raw, _ = self.pick(self.replay)
            m = unpack(raw[HEADER_SIZE:])[0]
            m["ephemeral"] = secure.Ephemeral().public.hex()
            return Case("auth", message(MsgType.HELLO, m), expect="auth")

        def build(ch):
            island = "eve-%d" % r.randrange(1 << 30)
            if kind == 2:  # wrong key
                return message(self.pick([MsgType.HELLO, MsgType.PROBE]), hello_meta(os.urandom(32), ch, island))
            if kind == 3:  # right key, one island too many
                return hello_and_manifest(key, ch, island)
            if kind == 4:  # right key, the manifest changed after it was signed
                return hello_and_manifest(key, ch, island, [[n, [d + 1 for d in s], t] for n, s, t in MANIFEST_JSON])
            # right key and a consistent digest, but not the run's manifest (or not a manifest at all)
            other = [list(e) for e in MANIFEST_JSON]
            j = r.randrange(len(other))
            if kind == 5:
                other[j] = [other[j][0], [d + 1 for d in other[j][1]], "float32"]
            elif kind == 6:
                other = other[:j] + other[j + 1:] if r.random() < 0.5 else other + [["extra.weight", [4], "float32"]]
            else:
                other = self.pick([None, "x", {"a": 1}, [["w", [1], "float32"], ["w", [1], "float32"]],
                                   [["w", [-1], "float32"]], [["w", [True], "float32"]], [["w", [1 << 70], "f"]],
                                   [["", [1], "float32"]], [["w", [1], 7]], [[1, [1], "f"]], []])
                return hello_and_manifest(key, ch, island, other, digest=os.urandom(32))
            return hello_and_manifest(key, ch, island, other, digest=auth.manifest_digest(other))
        expect = {2: "auth", 3: "too-many-islands", 4: "auth"}.get(kind, "manifest")
        return Case("auth", build, expect=expect, frames=1 if kind == 2 else 2)

    def pre_auth(self, n: int) -> list:
        weights = {"header": 3, "oversize": 2, "truncated": 2, "digest": 2, "chunk": 4, "meta": 2, "hello": 3,
                   "auth": 2}
        cats = list(weights)
        return [getattr(self, c)() for c in self.rng.choices(cats, [weights[c] for c in cats], k=n)]

    def unexpected(self) -> Case:
        t = self.pick([MsgType.HELLO, MsgType.PROBE, MsgType.WELCOME, MsgType.CHALLENGE, MsgType.BASE,
                       MsgType.FINAL_BASE, MsgType.PUSH_REPLY, MsgType.FINAL])
        meta = {"last_step": self.pick(["many", [1], {"a": 1}])} if t == MsgType.FINAL else {"x": 1}
        return Case("unexpected", message(t, meta), expect="protocol")


def post_auth_case(addr, case: Case, timeout: float, key: bytes, violations: list, patience: float = 30.0):
    """``case`` after an authenticated handshake as HOSTILE["frame"]. The slow and pre-auth categories run beside
    it from the same address, so the syncer may close the handshake at admission (--max-handshakes-per-host is
    full): that is the syncer doing its job, and the handshake is tried again as an island's reconnect would, for
    ``patience`` seconds. A handshake that keeps failing is a violation (returns None then)."""
    give_up, err = time.monotonic() + patience, None
    while time.monotonic() < give_up:
        try:
            return run_case(addr, case, timeout, key, HOSTILE["frame"])
        except Exception as e:  # noqa: BLE001 - closed at admission, or the handshake timed out under load
            err = e
            time.sleep(0.2)
    violations.append(f"post-auth: the authenticated handshake failed for {patience:.0f}s: {err!r}")
    return None


def run_case(addr, case: Case, timeout: float, key: bytes = None, island: str = None) -> dict:
    """One hostile connection (after an authenticated handshake as ``island`` if given)."""
    if island is not None:
        conn, _ = handshake(addr, key, island)
        sock = conn.sock
    else:
        conn, sock = None, socket.create_connection(addr, timeout=10)
    try:
        data = case.send
        if callable(data):
            _, payload = read_frame(sock)
            data = data(unpack(payload)[0])
        try:
            sock.sendall(data)
            if case.shut:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the syncer refused (and closed) before reading everything
        buf, took = wait_closed(sock, timeout)
    finally:
        (conn or sock).close()
    return {"closed": took is not None, "took": took, "code": error_code(buf)}


# ---------------------------------------------------------------------------------------- hostile pushes
SPARSE_FUZZ = ("topk:0.02+int2", "topk:0.05+int4", "topk:0.1+int8")
BAD_SPARSE = ["topk:0.020+int2", "topk:2e-2+int2", "TOPK:0.02+int2", "topk:0.6+int2", "topk:0.0001+int2",
              "topk:0.02+int3", "topk:0.02+int16", "topk:0.02+int2 ", "topk:1+int2", "topk:0.02", "topk:" + "1" * 40]


def bad_sparse_body(r: random.Random, codec: str, good: bytes, n: int) -> bytes:
    """``good`` (a sparse encoding of n zeros, block 256: indices 0..K-1) with one block's indices out of its
    block (the partial last block), out of order or repeated, or a value's unused bits set."""
    lay = sparse.layout(codec_names.sparse(codec), n, 256)
    b = bytearray(good)
    hows = ["order", "repeat"] + (["range"] if lay.tail else []) + (["padding"] if (lay.k * lay.spec.bits) % 8 else [])
    how = r.choice(hows)
    j = lay.nfull if how == "range" or not lay.nfull else r.randrange(lay.nfull)
    k = lay.k_last if j == lay.nfull else lay.k
    i0 = lay.off_idx + j * lay.k          # width 1 at block 256
    if how == "range":
        b[i0 + k - 1] = r.randrange(lay.tail, 256)
    elif how == "order" or k == 1:
        b[i0] = b[i0 + k - 1] if k > 1 else 255 if j == lay.nfull else b[i0]
        if k > 1:
            b[i0 + k - 1] = 0
    elif how == "repeat":
        b[i0 + 1] = b[i0]
    else:
        b[lay.off_val + (j + 1) * lay.vb - 1] |= 0x80
    return bytes(b)


class PushFuzzer:
    """Bad PUSHes (and ignored junk) on one authenticated connection; every PUSH must be refused."""

    def __init__(self, rng: random.Random, versions: list, numels: list):
        self.rng, self.v, self.numels = rng, versions, numels
        self.codecs = codecs.CODECS + SPARSE_FUZZ
        self.zero = {(f, c): codecs.encode(c, np.zeros(n, np.float32)).tobytes()
                     for f, n in enumerate(numels) for c in self.codecs}

    def make(self):
        """(message type, meta, body, expected refusal code or None for an ignored message)."""
        r, pick = self.rng, lambda s: s[r.randrange(len(s))]
        f = r.randrange(len(self.numels))
        n = self.numels[f]
        lag = r.randrange(2)  # 0: answers the open round (folded at once); 1: would be carried (held)
        meta = {"fragment": f, "base_version": self.v[f] - lag, "local_step": 5, "steps": 1, "tokens": 64,
                "codec": "f32", "block": 256, "numel": n, "final": r.random() < 0.3}
        body = self.zero[(f, "f32")]
        kind = r.choices(["fragment", "missing", "counter", "base", "stale", "codec", "size", "nonfinite",
                          "ignored", "outlier", "sparse"], [2, 1, 2, 2, 1, 2, 3, 5, 1, 2, 3])[0]
        if kind == "fragment":
            g = pick([len(self.numels), 99, -1, 1 << 63, "0", None, 1.5, [0], {"i": 0}, True, False])
            meta["fragment"] = g
            if isinstance(g, bool):  # otherwise a well-formed push for fragment int(g)
                meta["base_version"] = self.v[int(g)]
                body = self.zero[(int(g), "f32")]
            return MsgType.PUSH, meta, body, "bad-fragment"
        if kind == "missing":
            del meta[pick(["fragment", "base_version", "codec"])]
            return MsgType.PUSH, meta, body, "bad-push"
        if kind == "counter":
            meta[pick(["local_step", "steps", "tokens", "block"])] = pick([-1, "7", 1.5, True, [1], None, {}])
            return MsgType.PUSH, meta, body, "bad-push"
        if kind == "base":
            meta["base_version"] = pick([self.v[f] + 1, self.v[f] + r.randrange(2, 1 << 20), -1, 1 << 64, "2",
                                         None, 2.0, True, [2]])
            return MsgType.PUSH, meta, body, "bad-base"
        if kind == "stale":
            meta["base_version"] = 0
            return MsgType.PUSH, meta, body, "stale"
        if kind == "codec":
            if r.random() < 0.6:
                meta["codec"] = pick(["f64", "", "F32", "int3", "int4 ", "\u2603", None, 7, ["f32"]] + BAD_SPARSE)
            elif r.random() < 0.5:
                meta["codec"] = pick(["int4", "int4-log", "int1"])
                meta["block"] = pick([1, 3, 255, 1 << 25, 1 << 40] + ([4, 12, 250] if meta["codec"] == "int1" else []))
            else:   # a valid sparse name with a block its 16-bit indices cannot address
                meta["codec"] = pick(SPARSE_FUZZ)
                meta["block"] = pick([(1 << 16) + 1, 1 << 20, 1 << 24])
            return MsgType.PUSH, meta, body, "bad-codec"
        if kind == "outlier":  # within every codec check, but a norm far above anything the fragment has seen
            nb = -(-n // 256)
            meta["codec"] = pick(["int4-log", "int8", "f32", "int1"])
            if meta["codec"] == "f32":
                body = np.full(n, pick([1e30, 2.9e38, 1e20]), np.float32).tobytes()
            elif meta["codec"] == "int1":   # every value +-scale: the scales alone carry the norm
                body = np.concatenate([np.full(nb, pick([2.9e38, 1e30, 1e20]), np.float32).view(np.uint8),
                                       np.full(-(-n // 8), pick([0, 0x55, 0xFF]), np.uint8)]).tobytes()
            else:
                k = 0x77 if meta["codec"] == "int4-log" else 0x7F
                scale = pick([2.9e38, 1e30]) if k == 0x77 else pick([1e30, 1e20]) / 127
                body = np.concatenate([np.full(nb, scale, np.float32).view(np.uint8),
                                       np.full(-(-n // 2) if k == 0x77 else n, k, np.uint8)]).tobytes()
            return MsgType.PUSH, meta, body, "outlier"
        if kind == "sparse":   # well-sized, finite scales, but indices or padding a decoder must not trust
            meta["codec"] = pick(SPARSE_FUZZ)
            return MsgType.PUSH, meta, bad_sparse_body(r, meta["codec"], self.zero[(f, meta["codec"])], n), "bad-push"
        codec = pick(self.codecs)
        meta["codec"] = codec
        good = self.zero[(f, codec)]
        if kind == "size":
            want = len(good)
            size = pick([0, 1, want - 1, want + 1, want + 4, want // 2, 2 * want])
            body = (good * 3)[:size]
            return MsgType.PUSH, meta, body, "bad-push"
        if kind == "nonfinite":
            b = bytearray(good)
            if codec == "f32":
                i = r.randrange(n)
                b[4 * i:4 * i + 4] = np.float32(pick([np.nan, np.inf, -np.inf])).tobytes()
            elif codec == "bf16":
                i = r.randrange(n)
                b[2 * i:2 * i + 2] = np.uint16(pick([0x7FC0, 0x7F80, 0xFF80, 0x7F81])).tobytes()
            else:
                nb = -(-n // 256)
                i = r.randrange(nb)
                b[4 * i:4 * i + 4] = np.float32(pick([np.nan, np.inf, -1.0, 3.3e38])).tobytes()
            return MsgType.PUSH, meta, bytes(b), "nonfinite"
        # ignored junk: must neither be answered nor change anything
        t = pick([MsgType.HEARTBEAT, MsgType.ACK])   # (INIT after initialization is an ERROR init)
        junk = {MsgType.HEARTBEAT: {"step": pick([-1, "x", None, [1, 2]])},
                MsgType.INIT: {"fragment": f, "numel": n, "dtype": "f32"},
                MsgType.ACK: {"versions": pick([[99, 99, 99], "all", None])}}[t]
        return t, junk, (good if t == MsgType.INIT else b""), None

    def run(self, conn, count: int, deadline: float, window: int = 64) -> dict:
        sem = threading.Semaphore(window)
        expected, got = collections.Counter(), collections.Counter()
        sent = {"pushes": 0, "frames": 0, "done": False}
        failure = []

        def reader():
            while True:
                if sent["done"] and sum(got.values()) >= sent["pushes"]:
                    return
                try:
                    t, meta, _ = conn.recv(timeout=30)
                except Exception as e:  # noqa: BLE001
                    failure.append(f"the authenticated hostile connection failed: {e}")
                    return
                if t == MsgType.PUSH_REPLY:
                    got[(meta.get("status"), meta.get("code"))] += 1
                    sem.release()

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            while sent["frames"] < count and time.monotonic() < deadline and not failure:
                t, meta, body, code = self.make()
                if code is not None:
                    while not sem.acquire(timeout=1.0):
                        if failure:
                            break
                    expected[("refused", code)] += 1
                    sent["pushes"] += 1
                conn.send(t, meta, body)
                sent["frames"] += 1
        except Exception as e:  # noqa: BLE001
            failure.append(f"sending hostile pushes failed: {e}")
        sent["done"] = True
        th.join(60)
        return {"frames": sent["frames"], "pushes": sent["pushes"], "expected": expected, "got": got,
                "failure": failure}


# ------------------------------------------------------------------------------------------ slow / memory
def slow_case(addr, kind: str, io_timeout: float, timeout: float, hello: bytes) -> dict:
    """Hold a connection open without completing a frame; the syncer must close it on its own."""
    sock = socket.create_connection(addr, timeout=10)
    t0 = time.monotonic()
    try:
        if kind == "partial-header":
            sock.sendall(hello[:random.randrange(1, HEADER_SIZE)])
        elif kind == "partial-payload":
            sock.sendall(hello[:random.randrange(HEADER_SIZE, len(hello))])
        elif kind in ("trickle", "chunk-trickle"):
            if kind == "trickle":
                pieces = [hello[i:i + 1] for i in range(len(hello))]
            else:
                p = hello[HEADER_SIZE:]
                pieces = [chunk(1, MsgType.HELLO, len(p), o, p[o:o + 8]) for o in range(0, len(p), 8)]
            for piece in pieces:  # each piece well within the io timeout: only a total bound ends this
                try:
                    sock.sendall(piece)
                    sock.settimeout(0.5 * io_timeout)
                    if sock.recv(1 << 16) == b"":
                        break
                except socket.timeout:
                    pass
                except OSError:
                    break
                if time.monotonic() - t0 > timeout:
                    break
        buf, took = wait_closed(sock, max(0.1, timeout - (time.monotonic() - t0)))
    finally:
        sock.close()
    return {"closed": took is not None, "took": time.monotonic() - t0, "code": error_code(buf)}


def memory_case(addr, inner: int, total: int, nbytes: int, timeout: float) -> dict:
    """A chunked message announcing ``total`` bytes, then ``nbytes`` of it, then nothing: held until closed."""
    sock = socket.create_connection(addr, timeout=10)
    t0 = time.monotonic()
    frames = 0
    try:
        try:
            for o in range(0, nbytes, 8 << 20):
                sock.sendall(chunk(5, inner, total, o, bytes(min(8 << 20, nbytes - o))))
                frames += 1
        except OSError:
            pass
        buf, took = wait_closed(sock, timeout)
    finally:
        sock.close()
    return {"closed": took is not None, "took": time.monotonic() - t0, "code": error_code(buf), "frames": frames}


# --------------------------------------------------------------------------------------------- the run
ROWS = ("pushes",) + PRE_AUTH + ("post-auth", "slow", "memory")


class Tally:
    """Per category: inputs sent, frames the syncer read, refusals by ERROR+close / PUSH_REPLY / plain close,
    junk the syncer rightly ignored, connections left open, refusals other than expected, the slowest close."""

    def __init__(self):
        self.rows = {c: collections.Counter() for c in ROWS}
        self.lock = threading.Lock()

    def add(self, cat: str, **counts):
        took = counts.pop("max_close_s", 0.0)
        with self.lock:
            row = self.rows[cat]
            row.update(counts)
            row["max_close_s"] = max(row["max_close_s"], took)

    def record(self, cat: str, res: dict, case: Case = None, frames: int = 1):
        code, closed = res["code"], res["closed"]
        self.add(cat, sent=1, frames=frames, error=int(closed and code is not None), closed=int(
            closed and code is None), open=int(not closed), max_close_s=res["took"] or 0.0,
            unexpected=int(case is not None and case.expect != "close" and code != case.expect))


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def setup(syncer: Syncer, key: bytes, np_rng) -> dict:
    """The legitimate island INITs the run and merges ROUNDS rounds of every fragment; the hostile islands
    join once (so the ledger holds them before the state is captured)."""
    addr = syncer.addr
    t_init = time.monotonic()
    stall, w0 = handshake(addr, key, INIT_ISLAND)   # asked to INIT; sends one fragment, then heartbeats only
    bad = [np.full(s, 7.0, np.float32) for _, s, _ in MANIFEST]
    stall.send(MsgType.INIT, {"fragment": 0, "numel": w0["numels"][0], "dtype": "f32"},
               np.concatenate([bad[i].reshape(-1) for i in w0["layout"][0]]).tobytes())
    beating = threading.Event()

    def beat():
        while not beating.wait(0.2):
            try:
                stall.send(MsgType.HEARTBEAT, {"step": 0})
            except Exception:  # noqa: BLE001
                return

    threading.Thread(target=beat, daemon=True).start()
    legit = SyncerClient("%s:%d" % addr, key, LEGIT, MANIFEST, timeout=20, connect_retries=3)
    w = legit.connect()
    values = [np_rng.standard_normal(s).astype(np.float32) for _, s, _ in MANIFEST]
    legit.wait_ready(60, init_source=lambda f: [values[i] for i in w.layout[f]])  # asked once the claim lapsed
    partial_init_s = time.monotonic() - t_init
    beating.set()
    stall.close()
    for v in range(ROUNDS):
        for f in range(FRAGMENTS):
            d = (np_rng.standard_normal(w.numels[f]) * 0.01).astype(np.float32)
            legit.push(f, base_version=v, local_step=v, steps=1, tokens=1, codec="f32",
                       body=codecs.encode("f32", d), wait=True)
            legit.wait_base(f, v + 1, 30)
    replay = []
    conns = {role: handshake(addr, key, island, record=replay)[0] for role, island in HOSTILE.items()}
    for role in ("frame", "slow"):
        conns.pop(role).close()
    deadline = time.monotonic() + 30
    while True:  # the checkpoint of the last merge is written after its base went out
        state = syncer.state()
        if state["checkpoints"] == FRAGMENTS * ROUNDS or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {"legit": legit, "welcome": w, "replay": replay, "push_conn": conns["push"], "state": state,
            "partial_init_s": partial_init_s, "init_needed": w0["needs_init"]}


def fuzz(args, syncer: Syncer, key: bytes, ctx: dict, tally: Tally, violations: list) -> bool:
    """Send the hostile inputs, the categories concurrently, until done or --seconds passed (returns True then)."""
    addr, rng = syncer.addr, random.Random(args.seed)
    close_within = 2 * args.io_timeout + args.slack  # handshake timeout + io timeout + scheduling slack
    n = args.frames
    n_slow, n_mem = min(400, max(10, n // 250)), (6 if args.quick else 24)
    n_post, n_pre = max(20, n * 3 // 100), max(50, n * 15 // 100)
    n_push = max(0, n - n_slow - n_mem - n_post - n_pre)
    gen = Cases(rng, key, ctx["replay"])
    pre = gen.pre_auth(n_pre)
    post = [getattr(gen, rng.choice(["header", "oversize", "digest", "chunk", "meta", "unexpected"]))()
            for _ in range(n_post)]
    for c in post:
        # after the handshake these raw frames lack the frame MAC the handshake agreed: refused from their header
        # (the syncer closes at once; its ERROR "integrity" may be lost to the reset of the unread bytes)
        c.expect = "close"
    pushes = PushFuzzer(rng, ctx["state"]["versions"], ctx["welcome"].numels)
    stop_at = time.monotonic() + args.seconds
    push_result = {}

    def pre_worker(c):
        if time.monotonic() < stop_at:
            tally.record(c.cat, run_case(addr, c, close_within), c, frames=c.frames)

    def post_worker():
        for c in post:
            if time.monotonic() < stop_at:
                res = post_auth_case(addr, c, close_within, key, violations)
                if res is not None:
                    tally.record("post-auth", res, c, frames=c.frames)

    def slow_worker(i):
        if time.monotonic() < stop_at:
            kind = ["silent", "partial-header", "partial-payload", "trickle", "chunk-trickle"][i % 5]
            tally.record("slow", slow_case(addr, kind, args.io_timeout, close_within, gen.hello_frame))

    def mem_worker(i):
        if time.monotonic() < stop_at:
            # gigabytes announced for a message no unauthenticated peer may send, followed by 48 MiB; a MANIFEST
            # before any HELLO passed (64 KiB at most then); or the largest HELLO there may be, all but its last byte
            inner, total, nbytes = [(MsgType.INIT, 1 << 34, 48 << 20), (MsgType.PUSH, 1 << 34, 48 << 20),
                                    (MsgType.HELLO, MAX_PAYLOAD[MsgType.HELLO], MAX_PAYLOAD[MsgType.HELLO] - 1),
                                    (MsgType.MANIFEST, MAX_PAYLOAD[MsgType.MANIFEST], 8 << 20)][i % 4]
            r = memory_case(addr, inner, total, nbytes, close_within)
            tally.record("memory", r, frames=max(1, r["frames"]))

    threads = [threading.Thread(target=lambda: push_result.update(pushes.run(ctx["push_conn"], n_push, stop_at))),
               threading.Thread(target=post_worker)]
    for t in threads:
        t.start()
    with ThreadPoolExecutor(args.concurrency) as pool_pre, ThreadPoolExecutor(32) as pool_slow, \
            ThreadPoolExecutor(8) as pool_mem:
        futs = [pool_mem.submit(mem_worker, i) for i in range(n_mem)]
        futs += [pool_slow.submit(slow_worker, i) for i in range(n_slow)]
        futs += [pool_pre.submit(pre_worker, c) for c in pre]
        for fu in futs:
            try:
                fu.result()
            except Exception as e:  # noqa: BLE001
                violations.append(f"fuzz worker failed: {e!r}")
    for t in threads:
        t.join()
    ctx["push_conn"].close()
    violations.extend(push_result.get("failure", []))
    expected, got = push_result.get("expected", collections.Counter()), push_result.get("got", collections.Counter())
    tally.add("pushes", sent=push_result.get("frames", 0), frames=push_result.get("frames", 0),
              refused=sum(v for (status, _), v in got.items() if status == "refused"),
              ignored=push_result.get("frames", 0) - push_result.get("pushes", 0))
    # two bad pushes of one fragment and base in flight at once: the second is a duplicate of the first (still
    # being folded) whatever else is wrong with it; any other difference is a violation
    extra, missing = got - expected, expected - got
    if {k for k in got if k[0] != "refused"} or {c for _, c in extra} - {"duplicate"} or \
            {c for _, c in missing} - {"nonfinite", "bad-push", "outlier"}:
        diff = {f"{k[0]}/{k[1]}": (expected.get(k, 0), got.get(k, 0)) for k in set(extra) | set(missing)}
        violations.append(f"hostile pushes: replies differ from the expected refusals (expected, got): {diff}")
        tally.add("pushes", unexpected=sum(extra.values()))
    for cat, row in tally.rows.items():
        if row["open"]:
            violations.append(f"{cat}: {row['open']} connection(s) left open past {close_within:.1f}s")
        if row["unexpected"] and cat != "pushes":
            violations.append(f"{cat}: {row['unexpected']} refusal(s) without the expected ERROR code")
    return time.monotonic() >= stop_at


def churn(syncer: Syncer, key: bytes, n: int, violations: list) -> dict:
    """After the fuzz: HELLO + BYE with ``n`` fresh ids, one at a time (mallory-slow says BYE first to free a
    slot); stateless ids are forgotten, so the ledger (and the checkpoint) must not grow."""
    addr, t0, done = syncer.addr, time.monotonic(), 0
    for k in range(-1, n):
        island = HOSTILE["slow"] if k < 0 else "churn-%06d-%s" % (k, "x" * 200)
        end = time.monotonic() + 10
        while True:  # (the syncer closes the connection just before it records the BYE: retry briefly)
            try:
                conn, _ = handshake(addr, key, island)
                break
            except Exception as e:  # noqa: BLE001
                if "too-many-islands" not in str(e) or time.monotonic() > end:
                    violations.append(f"churn: island {k} could not join: {e!r}")
                    return {"ids": done, "seconds": time.monotonic() - t0}
                time.sleep(0.05)
        conn.send(MsgType.BYE, {"reason": "churn"})
        wait_closed(conn.sock, 10)  # the syncer closes after the BYE: handled before the next id joins
        conn.close()
        done += k >= 0
    return {"ids": done, "seconds": time.monotonic() - t0}


def verify(syncer: Syncer, ctx: dict, ckpt: dict, np_rng, violations: list) -> dict:
    """After the fuzz: no hostile connection left, state and checkpoint unchanged, the legitimate island is still
    served: its pushes merge into exactly the base a Nesterov step from the checkpointed state gives."""
    s0 = ctx["state"]
    s0 = {**s0, "ledger": {i: e for i, e in s0["ledger"].items() if i != HOSTILE["slow"]}}  # (churn's BYE)
    deadline = time.monotonic() + 15
    while True:   # (the last churned id's BYE is recorded just after its connection closed: wait for it too)
        s1 = syncer.state()
        if (s1["sessions"] <= 1 and s1["ledger"] == s0["ledger"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if s1["sessions"] != 1:
        violations.append(f"{s1['sessions'] - 1} hostile connection(s) still held by the syncer")
    changed = [k for k in ("arrays", "versions", "merges_total", "ledger") if s1[k] != s0[k]]
    for k in changed:
        violations.append(f"syncer state changed: {k}: {s0[k]} -> {s1[k]}")
    if not s1["threads_alive"]:
        violations.append("a syncer thread (accept/scheduler) died")
    ck_same = sha256(ckpt["path"]) == ckpt["sha256"]
    if not ck_same:
        violations.append("the checkpoint file changed")
    legit, numels = ctx["legit"], ctx["welcome"].numels
    try:
        legit.check()
        mu, lr = np.float32(0.9), np.float32(0.7)
        for f in range(FRAGMENTS):
            v = s1["versions"][f]
            d = (np_rng.standard_normal(numels[f]) * 0.01).astype(np.float32)
            legit.push(f, base_version=v, local_step=9, steps=1, tokens=1, codec="f32", body=codecs.encode("f32", d),
                       wait=True)
            got = legit.wait_base(f, v + 1, 30)
            m = ckpt["arrays"][f]["momentum"] * mu + d  # the syncer's Nesterov step, same float32 operations
            want = ckpt["arrays"][f]["base"] - (m * mu + d) * lr
            if got.version != v + 1 or not np.array_equal(got.values, want):
                violations.append(f"fragment {f}: the merged base after the fuzz differs from the reference")
    except Exception as e:  # noqa: BLE001
        violations.append(f"the legitimate island failed after the fuzz: {e!r}")
    return {"state_unchanged": not changed, "checkpoint_unchanged": ck_same}


def run(args) -> dict:
    """Run the fuzz; returns the results (``violations`` empty when every check held)."""
    np_rng = np.random.default_rng(args.seed)
    key = os.urandom(32)
    tmp = tempfile.mkdtemp(prefix="yeto-fuzz-")
    log_path, ckpt_path = os.path.join(tmp, "syncer.log"), os.path.join(tmp, "syncer.ckpt")
    syncer = Syncer({"key": key.hex(), "checkpoint": ckpt_path, "io_timeout": args.io_timeout,
                     "init_timeout": 2 * args.io_timeout,
                     "handshake_timeout": args.io_timeout, "log_level": args.log_level}, log_path)
    violations: list = []
    tally = Tally()
    res = {"violations": violations, "crashes": 0}
    ctx = {}
    try:
        ctx = setup(syncer, key, np_rng)
        meta, arrays = read_checkpoint(ckpt_path)
        ckpt = {"path": ckpt_path, "sha256": sha256(ckpt_path), "arrays": arrays}
        if meta["merges_total"] != ctx["state"]["merges_total"]:
            violations.append("setup: the checkpoint does not hold the last merge")
        sampler = RssSampler(syncer.ps)
        sampler.start()
        t0 = time.monotonic()
        capped = fuzz(args, syncer, key, ctx, tally, violations)
        elapsed = time.monotonic() - t0
        res["churn"] = churn(syncer, key, args.churn, violations)
        res["partial_init_s"] = ctx["partial_init_s"]
        if ctx["init_needed"] != list(range(FRAGMENTS)) or ctx["partial_init_s"] > 2 * args.io_timeout + 30:
            violations.append(f"partial INIT: the stalled initializer's claim did not lapse in time "
                              f"({ctx['partial_init_s']:.1f}s)")
        res.update(verify(syncer, ctx, ckpt, np_rng, violations))
        sampler.done.set()
        sampler.join()
        if syncer.proc.poll() is not None:
            res["crashes"] = 1
            violations.append(f"the syncer process exited (status {syncer.proc.returncode})")
        growth = (sampler.peak - sampler.base) / (1 << 20)
        if growth > args.max_rss_mib:
            violations.append(f"syncer RSS grew by {growth:.0f} MiB (bound {args.max_rss_mib:.0f} MiB)")
        frames = sum(r["frames"] for r in tally.rows.values())
        res.update(rows={k: dict(v) for k, v in tally.rows.items() if v}, frames=frames, seconds=elapsed,
                   frames_per_s=frames / elapsed, rss_base_mib=sampler.base / (1 << 20), rss_growth_mib=growth,
                   peak_threads=sampler.peak_threads, capped=capped)
    finally:
        if ctx.get("legit") is not None:
            ctx["legit"].close()
        code = syncer.stop()
        with open(log_path, "rb") as f:
            res["internal_errors"] = f.read().count(b"Traceback")
        if res["internal_errors"]:
            violations.append(f"the syncer logged {res['internal_errors']} internal error(s); see {log_path}")
        if code != 0:
            violations.append(f"the syncer exited with status {code} (log: {log_path})")
        if not violations:
            shutil.rmtree(tmp, ignore_errors=True)
    return res


def report(res: dict) -> str:
    cols = ("sent", "frames", "error", "refused", "closed", "ignored", "open", "unexpected")
    widths = (8, 8, 12, 9, 8, 8, 6, 11)
    lines = [f"{'category':<11}" + "".join(f"{h:>{w}}" for h, w in zip(
        ("sent", "frames", "ERROR+close", "refused", "closed", "ignored", "open", "unexpected", "max close s"),
        widths + (12,)))]
    for cat, r in res.get("rows", {}).items():
        lines.append(f"{cat:<11}" + "".join(f"{r.get(c, 0):>{w}}" for c, w in zip(cols, widths))
                     + f"{r.get('max_close_s', 0.0):>12.2f}")
    if "frames" in res:
        lines.append(f"total: {res['frames']} frames in {res['seconds']:.1f}s = {res['frames_per_s']:.0f} frames/s"
                     f"{' (stopped by --seconds)' if res['capped'] else ''}; crashes {res['crashes']}, internal "
                     f"errors {res['internal_errors']}")
        lines.append(f"churn: {res.get('churn', {}).get('ids')} ids joined and left in "
                     f"{res.get('churn', {}).get('seconds', 0):.1f}s (ledger unchanged: {res.get('state_unchanged')}); "
                     f"partial INIT handed to the legitimate island after {res.get('partial_init_s', 0):.1f}s")
        lines.append(f"syncer RSS {res['rss_base_mib']:.0f} MiB before, peak growth {res['rss_growth_mib']:.1f} MiB, "
                     f"peak threads {res['peak_threads']}; state unchanged: {res.get('state_unchanged')}; "
                     f"checkpoint unchanged: {res.get('checkpoint_unchanged')}")
    lines.append("violations: " + ("none" if not res["violations"] else "\n  " + "\n  ".join(res["violations"])))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=100_000, help="hostile inputs to send (default 100000)")
    p.add_argument("--seconds", type=float, default=900.0, help="stop sending after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI setting: 3000 inputs, 0.5 s io timeout")
    p.add_argument("--io-timeout", type=float, default=1.0, help="the syncer's io and handshake timeouts")
    p.add_argument("--slack", type=float, default=3.0, help="seconds past the timeouts a close may take")
    p.add_argument("--churn", type=int, default=1500, help="ids that join and say BYE after the fuzz")
    p.add_argument("--concurrency", type=int, default=4, help="parallel hostile connections")
    p.add_argument("--max-rss-mib", type=float, default=256.0, help="bound on the syncer's RSS growth")
    p.add_argument("--log-level", default="ERROR", help="the syncer's log level (its log is kept in a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.frames = min(a.frames, 3000)
        a.io_timeout = min(a.io_timeout, 0.5)
        a.churn = min(a.churn, 150)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.serve:
        serve(json.loads(a.serve))
        return 0
    res = run(a)
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: v for k, v in res.items()}, f, indent=1, default=str)
    return 1 if res["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
