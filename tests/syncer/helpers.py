"""Scripted islands over loopback against an in-process syncer."""
import contextlib
import logging
import threading

import numpy as np

from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.syncer.net.server import ServerConfig, SyncerServer
from yeto_patch.wire.client import SyncerClient

KEY = b"k" * 32
MANIFEST = [("embedding.word_embeddings.weight", (64, 16), "float32"),
            ("decoder.layers.0.self_attention.linear_qkv.weight", (48, 16), "float32"),
            ("decoder.layers.0.mlp.linear_fc1.weight", (32, 16), "float32"),
            ("decoder.layers.0.mlp.linear_fc1.bias", (32,), "float32"),
            ("decoder.layers.1.mlp.linear_fc2.weight", (16, 32), "float32"),
            ("decoder.final_layernorm.weight", (16,), "float32")]


def init_values(manifest=MANIFEST, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for _, s, _ in manifest]


def fragment_flat(values, layout, f):
    return np.concatenate([values[i].reshape(-1) for i in layout[f]])


def make_server(islands=2, fragments=3, key=KEY, merge=None, rounds=None, **kw):
    """An in-process syncer. Unless told otherwise its rounds use a fixed roster (quorum = islands), a grace of
    0.2 s, equal weights and max-base-lag 1, so scripted islands know exactly which pushes each merge holds; tests
    of the elastic defaults pass ``rounds={"quorum": None, "grace_s": None}`` and the merge settings they check."""
    rs = dict(rounds or {})
    ms = dict(merge or {})
    ms.setdefault("weights", "equal")
    ms.setdefault("max_base_lag", 1)
    merge = ms
    rs.setdefault("islands", islands)
    rs.setdefault("quorum", islands)
    rs.setdefault("grace_s", 0.2)
    rs.setdefault("timeout_s", 30.0)
    rs.setdefault("lease_s", 20.0)
    kw.setdefault("initializer", "first")   # the scripted islands join one by one (test_initializer.py: the rest)
    cfg = ServerConfig(listen="127.0.0.1:0", islands=islands, fragments=fragments, key=key,
                       insecure=key is None, merge=MergeSettings(**(merge or {})), rounds=RoundSettings(**rs),
                       merge_threads=kw.pop("merge_threads", 2), **kw)
    s = SyncerServer(cfg)
    host, port = s.start()
    return s, f"{host}:{port}"


def client(addr, island, key=KEY, manifest=MANIFEST, **kw):
    kw.setdefault("timeout", 20.0)
    kw.setdefault("connect_retries", 2)
    c = SyncerClient(addr, key, island, manifest, insecure=key is None, **kw)
    return c


