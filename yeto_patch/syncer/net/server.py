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

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from ...wire import auth, codec_names
from ...wire.frames import MAX_PAYLOAD, BrokenHere, FrameAuthError, MsgType, PeerError, ProtocolError, WireTimeout
from ...wire.transport import Connection, listen
from .admission import HandshakeSlots, host_of
from ..model.checkpoint import CheckpointError, CheckpointWriter
from ..config import ServerConfig
from .final_cut import await_acks, goodbye
from ..model.guard import NormGuard
from ...wire.text import printable
from ..model.initializer import InitChoice, Initializing
from ..model.initializer import take_init
from ..model.limits import InitWatch, island_buffer_bytes, island_max
from ..model.runner import ChunkRunner
from .handshake import HandshakeMemory, accept_handshake
from ..observe.metrics import Metrics, Tape
from ..rounds.records import MergeRecord
from ..rounds.coordinator import Coordinator
from ..observe.status_page import StatusPage
from .session import Session as _Session
from .registry import Registry
from ..rounds.pushes import ReceivedPush, PushRefused, parse_push, refusal, reply_for
from ...wire.schema import SchemaError, read_ack, read_final, read_island_beat, syncer_beat_meta
from ..model.snapshot import capture, open_checkpoint

__all__ = ["ServerConfig", "SyncerServer"]

log = logging.getLogger("yeto.syncer")
MAX_PUSHES_IN_FLIGHT = 2  # per connection, handed to the fold pool and not yet accepted/refused
#: What an unauthenticated peer may send: one HELLO (or PROBE) of at most 64 KiB; anything larger is refused from
#: its header, so a hostile length or chunk total cannot make the syncer read or reserve more before the MAC is
#: checked. The MANIFEST limit is raised to its protocol maximum once the HELLO passed (syncer/net/handshake.py).
HANDSHAKE_MAX = {t: 64 << 10 for t in MsgType if t != MsgType.CHUNK}


