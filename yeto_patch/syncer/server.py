"""The syncer's network side: one reader thread and one writer thread per island connection, a scheduler
thread that merges due rounds, and a central lock/condition (the :class:`~.rounds.Coordinator`'s).

Message semantics are documented in docs/protocol.md ("Syncer protocol").  Pushes are validated, decoded and
folded on a small fold pool (never on the scheduler; the connection's reader goes on reading, with at most
two pushes per connection in flight), bases are streamed to each island by its writer
thread chunk by chunk from the live float32 base under the fragment's read lock (no second copy; a merge of
that fragment waits for the streams in flight), and requests to send a fragment's base coalesce: an island
that is slower than the merges receives the newest version only.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import xxhash

from ..wire import auth, codecs
from ..wire.frames import MAX_PAYLOAD, AuthError, MsgType, PeerError, ProtocolError, WireTimeout
from ..wire.message import encode_meta
from ..wire.transport import Connection, listen
from .checkpoint import CheckpointError, CheckpointWriter, read_checkpoint
from .layout import first_difference, normalize_manifest
from .merge import ChunkRunner
from .metrics import Metrics, Tape
from .rounds import Coordinator, MergeRecord, MergeSettings, Push, PushRefused, RoundSettings, capture, restore

__all__ = ["ServerConfig", "SyncerServer", "aligned_meta"]

log = logging.getLogger("yeto.syncer")
SEND_CHUNK = 4 << 20  # bytes per body piece handed to the transport
MAX_PUSHES_IN_FLIGHT = 2  # per connection, handed to the fold pool and not yet accepted/refused
BASE_WIRE = ("f32", "bf16", "int8", "int4")
BASE_UPDATES = ("int8", "int4")   # quantized change from the island's previous base, error carried to the next
#: What an unauthenticated peer may send: one HELLO (or PROBE); anything else is refused from its header, so a
#: hostile length or chunk total cannot make the syncer reserve memory before the MAC is checked.
HANDSHAKE_MAX = {t: 64 << 10 for t in MsgType if t not in (MsgType.CHUNK, MsgType.HELLO)}


def aligned_meta(meta: dict, align: int = 64) -> dict:
    """Pad ``meta`` (key ``"_pad"``) so that the message body starts ``align``-aligned in the payload: the
    receiver can then view float32 bodies in place."""
    m = dict(meta)
    m["_pad"] = ""
    n = 4 + len(encode_meta(m))
    m["_pad"] = " " * ((-n) % align)
    return m


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:7640"
    islands: int = 1
    fragments: int = 1
    key: Optional[bytes] = None
    insecure: bool = False
    merge: MergeSettings = field(default_factory=MergeSettings)
    rounds: RoundSettings = field(default_factory=RoundSettings)
    base_wire: str = "f32"
    checkpoint: Optional[str] = None
    checkpoint_every: int = 0
    background_checkpoint: bool = False
    resume: bool = False
    metrics_port: Optional[int] = None
    metrics_addr: str = "0.0.0.0"
    tape: Optional[str] = None
    merge_threads: Optional[int] = None
    heartbeat_s: Optional[float] = None  # default lease / 4
    io_timeout_s: float = 120.0
    handshake_timeout_s: float = 30.0
    final_ack_timeout_s: float = 60.0
    max_handshakes: int = 64   # connections not yet authenticated held at once (more are closed at once) ...
    max_handshakes_per_host: int = 16   # ... and from one address


def _host_of(sock) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


class _Session:
    def __init__(self, server: "SyncerServer", conn: Connection):
        self.server = server
        self.conn = conn
        self.island: Optional[str] = None
        self.incarnation = 0
        self.cv = threading.Condition()
        self.outbox: collections.deque = collections.deque()
        self.bases: "collections.OrderedDict[int, tuple[str, bool]]" = collections.OrderedDict()
        self.closed = False
        self.bye = False
        self.joined = False
        self.host = "?"
        self.final_acked: Optional[list] = None
        self.writer: Optional[threading.Thread] = None
        self.reader: Optional[threading.Thread] = None
        self.inflight = False
        self.pushes_inflight = 0
        self.held: dict = {}   # fragment -> version of the last base sent on this connection (writer thread)
        self.declared: Optional[list] = None   # HELLO's per-tensor digests of the weights the island holds

    def wait_pushes(self, timeout: float) -> None:
        """Wait (bounded) until the pushes this connection handed to the fold pool are accepted or refused."""
        end = time.monotonic() + timeout
        with self.cv:
            while self.pushes_inflight and time.monotonic() < end:
                self.cv.wait(0.05)

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until everything posted so far was sent."""
        end = time.monotonic() + timeout
        with self.cv:
            while (self.outbox or self.bases or self.inflight) and not self.closed:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self.cv.wait(min(left, 0.05))

    # ---------------------------------------------------------------------------------------- outbox
    def post(self, msg_type: MsgType, meta: dict) -> None:
        with self.cv:
            if not self.closed:
                self.outbox.append((msg_type, meta))
                self.cv.notify()

    def post_base(self, fragment: int, dtype: str, final: bool = False) -> None:
        """Ask the writer to send fragment's current base (coalesces; f32 and final win over bf16)."""
        with self.cv:
            if self.closed:
                return
            old = self.bases.pop(fragment, None)
            if old is not None:
                dtype = "f32" if "f32" in (dtype, old[0]) else "check" if "check" in (dtype, old[0]) else dtype
                final = final or old[1]
            self.bases[fragment] = (dtype, final)
            self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.conn.close()

    def writer_loop(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.closed and not self.outbox and not self.bases:
                        self.cv.wait()
                    if self.closed:
                        return
                    if self.outbox:
                        item = ("msg",) + self.outbox.popleft()
                    else:
                        frag, (dtype, final) = self.bases.popitem(last=False)
                        item = ("base", frag, dtype, final)
                    self.inflight = True
                if item[0] == "msg":
                    self.conn.send(item[1], item[2])
                else:
                    self.server._send_base(self, item[1], item[2], item[3])
                with self.cv:
                    self.inflight = False
                    self.cv.notify_all()
        except (ProtocolError, OSError) as e:
            if not self.closed and not self.server.final_done:
                log.warning("island %s: send failed (%s); closing its connection", self.island, e)
            self.close()


class SyncerServer:
    def __init__(self, cfg: ServerConfig):
        if cfg.base_wire not in BASE_WIRE:
            raise ValueError(f"base wire dtype must be one of {BASE_WIRE}, got {cfg.base_wire!r}")
        if cfg.key is None:
            auth.check_insecure(cfg.listen, cfg.insecure)
        if cfg.background_checkpoint and not cfg.checkpoint:
            raise ValueError("background checkpoints need a checkpoint path")
        self.cfg = cfg
        self.runner = ChunkRunner(cfg.merge_threads)
        self.coord = Coordinator(cfg.merge, cfg.rounds, self.runner)
        if cfg.base_wire in BASE_UPDATES:
            self.coord.down_codec = cfg.base_wire
        self.fold_pool = ThreadPoolExecutor(max(2, min(8, cfg.islands)), thread_name_prefix="yeto-fold")
        self.metrics = Metrics()
        self.tape = Tape(cfg.tape)
        self.writer = CheckpointWriter(cfg.checkpoint, cfg.background_checkpoint) if cfg.checkpoint else None
        self.coord.protect = self.writer.protect if self.writer else None
        self.heartbeat_s = cfg.heartbeat_s or max(0.05, cfg.rounds.lease_s / 4)
        self.sessions: dict[str, _Session] = {}
        self.all_sessions: set = set()
        self.initializer: Optional[_Session] = None
        self.final_started = False
        self.final_done = False
        self.stopping = threading.Event()
        self._sock = None
        self._threads: list[threading.Thread] = []
        self.address: Optional[tuple] = None
        self.exit_code: Optional[int] = None
        self.records: list[MergeRecord] = []  # kept small: last few, for tests and status
        self._checkpoint_on_stop = False
        self._deferred: dict[int, float] = {}  # fragment -> since when its due merge waits for a base stream
        self._shut = False
        self._next_flood_log = 0.0
        self._shutdown_lock = threading.Lock()
        if cfg.checkpoint:
            d = os.path.dirname(os.path.abspath(cfg.checkpoint))
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                raise CheckpointError(f"checkpoint directory {d} does not exist or is not writable")
        if cfg.checkpoint and cfg.resume:
            meta, arrays = read_checkpoint(cfg.checkpoint)
            if len(meta["layout"]) != cfg.fragments:
                raise CheckpointError(f"checkpoint {cfg.checkpoint} has {len(meta['layout'])} fragments; "
                                      f"--fragments is {cfg.fragments}")
            restore(self.coord, meta, arrays)
            log.info("resumed from %s: %d fragments at versions %s, %d merges so far", cfg.checkpoint,
                     len(self.coord.frags), self.coord.versions(), self.coord.merges_total)
        elif cfg.checkpoint and os.path.exists(cfg.checkpoint):
            raise CheckpointError(f"checkpoint {cfg.checkpoint} already exists: pass --resume to continue that run, "
                                  "or move it away to start a new one")

    # --------------------------------------------------------------------------------------- lifecycle
    def start(self) -> tuple:
        self._sock = listen(self.cfg.listen)
        self.address = self._sock.getsockname()[:2]
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_addr)
        for target, name in ((self._accept_loop, "yeto-accept"), (self._schedule_loop, "yeto-scheduler")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("syncer listening on %s:%d (%d islands, %d fragments, %s)", self.address[0], self.address[1],
                 self.cfg.islands, self.cfg.fragments, self.cfg.merge.resolved())
        return self.address

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._threads[1].join(timeout)
        return self.exit_code

    def stop(self, checkpoint: bool = False) -> None:
        """Stop without a final cut: no new merges. ``checkpoint`` (SIGINT/SIGTERM) first writes the committed
        state (pushes of rounds that did not merge are not in it); otherwise the last checkpoint stays."""
        self._checkpoint_on_stop = checkpoint and self.writer is not None
        self.stopping.set()
        with self.coord.cond:
            self.coord.cond.notify_all()
        sched = self._threads[1] if len(self._threads) > 1 else None
        if sched is not None and sched is not threading.current_thread():
            sched.join(self.cfg.io_timeout_s)
        self._shutdown()

    def _shutdown(self) -> None:
        with self._shutdown_lock:
            if self._shut:
                return
            self._shut = True
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        sessions = list(self.all_sessions)
        for s in sessions:
            s.close()
        for s in sessions:  # bounded: their sockets are closed, so they return promptly
            for t in (s.reader, s.writer):
                if t is not None and t is not threading.current_thread():
                    t.join(2)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)
        if self.writer is not None:
            try:
                self.writer.wait()
            except CheckpointError as e:
                log.error("%s", e)
        self.fold_pool.shutdown(wait=True, cancel_futures=True)
        self.metrics.close()
        self.tape.close()
        self.runner.close()

    # ------------------------------------------------------------------------------------------ accept
    def _accept_loop(self) -> None:
        self._sock.settimeout(0.2)  # close() does not wake a blocked accept(): poll the stop flag
        while not self.stopping.is_set():
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            host = _host_of(sock)
            waiting = [x for x in list(self.all_sessions) if not x.joined and not x.closed]
            pending = len(waiting)
            if pending >= self.cfg.max_handshakes or \
                    sum(1 for x in waiting if x.host == host) >= self.cfg.max_handshakes_per_host:
                # bounds what strangers can hold (a HELLO buffer and a thread each) however many connect
                now = time.monotonic()
                if now >= self._next_flood_log:
                    self._next_flood_log = now + 10.0
                    log.warning("%d connections (from %s: %d) are still in their handshake (--max-handshakes); "
                                "closing new ones until they finish", pending, host,
                                sum(1 for x in waiting if x.host == host))
                sock.close()
                continue
            sock.settimeout(None)
            conn = Connection(sock, timeout=self.cfg.io_timeout_s, max_payload=HANDSHAKE_MAX,
                              max_reassembly_bytes=MAX_PAYLOAD[MsgType.HELLO])
            s = _Session(self, conn)
            s.host = host
            self.all_sessions.add(s)
            s.reader = threading.Thread(target=self._session_main, args=(s,), daemon=True,
                                        name=f"yeto-conn-{conn.peer}")
            s.reader.start()

    def _refuse(self, s: _Session, code: str, message: str) -> None:
        log.warning("refusing %s (%s): %s", s.island or s.conn.peer, code, message)
        try:
            s.conn.send_error(code, message)
        except ProtocolError:
            pass

    def _session_main(self, s: _Session) -> None:
        try:
            if self._handshake(s):
                s.conn.set_limits(self._island_max())
                s.writer = threading.Thread(target=s.writer_loop, daemon=True, name=f"yeto-send-{s.island}")
                s.writer.start()
                self._read_loop(s)
        except PeerError as e:
            log.warning("island %s sent an error: %s", s.island, e)
        except (ProtocolError, OSError) as e:
            if not s.closed and not self.stopping.is_set():
                log.warning("island %s: connection lost: %s", s.island or s.conn.peer, e)
                if isinstance(e, ProtocolError) and not isinstance(e, WireTimeout):
                    try:   # a framing error: tell the peer why before closing (best effort)
                        s.conn.send_error("protocol", str(e)[:1000])
                    except (ProtocolError, OSError):
                        pass
        except Exception:  # noqa: BLE001 - a bug must not take the syncer down
            log.exception("island %s: internal error in its connection handler", s.island)
            self._refuse(s, "internal", "internal error in the syncer (see its log)")
        finally:
            self._session_closed(s)

    # --------------------------------------------------------------------------------------- handshake
    def _handshake(self, s: _Session) -> bool:
        cfg = self.cfg
        server_nonce = auth.new_nonce()
        s.conn.send(MsgType.CHALLENGE, {"nonce": server_nonce.hex(), "protocol": 1,
                                        "auth": cfg.key is not None})
        # the whole HELLO within the handshake timeout: a peer trickling bytes cannot hold the connection
        t, meta, _ = s.conn.recv(timeout=cfg.handshake_timeout_s, within=cfg.handshake_timeout_s)
        if t not in (MsgType.HELLO, MsgType.PROBE):
            self._refuse(s, "protocol", f"expected HELLO or PROBE, got {t.name}")
            return False
        try:
            island = meta["island_id"]
            incarnation = meta["incarnation"]
            client_nonce = bytes.fromhex(meta["nonce"])
            digest = bytes.fromhex(meta["manifest_digest"])
            mac = bytes.fromhex(meta.get("mac", ""))
            if not isinstance(island, str) or not island or len(island) > 256:
                raise ValueError("island_id must be a non-empty string of at most 256 characters")
        except (KeyError, ValueError, TypeError) as e:
            self._refuse(s, "protocol", f"malformed {t.name}: {e}")
            return False
        s.island = island
        try:
            if cfg.key is not None:
                auth.verify(auth.client_mac(cfg.key, server_nonce, client_nonce, island, incarnation, digest), mac,
                            what=f"{t.name} from island {island!r}")
            elif not meta.get("insecure"):
                raise AuthError("this syncer runs without a key (insecure, loopback only); the island must be "
                                "configured insecure too")
        except AuthError as e:
            self._refuse(s, "auth", str(e))
            return False
        smac = auth.server_mac(cfg.key, server_nonce, client_nonce, island, incarnation, digest).hex() \
            if cfg.key is not None else ""
        if t == MsgType.PROBE:
            s.conn.send(MsgType.WELCOME, {"probe": True, "server_mac": smac, **self.status()})
            return False
        try:
            manifest = normalize_manifest(meta.get("manifest"))
        except (ValueError, TypeError) as e:
            self._refuse(s, "manifest", f"bad manifest: {e}")
            return False
        held = meta.get("held")
        if held is not None:
            if not (isinstance(held, list) and len(held) == len(manifest) and all(
                    isinstance(h, str) and len(h) == 16 and all(c in "0123456789abcdef" for c in h) for h in held)):
                self._refuse(s, "protocol", "malformed HELLO: 'held' must hold one 16-hex-digit digest per tensor")
                return False
            s.declared = held
        if auth.manifest_digest(manifest) != digest:
            self._refuse(s, "auth", "the manifest does not match the authenticated manifest digest")
            return False
        coord = self.coord
        with coord.lock:
            if coord.manifest is None:
                if len(manifest) < cfg.fragments:
                    self._refuse(s, "manifest", f"the manifest has {len(manifest)} tensors, fewer than "
                                                f"--fragments {cfg.fragments}")
                    return False
                coord.set_manifest(manifest, cfg.fragments)
                log.info("manifest fixed by island %s: %d tensors, %d parameters, digest %s", island,
                         len(manifest), sum(f.numel for f in coord.frags), digest.hex()[:16])
            elif manifest != coord.manifest:
                self._refuse(s, "manifest", "this island's parameter manifest differs from the run's: "
                             + first_difference(coord.manifest, manifest))
                return False
            try:
                coord.join(island, str(incarnation))
            except PushRefused as e:
                self._refuse(s, e.code, e.message)
                return False
            s.incarnation = incarnation
            old = self.sessions.get(island)
            self.sessions[island] = s
            s.joined = True
            needs_init = self._pick_initializer(s) if not coord.initialized else []
            welcome = {"island_id": island, "server_mac": smac, "layout": coord.layout,
                       "numels": [f.numel for f in coord.frags], "fragments": len(coord.frags),
                       "versions": coord.versions() if coord.initialized else None, "needs_init": needs_init,
                       "base_wire": cfg.base_wire, "heartbeat_s": self.heartbeat_s,
                       "lease_s": cfg.rounds.lease_s, "islands": cfg.islands, "quorum": cfg.rounds.k,
                       "total_rounds": cfg.rounds.total_rounds, "manifest_digest": digest.hex(),
                       "final": self.final_started}
            if coord.initialized:  # queued now (the writer starts after WELCOME went out)
                for f in range(len(coord.frags)):
                    s.post_base(f, "check" if s.declared and not self.final_done else "f32", final=self.final_done)
        s.conn.send(MsgType.WELCOME, welcome)  # outside the central lock: a slow reader blocks only itself
        if old is not None and old is not s:
            log.info("island %s reconnected (incarnation %s); closing its previous connection", island, incarnation)
            old.close()
        log.info("island %s joined (incarnation %s)%s", island, incarnation,
                 " and will send INIT" if needs_init else "")
        self.metrics.connections.set(len(self.sessions))
        return True

    def _pick_initializer(self, joining: Optional[_Session]) -> list:
        """Choose the island whose INIT becomes the run's initial base (under coord.lock, before INIT is complete).
        An elastic roster (--quorum below --islands) takes the first island that joins. A fixed roster waits until
        all --islands islands are connected and takes the lowest island id, so the initial base (and with it a
        tau = 0 run, bit for bit) does not depend on which island connects first. Returns the fragments `joining`
        must INIT (its WELCOME carries them); another chosen island gets an INIT request."""
        if self.initializer is not None and not self.initializer.closed:
            return []
        self.initializer = None
        live = [x for x in self.sessions.values() if not x.closed]
        if self.cfg.rounds.k < self.cfg.islands:
            chosen = joining if joining is not None else (live[0] if live else None)
        else:
            chosen = min(live, key=lambda x: x.island) if len(live) >= self.cfg.islands else None
        if chosen is None:
            return []
        self.initializer = chosen
        if chosen is joining:
            return self.coord.missing_init()
        log.info("island %s initializes the run (%s)", chosen.island, "the first to join" if
                 self.cfg.rounds.k < self.cfg.islands else "the lowest id of the complete roster")
        chosen.post(MsgType.INIT, {"request": self.coord.missing_init()})
        return []

    def _island_max(self) -> dict:
        """Per-type maxima for an authenticated island: INIT and PUSH bodies are one fragment (int8 with block 1
        is the largest encoding), plus room for the meta; the other messages are small."""
        bulk = codecs.encoded_nbytes("int8", max(f.numel for f in self.coord.frags), 1) + (1 << 20)
        return {**{t: 1 << 20 for t in MsgType if t != MsgType.CHUNK}, MsgType.INIT: bulk, MsgType.PUSH: bulk}

    def status(self) -> dict:
        c = self.coord
        with c.lock:
            return {"initialized": c.initialized, "versions": c.versions() if c.frags else [],
                    "fragments": len(c.frags) or self.cfg.fragments, "islands": self.cfg.islands,
                    "members": c.alive_members(), "merges_total": c.merges_total,
                    "final": self.final_started,
                    "manifest_digest": auth.manifest_digest(c.manifest).hex() if c.manifest else None}

    # ------------------------------------------------------------------------------------------ reading
    def _read_loop(self, s: _Session) -> None:
        coord = self.coord
        next_hb = time.monotonic() + self.heartbeat_s
        while not s.closed and not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_hb:
                s.post(MsgType.HEARTBEAT, {"t": time.time()})
                next_hb = now + self.heartbeat_s
            try:
                t, meta, body = s.conn.recv(timeout=min(1.0, self.heartbeat_s))
            except WireTimeout:
                if s.conn.broken:
                    raise
                continue
            coord.touch(s.island)
            if t == MsgType.HEARTBEAT:
                continue
            if t == MsgType.PUSH:
                self._on_push(s, meta, body)
            elif t == MsgType.INIT:
                self._on_init(s, meta, body)
            elif t == MsgType.FINAL:
                last = meta.get("last_step", 0)
                if isinstance(last, bool) or not isinstance(last, int) or last < 0:
                    self._refuse(s, "protocol", f"malformed FINAL: last_step={last!r} (need an integer >= 0)")
                    return
                s.wait_pushes(self.cfg.io_timeout_s)  # its final pushes count before the cut
                coord.finish(s.island, last)
                log.info("island %s reached its last step (%s)", s.island, meta.get("last_step"))
            elif t == MsgType.ACK:
                s.final_acked = meta.get("versions")
                with coord.cond:
                    coord.cond.notify_all()
            elif t == MsgType.BYE:
                s.wait_pushes(self.cfg.io_timeout_s)
                s.bye = True
                log.info("island %s said goodbye", s.island)
                return
            else:
                self._refuse(s, "protocol", f"unexpected {t.name} message")
                return

    def _on_init(self, s: _Session, meta: dict, body) -> None:
        coord = self.coord
        if coord.initialized:
            log.info("island %s sent INIT of fragment %s after the run was initialized; ignored", s.island,
                     meta.get("fragment"))
            return
        if s is not self.initializer:
            self._refuse(s, "init", "INIT not expected from this island (another island initializes the run)")
            s.close()
            return
        try:
            idx = int(meta["fragment"])
            mv = memoryview(body).cast("B")
            if meta.get("dtype", "f32") != "f32" or mv.nbytes % 4:
                raise PushRefused("bad-init", "INIT bodies are float32")
            arr = np.frombuffer(mv, np.float32)
            if arr.ctypes.data % 4 or not arr.flags.writeable:
                arr = arr.copy()
            done = coord.init_fragment(idx, arr)
        except (PushRefused, KeyError, ValueError, TypeError) as e:
            msg = e.message if isinstance(e, PushRefused) else f"malformed INIT: {e}"
            self._refuse(s, "init", msg)
            s.close()
            return
        self.metrics.bytes_in.labels("init").inc(mv.nbytes)
        if done:
            log.info("run initialized from island %s's INIT (%d fragments)", s.island, len(coord.frags))
            if self.writer is not None:  # version 0 on disk before any island trains from it
                self._checkpoint(final=False)
            for other in list(self.sessions.values()):
                for f in range(len(coord.frags)):
                    other.post_base(f, "check" if other.declared else "f32")

    def _on_push(self, s: _Session, meta: dict, body) -> None:
        def count(name):
            v = meta.get(name, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}={v!r} (need an integer >= 0)")
            return v

        try:
            p = Push(island=s.island, fragment=meta["fragment"], base_version=meta["base_version"],
                     codec=str(meta["codec"]), block=count("block") or codecs.DEFAULT_BLOCK, body=body,
                     local_step=count("local_step"), steps=count("steps"), tokens=count("tokens"),
                     final=bool(meta.get("final", False)), incarnation=str(s.incarnation))
        except (KeyError, ValueError, TypeError) as e:
            s.post(MsgType.PUSH_REPLY, {"fragment": meta.get("fragment"), "base_version": meta.get("base_version"),
                                        "status": "refused", "code": "bad-push",
                                        "message": f"malformed PUSH: missing or bad field {e}"})
            return
        self.metrics.bytes_in.labels("push").inc(memoryview(body).nbytes)
        # validate/decode/fold on the fold pool so this connection's reader goes on (heartbeats, the next
        # push); at most MAX_PUSHES_IN_FLIGHT per connection (back-pressure bounds the memory held)
        with s.cv:
            while s.pushes_inflight >= MAX_PUSHES_IN_FLIGHT and not s.closed:
                s.cv.wait(0.5)
            s.pushes_inflight += 1
        try:
            self.fold_pool.submit(self._process_push, s, p)
        except RuntimeError:  # the pool is shut down: the syncer is stopping
            with s.cv:
                s.pushes_inflight -= 1
                s.cv.notify_all()

    def _process_push(self, s: _Session, p: Push) -> None:
        try:
            self._accept_push(s, p)
        except Exception:  # noqa: BLE001 - a bug must not take the syncer down
            log.exception("internal error while accepting a push from island %s", s.island)
            s.post(MsgType.PUSH_REPLY, {"fragment": p.fragment, "base_version": p.base_version, "status": "refused",
                                        "code": "internal", "message": "internal error in the syncer (see its log)"})
        finally:  # (the coordinator owns p.body now: held for carried/exact pushes, released after a fold)
            with s.cv:
                s.pushes_inflight -= 1
                s.cv.notify_all()

    def _accept_push(self, s: _Session, p: Push) -> None:
        reply = {"fragment": p.fragment, "base_version": p.base_version}
        try:
            status, lag = self.coord.accept(p)
            reply.update(status=status, lag=lag)
            if status == "closed":
                reply["message"] = "this fragment takes no more pushes (final cut / total rounds reached)"
        except PushRefused as e:
            log.warning("refused push of fragment %s (base v%s) from island %s: %s", p.fragment, p.base_version,
                        s.island, e.message)
            reply.update(status="refused", code=e.code, message=e.message)
            status = "refused"
        self.metrics.pushes.labels(status).inc()
        if p.fragment is not None and isinstance(p.fragment, int) and 0 <= p.fragment < len(self.coord.frags):
            reply["version"] = self.coord.frags[p.fragment].version
        s.post(MsgType.PUSH_REPLY, reply)
        with self.coord.cond:
            self.coord.cond.notify_all()

    def _session_closed(self, s: _Session) -> None:
        s.close()
        self.all_sessions.discard(s)
        coord = self.coord
        if s.joined:
            with coord.lock:
                if self.sessions.get(s.island) is s:
                    del self.sessions[s.island]
                coord.disconnected(s.island, s.bye)
                if self.initializer is s and not coord.initialized:
                    # INIT must come from one island: drop a partial INIT and ask another island
                    for f in coord.frags:
                        f.t.base = None
                    self.initializer = None
                    self._pick_initializer(None)
                    log.warning("initializing island %s left before INIT completed; %s", s.island,
                                f"asking island {self.initializer.island}" if self.initializer is not None
                                else "waiting for the roster to be complete again")
                coord.cond.notify_all()
            log.info("island %s disconnected%s", s.island, " (goodbye)" if s.bye else "")
        self.metrics.connections.set(len(self.sessions))

    # ------------------------------------------------------------------------------------------ sending
    def _send_base(self, s: _Session, frag: int, dtype: str, final: bool) -> None:
        f = self.coord.frags[frag]
        f.rw.acquire_read()
        try:
            if not final and s.held.get(frag) == f.version:
                return   # this connection already carried this version (an island joining while INIT completed)
            # islands hold the shadow when bases go out as updates (the final model is the base itself)
            base = f.t.base if final or f.t.shadow is None else f.t.shadow
            n = f.numel
            update = (dtype in BASE_UPDATES and not final and f.down is not None and f.down_version == f.version
                      and s.held.get(frag) == f.version - 1)
            if dtype == "check":   # the island declared what it holds: skip the download when it is this base
                dtype = "held" if (not final and frag not in s.held
                                   and self._digests(f, base) == [s.declared[i] for i in self.coord.layout[frag]]) \
                    else "f32"
            if dtype in BASE_UPDATES and not update:
                dtype = "f32"   # the island does not hold the previous version: the full shadow
            meta = {"fragment": frag, "version": f.version, "dtype": dtype, "numel": n, "final": final}
            if update:
                meta.update(delta_from=f.version - 1, block=self.coord.down_block)
            meta = aligned_meta(meta)
            step = SEND_CHUNK // 4
            if dtype == "held":
                body_len, it = 0, iter(())
            elif update:
                body = memoryview(f.down).cast("B")
                body_len = body.nbytes
                it = (body[a:a + SEND_CHUNK] for a in range(0, body_len, SEND_CHUNK))
            elif dtype == "f32":
                body_len = 4 * n
                it = (memoryview(base[a:a + step]).cast("B") for a in range(0, n, step))
            else:
                body_len = 2 * n
                it = (codecs.encode("bf16", base[a:a + step], name=f"fragment {frag}", threads=1)
                      for a in range(0, n, step))
            s.conn.send(MsgType.FINAL_BASE if final else MsgType.BASE, meta, body_len=body_len, body_iter=it)
            s.held[frag] = f.version
        finally:
            f.rw.release_read()
        self.metrics.bytes_out.labels("final" if final else "base").inc(body_len)

    def _digests(self, f, arr) -> list:
        """xxh3_64 of each tensor of fragment f in ``arr`` (f32 little-endian bytes), cached per version (called
        under the fragment's read lock)."""
        key = (f.version, id(arr))
        if f.digests is not None and f.digests[0] == key:
            return f.digests[1]
        out, off = [], 0
        for i in self.coord.layout[f.index]:
            n = int(np.prod(self.coord.manifest[i][1], dtype=np.int64))
            out.append(xxhash.xxh3_64_hexdigest(memoryview(arr[off:off + n]).cast("B")))
            off += n
        f.digests = (key, out)
        return out

    # ---------------------------------------------------------------------------------------- scheduling
    def _schedule_loop(self) -> None:
        try:
            code = self._schedule()
        except Exception:  # noqa: BLE001
            log.exception("syncer scheduler failed")
            code = 1
        if self._checkpoint_on_stop and not self.final_done and self.coord.initialized:
            try:
                self._checkpoint(final=False)
                log.info("stopped: committed state checkpointed to %s (versions %s)", self.cfg.checkpoint,
                         self.coord.versions())
            except CheckpointError as e:
                log.error("%s", e)
                code = 1
        self.exit_code = code
        self.stopping.set()
        self._shutdown()

    def _schedule(self) -> int:
        coord = self.coord
        while not self.stopping.is_set():
            with coord.cond:
                dl = coord.next_deadline()
                wait = 0.25 if dl is None else min(0.25, max(0.0, dl - coord.clock()))
                if self._deferred:
                    wait = max(wait, 0.02)  # retry deferred merges without spinning
                coord.cond.wait(wait)
            if self.stopping.is_set():
                return 0
            self.metrics.members.set(len(coord.alive_members()))
            if not coord.initialized:
                continue
            now = time.monotonic()
            due = coord.due()
            for idx in due:
                # a base of this fragment still streaming to a slow island: merge the other fragments first;
                # wait for the stream only after --io-timeout (the merge writes the base in place)
                since = self._deferred.setdefault(idx, now)
                rec = coord.merge(idx, wait_streams=now - since >= self.cfg.io_timeout_s)
                if rec is not None:
                    self._deferred.pop(idx, None)
                    self._after_merge(rec, broadcast=True)
                elif now == since:
                    log.info("fragment %d: merge waits for its base to finish streaming to an island", idx)
            for idx in [i for i in self._deferred if i not in due]:
                self._deferred.pop(idx, None)
            if coord.all_closed() or coord.all_finished():
                return self._final_cut()
        return 0

    def _after_merge(self, rec: MergeRecord, broadcast: bool) -> None:
        (log.info if rec.ok else log.error)("%s", rec.line())
        self.tape.write(rec.tape())
        self.metrics.record_merge(rec)
        self.records.append(rec)
        del self.records[:-64]
        if not rec.ok:
            return
        # The checkpoint goes first: with --checkpoint-every 1 (written in the foreground) every base an island
        # ever receives is on disk, so a syncer killed at any moment resumes at or past every island's base and
        # the islands only re-push what it had not merged.
        n = self.cfg.checkpoint_every
        if self.writer is not None and n and self.coord.merges_total % n == 0:
            self._checkpoint(final=False)
        if broadcast:
            for s in list(self.sessions.values()):
                s.post_base(rec.fragment, self.cfg.base_wire)

    def _checkpoint(self, final: bool) -> None:
        snap = capture(self.coord, {"final": final})
        self.writer.save(snap, background=False if final else None)
        self.metrics.checkpoint_seconds.set(self.writer.last_seconds)

    def _final_cut(self) -> int:
        coord = self.coord
        self.final_started = True
        why = "total rounds reached" if coord.all_closed() else "every island reached its last step"
        log.info("final cut: %s; merging the last round of every fragment", why)
        # wait (bounded) for pushes still being folded
        for f in range(len(coord.frags)):
            if coord.pending(f):
                rec = coord.merge(f, force=True)
                if rec is not None:
                    self._after_merge(rec, broadcast=False)
        with coord.lock:
            for f in coord.frags:
                f.closed = True
            self.final_done = True
            targets = [s for s in self.sessions.values() if not s.closed]
            for s in targets:
                for f in range(len(coord.frags)):
                    s.post_base(f, "f32", final=True)
        versions = coord.versions()
        log.info("final model: versions %s; sent to %d island(s), waiting up to %.0fs for acknowledgements",
                 versions, len(targets), self.cfg.final_ack_timeout_s)
        deadline = time.monotonic() + self.cfg.final_ack_timeout_s
        with coord.cond:
            while True:
                missing = [s.island for s in targets if s.final_acked is None and not s.closed]
                if not missing or time.monotonic() >= deadline or self.stopping.is_set():
                    break
                coord.cond.wait(min(0.25, max(0.0, deadline - time.monotonic())))
        acked = [s.island for s in targets if s.final_acked is not None]
        bad = [s.island for s in targets if s.final_acked is not None and s.final_acked != versions]
        if missing:
            log.warning("final cut: no acknowledgement from %s", missing)
        if bad:
            log.warning("final cut: islands %s acknowledged other versions", bad)
        log.info("final cut acknowledged by %s", acked)
        if self.writer is not None:
            self._checkpoint(final=True)
        for s in targets:
            s.post(MsgType.BYE, {"reason": "final cut done"})
        for s in targets:  # let the goodbye go out (bounded)
            s.drain(2.0)
        log.info("syncer done: %d merges, final versions %s", coord.merges_total, versions)
        return 0