def join_all(addr, names, values=None, **kw):
    """Connect islands ``names``; the one the syncer picks INITs the run with ``values`` (the first to join, or
    with a fixed roster the lowest id once all joined); returns (clients, welcomes, layout, the bases each
    received). The islands wait for their initial bases at the same time, as real islands do."""
    values = values if values is not None else init_values()
    cs = [client(addr, n, **kw) for n in names]
    ws = [c.connect() for c in cs]
    layout = ws[0].layout
    src = lambda f: [values[i] for i in layout[f]]  # noqa: E731
    bases, errors = [None] * len(cs), []

    def ready(k):
        try:
            bases[k] = cs[k].wait_ready(20, init_source=src)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=ready, args=(k,), daemon=True) for k in range(len(cs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return cs, ws, layout, bases


def finish_all(cs, last_step):
    """Every island's final cut at once (the syncer ends the run when all reached their last step)."""
    results = [None] * len(cs)

    def fin(k):
        results[k] = cs[k].finish(last_step=last_step, timeout=20)

    th = [threading.Thread(target=fin, args=(k,)) for k in range(len(cs))]
    [t.start() for t in th]
    [t.join(30) for t in th]
    return results


@contextlib.contextmanager
def running(server):
    try:
        yield server
    finally:
        server.stop()


def quiet():
    logging.getLogger("yeto").setLevel(logging.INFO)


def state_of(server):
    """Everything a hostile input must not change: committed arrays (hashed), versions, merge count, the island
    ledger, and what is pending (open rounds, carried pushes, accepted keys, islands' final fragments)."""
    import hashlib

    from yeto_patch.syncer.model.snapshot import capture

    snap = capture(server.coord)
    h = hashlib.sha256()
    for arrays in snap.arrays:
        for name in sorted(arrays):
            h.update(name.encode())
            h.update(arrays[name].tobytes())
    c = server.coord
    with c.lock:
        pending = [(sorted(c.rounds[f.index].answers), len(c.rounds[f.index].carried), f.closed) for f in c.frags]
        finals = {i: (sorted(m.final_fragments), m.finished) for i, m in c.members.items()}
        seen = sorted(c.seen)
    return {"arrays": h.hexdigest(), "versions": [f["version"] for f in snap.meta["fragments"]],
            "merges_total": snap.meta["merges_total"], "ledger": snap.meta["ledger"], "pending": pending,
            "finals": finals, "seen": seen}


class SealedFrames:
    """Raw frames an island sends after its handshake, sealed as the handshake agreed (wire/secure.py), for tests
    that write partial or hand-made messages on the socket. One instance per connection: it owns the sequence."""

    def __init__(self, key: bytes, encrypt: bool = False):
        from yeto_patch.wire import secure
        self._sealer = secure.Sealer(key, encrypt)
        self._flags = secure.FLAG_AUTH | (secure.FLAG_ENC if encrypt else 0)

    def _frame(self, msg_type, parts: list, clear: int) -> bytes:
        from yeto_patch.wire.frames import encode_header
        header = encode_header(msg_type, sum(len(p) for p in parts), 0, self._flags)
        out, tag = self._sealer.seal(header, parts, clear=clear)
        return header + b"".join(bytes(p) for p in out) + tag

    def chunk(self, msg_id: int, inner, total: int, offset: int, data: bytes) -> bytes:
        import struct
        from yeto_patch.wire.frames import MsgType
        return self._frame(MsgType.CHUNK, [struct.pack("<QHHQQ", msg_id, inner, 0, total, offset), data], 1)

    def message(self, msg_type, meta: dict, body: bytes = b"") -> bytes:
        from yeto_patch.wire.message import pack_meta
        return self._frame(msg_type, [pack_meta(meta, len(body)) + body], 0)


def raw_hello(addr, island: str, digest: bytes, key: bytes = KEY, incarnation: int = 1):
    """Connect and send a HELLO by hand, then protect the connection with the session keys the handshake agreed;
    returns (connection, island -> syncer frame key, encrypt)."""
    from yeto_patch.wire.frames import MsgType
    from yeto_patch.wire.handshake import IslandHello
    from yeto_patch.wire.transport import connect
    conn = connect(addr, timeout=10, retries=2)
    _, ch, _ = conn.recv()
    hello = IslandHello(ch, key, island, incarnation, digest)
    conn.send(MsgType.HELLO, hello.meta)
    sess = hello.session()
    conn.protect(sess.c2s, sess.s2c, sess.encrypt, clear_error_first=True)
    return conn, sess.c2s, sess.encrypt


def raw_join(addr, island: str, manifest, key: bytes = KEY, incarnation: int = 1):
    """An island's handshake by hand (no SyncerClient): returns (connection protected as agreed, SealedFrames
    for raw frames on its socket, which sealed the MANIFEST). Send raw frames on the socket after it, not with the
    connection (its sequence did not count the MANIFEST); receive with the connection."""
    from yeto_patch.wire import auth
    from yeto_patch.wire.frames import MsgType
    conn, c2s, encrypt = raw_hello(addr, island, auth.manifest_digest(manifest), key, incarnation)
    t, _, _ = conn.recv()
    assert t == MsgType.HELLO_OK
    frames = SealedFrames(c2s, encrypt)
    conn.sock.sendall(frames.message(MsgType.MANIFEST, manifest_meta(manifest)))   # frame 0 of the sequence
    t, _, _ = conn.recv()
    assert t == MsgType.WELCOME
    return conn, frames


def hello_meta(challenge: dict, island: str, incarnation: int, nonce: bytes, digest: bytes, key=KEY) -> dict:
    """A HELLO meta (protocol 3) for ``challenge``, its MAC made with ``key`` (None: insecure) over the transcript.
    Its ephemeral key is a fresh one nobody keeps: for HELLOs whose session is never used."""
    from yeto_patch.wire import secure
    hello = {"island_id": island, "incarnation": incarnation, "nonce": nonce.hex(), "manifest_digest": digest.hex(),
             "insecure": key is None, "protocol": 3,
             "ephemeral": secure.Ephemeral().public.hex() if key is not None else ""}
    hello["mac"] = secure.hello_mac(key, secure.transcript(challenge, hello)).hex() if key is not None else ""
    return hello


def manifest_meta(manifest, **extra) -> dict:
    """The MANIFEST meta an island sends after HELLO_OK."""
    return {"manifest": [[n, list(s), d] for n, s, d in manifest], **extra}