class SyncerServer:
    def __init__(self, cfg: ServerConfig):
        if not codec_names.base_wire_ok(cfg.base_wire):
            raise ValueError(f"base wire dtype must be one of {codec_names.describe_base_wire()}, got "
                             f"{cfg.base_wire!r}")
        if cfg.key is None and not cfg.island_keys:
            auth.check_insecure(cfg.listen, cfg.insecure)
        if cfg.background_checkpoint and not cfg.checkpoint:
            raise ValueError("background checkpoints need a checkpoint path")
        self.cfg = cfg
        self.runner = ChunkRunner(cfg.merge_threads)
        self.writer = CheckpointWriter(cfg.checkpoint, cfg.background_checkpoint) if cfg.checkpoint else None
        self.heartbeat_s = cfg.heartbeat_s or max(0.05, cfg.rounds.lease_s / 4)
        guard = NormGuard(cfg.max_push_norm_ratio, self.runner, cfg.first_push_growth, single=cfg.islands == 1) \
            if cfg.max_push_norm_ratio else None
        rounds = dataclasses.replace(cfg.rounds, roster_wait_s=cfg.init_wait_s)   # (FINALs: rounds/roster.py)
        self.coord = Coordinator(cfg.merge, rounds, self.runner, shard=cfg.shard, guard=guard,
                                 down_codec=cfg.base_wire if codec_names.is_base_update(cfg.base_wire) else None,
                                 protect=self.writer.protect if self.writer else None,
                                 heartbeat_s=self.heartbeat_s)   # (a lost link counts as up for one heartbeat)
        self.fold_pool = ThreadPoolExecutor(max(2, min(8, cfg.islands)), thread_name_prefix="yeto-fold")
        self.metrics = Metrics()
        self.metrics.shard.labels(str(cfg.shard.index), str(cfg.shard.count)).set(1)
        self.tape = Tape(cfg.tape)
        self.registry = Registry()   # the island connections (net/registry.py)
        self.handshakes = HandshakeMemory()   # strangers' log budget, resumption secrets (net/handshake.py)
        self.slots = HandshakeSlots(cfg.max_handshakes, cfg.max_handshakes_per_host)
        self.init = Initializing(InitChoice(cfg.initializer, cfg.islands, cfg.init_wait_s),
                                 InitWatch(cfg.init_timeout_s if cfg.init_timeout_s is not None
                                           else cfg.rounds.lease_s + cfg.io_timeout_s))
        self._init_lock = threading.Lock()
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
        self._shutdown_lock = threading.Lock()
        self.run_id = open_checkpoint(self.coord, cfg)   # --run-id, the resumed checkpoint's, or a new one

    # --------------------------------------------------------------------------------------- lifecycle
    def start(self) -> tuple:
        self._sock = listen(self.cfg.listen)
        self.address = self._sock.getsockname()[:2]
        if self.cfg.metrics_port is not None:
            page = StatusPage(self.metrics, self.coord, lambda: self.run_id, shard=str(self.cfg.shard))
            self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_addr,
                                                   pages={"/status": page.render})
        for target, name in ((self._accept_loop, "yeto-accept"), (self._schedule_loop, "yeto-scheduler")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("syncer %slistening on %s:%d (run %s, %d islands, %d fragments, %s)",
                 f"shard {self.cfg.shard} " if self.cfg.shard.sharded else "", self.address[0], self.address[1],
                 printable(self.run_id), self.cfg.islands, self.cfg.fragments, self.cfg.merge.resolved())
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
        sessions = self.registry.connections()
        for s in sessions:
            s.close()
        for s in sessions:  # bounded: their sockets are closed, so they return promptly
            for t in s.threads():
                if t is not threading.current_thread():
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
            host = host_of(sock)
            if not self.slots.admit(host, self.registry.connections(), lambda i: i in self.coord.members):
                sock.close()
                continue
            sock.settimeout(None)
            conn = Connection(sock, timeout=self.cfg.io_timeout_s, max_payload=HANDSHAKE_MAX,
                              max_reassembly_bytes=MAX_PAYLOAD[MsgType.HELLO])
            s = _Session(conn, self._send_base, lambda: self.final_done, host=host)
            self.registry.add(s)
            s.start(self._session_main)

    def _refuse(self, s: _Session, code: str, message: str) -> None:
        log.warning("refusing %s (%s): %s", s.island or s.conn.peer, code, message)
        try:
            s.conn.send_error(code, message)
        except ProtocolError:
            pass

    def _session_main(self, s: _Session) -> None:
        try:
            if self._handshake(s):
                most = island_max(max(f.numel for f in self.coord.frags))
                s.conn.set_limits(most, island_buffer_bytes(most[MsgType.PUSH], self.cfg.island_buffer_bytes))
                s.start_writer()
                self._read_loop(s)
        except PeerError as e:
            log.warning("island %s sent an error: %s", s.island, e)
        except BrokenHere as e:   # the writer's send failed and shut the socket down under this read
            s.send_failed(e)
        except (ProtocolError, OSError) as e:
            if not s.closed and not self.stopping.is_set():
                log.warning("island %s: connection lost: %s", s.island or s.conn.peer, e)
                if isinstance(e, ProtocolError) and not isinstance(e, WireTimeout):
                    try:   # a framing error: tell the peer why before closing (best effort; "integrity": a frame
                        # failed authentication on the path, the island reconnects)
                        s.conn.send_error("integrity" if isinstance(e, FrameAuthError) else "protocol", str(e)[:1000])
                    except (ProtocolError, OSError):
                        pass
        except Exception:  # noqa: BLE001 - a bug must not take the syncer down
            log.exception("island %s: internal error in its connection handler", s.island)
            self._refuse(s, "internal", "internal error in the syncer (see its log)")
        finally:
            self._session_closed(s)

    # --------------------------------------------------------------------------------------- handshake
    def _handshake(self, s: _Session) -> bool:
        return accept_handshake(self, s)   # syncer/net/handshake.py

    def close_lapsed(self, island: str) -> None:
        """(coordinator lock held) Before ``island`` joins: at most ``--islands`` joined connections stay open
        (each may hold its reassembly budget), so a connection whose island's lease ran out is closed now."""
        others = [x for i, x in self.registry.joined().items() if i != island and not x.closed]
        if len(others) < self.cfg.islands:
            return
        alive = set(self.coord.alive_members())
        for x in [x for x in others if x.island not in alive][:len(others) - self.cfg.islands + 1]:
            log.warning("closing the connection of island %s: its lease ran out and island %s takes its place",
                        printable(x.island), printable(island))
            x.close()

    def _check_init(self) -> None:
        """(scheduler) The initializing island stalled its INIT, or the wait for the roster ended
        (``Initializing.check``)."""
        if not self._init_lock.acquire(blocking=False):
            return   # an INIT is being installed right now: that is progress
        try:
            self.init.check(self.registry.joined(), self.coord)
        finally:
            self._init_lock.release()

    def pick_initializer(self, joining: Optional[_Session]) -> list:
        """(coord.lock held) The fragments `joining` must INIT, if the initializer policy chose it now (see
        syncer/model/initializer.py)."""
        return self.init.pick(self.registry.joined(), self.coord, joining)

    @property
    def sessions(self) -> dict:
        """Island id -> its joined connection (a copy; the registry owns them)."""
        return self.registry.joined()

    @property
    def all_sessions(self) -> list:
        """Every open connection (a copy)."""
        return self.registry.connections()

    def status(self) -> dict:
        c = self.coord
        with c.lock:
            return {"initialized": c.initialized, "versions": c.versions() if c.frags else [],
                    "fragments": len(c.frags) or self.cfg.fragments, "islands": self.cfg.islands,
                    "members": c.alive_members(), "merges_total": c.merges_total,
                    "final": self.final_started, "shard": self.cfg.shard.as_json(), "run_id": self.run_id,
                    "manifest_digest": auth.manifest_digest(c.manifest).hex() if c.manifest else None}

    # ------------------------------------------------------------------------------------------ reading
    def _read_loop(self, s: _Session) -> None:
        coord = self.coord
        next_hb = time.monotonic() + self.heartbeat_s
        while not s.closed and not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_hb:   # (what its rounds wait for rides along: island/link/patience.py logs it)
                s.post(MsgType.HEARTBEAT, syncer_beat_meta(time.time(), coord.round_status(s.island)))
                next_hb = now + self.heartbeat_s
            try:
                t, meta, body = s.conn.recv(timeout=min(1.0, self.heartbeat_s))
            except WireTimeout:
                if s.conn.broken:
                    raise
                continue
            if t == MsgType.HEARTBEAT:
                beat = read_island_beat(meta)
                coord.touch(s.island, beat.step, beat.rate, beat.pinned, beat.schedule)
                continue
            coord.touch(s.island)
            if t == MsgType.PUSH:
                self._on_push(s, meta, body)
            elif t == MsgType.INIT:
                self._on_init(s, meta, body)
            elif t == MsgType.FINAL:
                try:
                    last = read_final(meta)
                except SchemaError as e:
                    self._refuse(s, e.code, e.message)
                    return
                s.wait_pushes(self.cfg.io_timeout_s)  # its final pushes count before the cut
                coord.finish(s.island, last)
                log.info("island %s reached its last step (%d)", s.island, last)
            elif t == MsgType.ACK:
                s.acked(read_ack(meta, len(coord.frags)))   # kept only when it can be what the cut sent
                with coord.cond:
                    coord.cond.notify_all()
            elif t == MsgType.BYE:
                s.wait_pushes(self.cfg.io_timeout_s)
                s.said_bye()
                log.info("island %s said goodbye", s.island)
                return
            else:
                self._refuse(s, "protocol", f"unexpected {t.name} message")
                return

    def _on_init(self, s: _Session, meta: dict, body) -> None:
        with self._init_lock:   # the INIT-timeout check does not drop a claim while one of its INITs is installed
            self._on_init_locked(s, meta, body)

    def _on_init_locked(self, s: _Session, meta: dict, body) -> None:
        coord = self.coord
        try:
            done, nbytes = take_init(coord, self.init, s, meta, body)   # syncer/model/initializer.py
        except PushRefused as e:
            self._refuse(s, "init", e.message)
            s.close()
            return
        self.metrics.bytes_in.labels("init").inc(nbytes)
        self.init.watch.progress()
        if done:
            log.info("run initialized from island %s's INIT (%d fragments)", s.island, len(coord.frags))
            self.init.done(s, self.registry.joined())
            if self.writer is not None:  # version 0 on disk before any island trains from it
                self._checkpoint(final=False)
            for other in self.registry.joined().values():
                for f in coord.owned:
                    other.post_base(f, "check" if other.declared else "f32")

    def _on_push(self, s: _Session, meta: dict, body) -> None:
        try:
            p = parse_push(s.island, s.incarnation, meta, body)
        except PushRefused as e:
            self.metrics.record_push(s.island, {"status": "refused", "code": e.code})
            s.post(MsgType.PUSH_REPLY, refusal(meta.get("fragment"), meta.get("base_version"), e.code, e.message))
            return
        self.metrics.record_push_bytes(s.island, memoryview(body).nbytes)
        # validate/decode/fold on the fold pool so this connection's reader goes on (heartbeats, the next
        # push); at most MAX_PUSHES_IN_FLIGHT per connection (back-pressure bounds the memory held)
        s.push_started(MAX_PUSHES_IN_FLIGHT)
        try:
            self.fold_pool.submit(self._process_push, s, p)
        except RuntimeError:  # the pool is shut down: the syncer is stopping
            s.push_done()

    def _process_push(self, s: _Session, p: ReceivedPush) -> None:
        try:
            reply = reply_for(self.coord, p)
            self.metrics.record_push(s.island, reply)
        except Exception:  # noqa: BLE001 - a bug must not take the syncer down
            log.exception("internal error while accepting a push from island %s", s.island)
            reply = refusal(p.fragment, p.base_version, "internal", "internal error in the syncer (see its log)")
        finally:  # (the coordinator owns p.body now: held for carried/exact pushes, released after a fold)
            s.push_done()
        s.post(MsgType.PUSH_REPLY, reply)
        with self.coord.cond:
            self.coord.cond.notify_all()
        if reply.get("status") == "accepted" and self.coord.keeps_rhythm(s.island):
            self._tell_followers(s.island)

    def _tell_followers(self, keeper: str) -> None:
        """The rhythm island's push opened (or joined) a round: every other island hears it now, not at its next
        heartbeat, so that one whose boundary of that fragment is near pushes at once (island/boundary/schedule
        .follow)."""
        for island, other in self.registry.joined().items():
            if island != keeper:
                st = self.coord.round_status(island)
                if st.opened:
                    other.post(MsgType.HEARTBEAT, syncer_beat_meta(time.time(), st))

    def _session_closed(self, s: _Session) -> None:
        s.close()
        self.registry.remove(s)
        coord = self.coord
        if s.joined:
            with coord.lock:
                coord.disconnected(s.island, s.bye)
                self.init.left(s, self.registry.joined(), coord)   # INIT must come from one island: choose again
                coord.cond.notify_all()
            log.info("island %s disconnected%s", s.island, " (goodbye)" if s.bye else "")
        self.metrics.connections.set(self.registry.count())

    # ------------------------------------------------------------------------------------------ sending
    def _send_base(self, s: _Session, frag: int, dtype: str, final: bool) -> None:
        """(s's writer thread) Stream fragment ``frag``'s current base to ``s`` (see Session.stream_base)."""
        coord = self.coord
        tensors = coord.layout[frag]
        sizes = [int(np.prod(coord.manifest[i][1], dtype=np.int64)) for i in tensors]
        rec = next((r for r in list(self.records)[::-1] if r.fragment == frag and r.ok), None)
        merge = None if rec is None else (rec.version, rec.figures_for(s.island))
        n = s.stream_base(coord.frags[frag], lambda d: d == [s.declared[i] for i in tensors], sizes,
                          coord.down_block, dtype, final, merge=merge)
        if n is not None:
            self.metrics.bytes_out.labels("final" if final else "base").inc(n)

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
                self._check_init()
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
            for s in self.registry.joined().values():
                s.post_base(rec.fragment, self.cfg.base_wire)

    def _checkpoint(self, final: bool) -> None:
        self.coord.prune()   # islands whose lease ran out without state do not go to disk
        snap = capture(self.coord, {"final": final, "run_id": self.run_id})
        self.writer.save(snap, background=False if final else None)
        self.metrics.checkpoint_seconds.set(self.writer.last_seconds)

    def _final_cut(self) -> int:
        coord = self.coord
        self.final_started = True
        why = "total rounds reached" if coord.all_closed() else "every island reached its last step"
        log.info("final cut: %s; merging the last round of every fragment", why)
        # wait (bounded) for pushes still being folded
        for f in coord.owned:
            if coord.pending(f):
                rec = coord.merge(f, force=True)
                if rec is not None:
                    self._after_merge(rec, broadcast=False)
        coord.close_all()
        with coord.lock:
            self.final_done = True
            targets = [s for s in self.registry.joined().values() if not s.closed]
            for s in targets:
                for f in coord.owned:
                    s.post_base(f, "f32", final=True)
        versions = coord.versions()
        log.info("final model: versions %s; sent to %d island(s), waiting up to %.0fs for acknowledgements",
                 versions, len(targets), self.cfg.final_ack_timeout_s)
        await_acks(coord, targets, versions, self.cfg.final_ack_timeout_s, self.stopping)
        if self.writer is not None:
            self._checkpoint(final=True)
        goodbye(targets)
        log.info("syncer done: %d merges, final versions %s", coord.merges_total, versions)
        return 0
