"""Island side of the syncer protocol (stdlib + numpy + xxhash; no torch).

Used by the boundary engine on an island's rank 0.  One :class:`SyncerClient` per process start (its
incarnation); a reconnect after a failure is a new client with the same island id.

API::

    c = SyncerClient(address, key, island_id, manifest, *, incarnation=None, timeout=60.0, insecure=False,
                     connect_retries=10, backoff=0.5, max_backoff=10.0, connect_timeout=None, run_id=None)
        manifest: ordered [(global name, full shape, dtype)]; key: bytes or None (None needs insecure=True and
        a loopback address). connect_timeout (default: timeout) bounds each attempt's TCP connect and the wait
        for the syncer's CHALLENGE (a dead link fails an attempt within it); timeout bounds everything else.
        run_id: the run this island joined earlier (None: any): a syncer of another run is refused (RunMismatch).
    c.connect() -> Welcome                   # connect (bounded exponential back-off), authenticated handshake
                                             # (islands pass connect_retries=0: island/link/syncer.py owns their policy)
        Welcome: island_id, layout (fragment -> manifest indices, ascending), numels, fragments, versions
        (None before INIT), needs_init (fragments this island must INIT), base_wire, heartbeat_s, lease_s,
        islands, quorum, total_rounds, final, run_id (the syncer's run, authenticated), shard fields.  Starts the reader and heartbeat threads.
    c.send_init(fragment, arrays)            # float32 arrays of the fragment's tensors in layout order, streamed
    c.wait_ready(timeout, init_source=None) -> dict[int, Base]
        # sends INIT when the syncer asks (init_source(fragment) -> iterable of float32 arrays), then waits
        # for the base of every fragment; returns them (the island installs them before training)
    c.push(fragment, *, base_version, local_step, steps, tokens, codec, block=256, body=None, body_len=None,
           body_iter=None, final=False, wait=False, timeout=None, blend=False, patience=None) -> Optional[PushReply]
        # body: encoded bytes (wire.codecs.encode of the fragment's flat delta, anchor minus current) or
        # body_iter yielding buffers with body_len.  wait=True blocks for the syncer's reply (raising
        # SyncerRefusal if refused); otherwise a refusal is raised by the next call on this client.
        # blend: the island blends merged bases in (tau > 0); the syncer's --outer-lr auto depends on it.
    c.poll() -> list[Base]                   # non-blocking: bases (BASE and FINAL_BASE) received since the last
                                             # poll, newest per fragment, in arrival order
    c.wait_base(fragment, min_version, timeout) -> Base   # bounded wait (WireTimeout naming what it waited for)
    c.init_requested() -> list[int]          # fragments the syncer asked INIT for after the welcome
    c.wait_event(timeout)                    # block until the reader received anything (or timeout); check()
    c.wait_activity(timeout)                 # the same without check(): failures stay queued for poll()
    c.final_cut -> bool                      # the syncer started the final cut (FINAL_BASE arrived)
    c.finish(last_step, timeout) -> dict[int, Base]
        # final cut handshake: FINAL (after the island pushed its final deltas with final=True), wait for
        # FINAL_BASE of every fragment (float32, with versions), ACK them; returns the final model
    c.status() -> (SyncerStatus, seconds since the syncer last sent anything)   # what its rounds wait for
    c.local_step, c.rate, c.pinned           # the island's step, compute rate (steps/s), pinned H: in heartbeats
    c.schedule                               # a Schedule (H, each fragment's next boundary step): in heartbeats
    c.pretrained                             # the island started from pretrained weights: in every push
    c.beat_soon()                            # a HEARTBEAT now, not at the next period
    c.check()                                # re-raise a failure seen by the reader thread
    c.close()                                # BYE (best effort) and close; idempotent
    c.abort()                                # close without BYE (a reconnect replaces this link)
    recoverable(exc) -> bool                 # the link is gone (reconnect) vs a final refusal
    probe(address, key, *, timeout=10.0, insecure=False, island_id="doctor") -> dict
        # authenticated handshake without joining a run (yeto-patch doctor): the syncer's status

    Base: fragment, version, dtype ("f32" | "bf16" | "int8" | "int4" | "topk:F+intB"), values (flat float32 numpy
        array) or, for a base update (--base-wire int8/int4/topk), values None and `deltas`: encoded changes to
        apply in order to the island's base of version `start` (base.delta_range(i, start, count) decodes a piece),
        with `held` True when that base is the weights the island already holds (declared in its MANIFEST);
        `merge`: the syncer's figures of the merge that made it (values.merge_info), or None;
        base_a.then(base_b) composes a base with the updates that follow it (exactly as the syncer did), final
    PushReply: fragment, base_version, status ("accepted" | "carried" | "closed"), lag, version, message

Errors: everything raised is a :class:`~.frames.ProtocolError`: :class:`SyncerRefusal` (a refused push:
``code`` in stale / duplicate / nonfinite / bad-push / bad-base / bad-fragment / not-initialized, ``message``
the syncer's text; ``stale`` means pull the current base and push again), :class:`~.frames.PeerError` (the
syncer's ERROR message: auth, manifest, too-many-islands, protocol; the connection is closed),
:class:`~.frames.AuthError`, :class:`~.frames.WireTimeout`, :class:`~.transport.ConnectError`.

The value types live in :mod:`.values` and the handshake (with ``probe``) in :mod:`.handshake`; both are
re-exported here. What the client sends is built, and what it receives read, by :mod:`.schema` (one schema per message).
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
from typing import Callable, Iterable, Optional

import numpy as np

from . import auth, codecs
from .frames import MsgType, PeerError, ProtocolError, WireTimeout
from .handshake import UNVERIFIED_MAX, _handshake, probe
from .schema import (ack_meta, final_meta, init_meta, init_pieces, island_beat_meta, manifest_entries, push_meta,
                     push_size, read_base, read_reply, read_syncer_beat, read_welcome, session_limits)
from .text import check_island_id
from .transport import Connection, connect
from .values import (Base, PushReply, Schedule, SyncerRefusal, SyncerStatus, Welcome,  # noqa: F401 - re-exported
                     recoverable)

__all__ = ["SyncerClient", "SyncerRefusal", "Welcome", "Base", "PushReply", "probe", "recoverable"]

MAX_AIMS = 4096   # fragments whose last PUSH_REPLY rhythm is kept


class SyncerClient:
    def __init__(self, address: str, key: Optional[bytes], island_id: str, manifest, *,
                 incarnation: Optional[int] = None, timeout: float = 60.0, insecure: bool = False,
                 connect_retries: int = 10, backoff: float = 0.5, max_backoff: float = 10.0,
                 held: Optional[list] = None, bell: Optional[threading.Event] = None,
                 connect_timeout: Optional[float] = None, run_id: Optional[str] = None,
                 initializer: bool = False):
        if key is None:
            auth.check_insecure(address, insecure)
        self.address = address
        self.key = key
        self.island_id = check_island_id(str(island_id))
        self.manifest = manifest_entries(manifest)
        self.digest = auth.manifest_digest(self.manifest)
        # from the OS, not the `random` module: Megatron seeds that with --seed, so every island of a run (and an
        # island relaunched before its first checkpoint) would draw the same incarnation
        self.incarnation = secrets.randbits(63) if incarnation is None else int(incarnation)
        self.timeout = float(timeout)
        self.connect_timeout = self.timeout if connect_timeout is None else min(float(connect_timeout), self.timeout)
        self.insecure = insecure
        self.run_id = run_id
        self.connect_retries = connect_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        if held is not None and (len(held) != len(self.manifest) or not all(
                isinstance(h, str) and len(h) == 16 for h in held)):
            raise ValueError("held: one 16-hex-digit xxh3_64 digest per manifest tensor")
        self.held = None if held is None else list(held)
        self.initializer = bool(initializer)   # MANIFEST says: this island's weights are the run's start
        self.conn: Optional[Connection] = None
        self.welcome: Optional[Welcome] = None
        self.local_step = 0
        self.rate = 0.0                  # the island's compute rate (steps/s; 0: unknown), sent in heartbeats
        self.pinned = False              # the island pinned H (it keeps the fleet's rhythm), sent in heartbeats
        self.pretrained = False          # the island started from pretrained weights, sent in pushes
        self.schedule: Optional[Schedule] = None   # its H and each fragment's next boundary step, in heartbeats
        self._aims: dict = {}            # fragment -> (base_version, eta_s, period_s): its last push's PUSH_REPLY rhythm
        self._status = SyncerStatus([], [])
        self._heard = time.monotonic()   # when the syncer last sent anything
        self._cv = threading.Condition()
        self._bases: "collections.OrderedDict[int, Base]" = collections.OrderedDict()
        self._final: dict[int, Base] = {}
        self._held: dict[int, int] = {}   # fragment -> version of the last base received on this connection
        self._replies: dict = {}
        self._carried: list = []         # (fragment, base_version) of pushes the syncer carried into a next round
        self._waiting: set = set()
        self._init_requests: list = []
        self._init_sent: set = set()
        self._error: Optional[BaseException] = None  # fatal: the session is over
        self._refusals: collections.deque = collections.deque()  # refused pushes not reported yet
        self._closed = False
        self._beat_now = False           # beat_soon(): the heartbeat thread sends one now, not at its period
        self._bye_seen = False
        self._final_sent = False
        self._threads: list[threading.Thread] = []
        self._bell = bell   # set on every arrival too (one waiter for several clients: a sharded syncer)

    def _notify(self) -> None:
        """(under _cv) Wake whoever waits for this client."""
        self._cv.notify_all()
        if self._bell is not None:
            self._bell.set()

    # --------------------------------------------------------------------------------------- connecting
    def connect(self) -> Welcome:
        if self.conn is not None:
            raise ProtocolError("already connected")
        conn = connect(self.address, timeout=self.connect_timeout, retries=self.connect_retries,
                       backoff=self.backoff, max_backoff=self.max_backoff, max_payload=UNVERIFIED_MAX,
                       max_reassembly_bytes=UNVERIFIED_MAX[MsgType.HELLO_OK])
        conn.timeout = self.timeout   # (the connect timeout bounded the TCP connect; the CHALLENGE: below)
        try:
            meta = _handshake(conn, self.key, self.insecure, MsgType.HELLO, self.island_id, self.incarnation,
                              self.digest, {"manifest": [[n, list(s), d] for n, s, d in self.manifest],
                                            **({"held": self.held} if self.held is not None else {}),
                                            **({"initializer": True} if self.initializer else {})},
                              self.timeout, resume_slot=(self.address, self.island_id),
                              first_timeout=self.connect_timeout, run_id=self.run_id)
            w = read_welcome(meta)
            conn.set_limits(*session_limits(w))
        except BaseException:
            conn.close()
            raise
        self.conn = conn
        self.welcome = w
        for target, name in ((self._reader, "yeto-client-reader"), (self._heartbeat, "yeto-client-heartbeat")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return w

    def _need(self) -> Connection:
        self.check()
        if self.conn is None:
            raise ProtocolError("not connected: call connect() first")
        return self.conn

    def check(self) -> None:
        """Re-raise a failure seen by the reader thread (a refused push, the syncer's ERROR, a lost link)."""
        with self._cv:
            if self._error is not None:
                raise self._error
            if self._refusals:
                raise self._refusals.popleft()  # each refusal is reported once; the connection stays usable

    def aims(self) -> dict:
        """{fragment: (base_version, eta_s, period_s)}: what the PUSH_REPLY of the fragment's last push said of the
        fleet's rhythm (when the island it keeps pushes the fragment next, counted from the push's arrival)."""
        with self._cv:
            return dict(self._aims)

    def status(self) -> tuple:
        """(the syncer's last SyncerStatus, seconds since the syncer last sent anything)."""
        with self._cv:
            return self._status, time.monotonic() - self._heard

    def conn_lost(self) -> bool:
        """True once the session failed (lost or stalled link, the syncer's ERROR): only a new client helps."""
        with self._cv:
            return self._error is not None

    # ------------------------------------------------------------------------------------------ threads
    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = e
            self._notify()

    def _reader(self) -> None:
        conn = self.conn
        # the syncer sends a heartbeat every heartbeat_s: a link silent for a whole lease is dead even when no
        # FIN or RST ever arrives (a cut cable, a NAT that forgot the flow)
        silence = max(3 * (self.welcome.heartbeat_s if self.welcome else 5.0),
                      self.welcome.lease_s if self.welcome else 60.0)
        last = time.monotonic()
        while not self._closed:
            try:
                t, meta, body = conn.recv(timeout=1.0)
            except WireTimeout:
                if conn.broken:
                    self._fail(WireTimeout(f"connection to the syncer at {self.address} stalled: {conn.broken}"))
                    return
                if time.monotonic() - last > silence and not self._closed:
                    self._fail(WireTimeout(f"no message from the syncer at {self.address} for {silence:.0f}s "
                                           f"(it sends heartbeats every {self.welcome.heartbeat_s:g}s): the link "
                                           f"is dead"))
                    return
                continue
            except (ProtocolError, OSError) as e:
                if not self._closed and not (self._bye_seen and self.final_cut_complete()):
                    self._fail(e if isinstance(e, PeerError) else
                               ProtocolError(f"lost the connection to the syncer at {self.address}: {e}"))
                return
            last = self._heard = time.monotonic()
            try:
                self._dispatch(t, meta, body)
            except Exception as e:  # noqa: BLE001 - surfaced to the caller
                self._fail(ProtocolError(f"bad {t.name} message from the syncer: {e}"))
                return

    def _dispatch(self, t: MsgType, meta: dict, body) -> None:
        if t in (MsgType.BASE, MsgType.FINAL_BASE):
            # (the reader thread is the only writer of _held: read without the lock)
            b = read_base(t, meta, body, self.welcome, self.held is not None, self._held)
            update = b.values is None and bool(b.deltas)   # a base update composes with a base not yet polled
            with self._cv:
                if b.final:
                    self._final[b.fragment] = b
                cur = self._bases.pop(b.fragment, None)
                self._bases[b.fragment] = cur.then(b) if update and cur is not None else b
                self._held[b.fragment] = b.version
                self._notify()
        elif t == MsgType.PUSH_REPLY:
            r = read_reply(meta)
            key = (r.fragment, r.base_version)
            with self._cv:
                if r.rhythm is not None and isinstance(r.fragment, int) and isinstance(r.base_version, int) and \
                        (r.fragment in self._aims or len(self._aims) < MAX_AIMS):
                    self._aims[r.fragment] = (r.base_version, *r.rhythm)
                if key in self._waiting:
                    self._replies[key] = (r, meta)
                elif r.status == "refused":
                    self._refusals.append(SyncerRefusal(meta.get("code", "refused"), r.message, r.fragment,
                                                        r.base_version))
                elif r.status == "carried" and len(self._carried) < 4096:
                    self._carried.append((r.fragment, r.base_version))
                self._notify()
        elif t == MsgType.INIT:
            with self._cv:
                self._init_requests = [int(f) for f in meta.get("request", [])]
                self._notify()
        elif t == MsgType.HEARTBEAT:
            st = read_syncer_beat(meta)
            st.at = time.monotonic()
            with self._cv:
                self._status = st
        elif t == MsgType.BYE:
            with self._cv:
                self._bye_seen = True
                if not self.final_cut_complete() and self._error is None:
                    self._error = ProtocolError(f"the syncer closed the session: {meta.get('reason', 'goodbye')}")
                self._notify()
        # anything else: the reader saw the syncer alive; nothing to do

    def _heartbeat(self) -> None:
        period = self.welcome.heartbeat_s if self.welcome else 5.0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._beat_now, timeout=period)
                if self._closed or self._error is not None:
                    return
                self._beat_now = False
            try:
                self.conn.send(MsgType.HEARTBEAT, island_beat_meta(self.local_step, self.rate, self.pinned,
                                                                    self.schedule))
            except (ProtocolError, OSError) as e:
                if not self._closed:
                    self._fail(e)
                return

    # ------------------------------------------------------------------------------------------ INIT
    def send_init(self, fragment: int, arrays: Iterable[np.ndarray]) -> None:
        """Stream fragment's initial float32 values: its tensors in layout order (any shape, C order)."""
        conn = self._need()
        numel = self.welcome.numels[fragment]
        with self._cv:  # no longer requested once it is being sent (a poller must not send it twice)
            if fragment in self._init_requests:
                self._init_requests.remove(fragment)
        conn.send(MsgType.INIT, init_meta(fragment, numel),
                  body_len=4 * numel, body_iter=init_pieces(fragment, arrays))
        with self._cv:
            self._init_sent.add(fragment)

    def take_carried(self) -> list:
        """(fragment, base_version) of this island's pushes the syncer accepted late and holds for the next merge
        of their fragment (PUSH_REPLY ``carried``), since the last call."""
        with self._cv:
            out, self._carried = self._carried, []
            return out

    def init_requested(self) -> list:
        self.check()
        with self._cv:
            return list(self._init_requests)

    def wait_ready(self, timeout: float, init_source: Optional[Callable[[int], Iterable[np.ndarray]]] = None
                   ) -> dict:
        """Send INIT when asked, then wait for the base of every fragment; returns {fragment: Base}."""
        self._need()
        todo = [f for f in self.welcome.needs_init if f not in self._init_sent]
        if todo and init_source is None:
            raise ProtocolError(f"the syncer asks this island to INIT fragments {todo}; pass init_source")
        for f in todo:
            self.send_init(f, init_source(f))
        deadline = time.monotonic() + timeout
        n = self.welcome.fragments
        while True:
            self.check()
            with self._cv:
                req = list(self._init_requests)
                have = {f for f in self._bases} | set(self._final)
                if len(have) == n and not req:
                    out = {}
                    for f in range(n):
                        out[f] = self._bases.pop(f, None) or self._final[f]
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WireTimeout(f"waited {timeout}s for the initial bases: have fragments {sorted(have)} "
                                      f"of {n}")
                if not req:
                    self._cv.wait(min(left, 0.5))
                    continue
            if init_source is None:
                raise ProtocolError(f"the syncer asks this island to INIT fragments {req}; pass init_source")
            for f in req:
                self.send_init(f, init_source(f))

    # ------------------------------------------------------------------------------------------ pushes
    def push(self, fragment: int, *, base_version: int, local_step: int, steps: int, tokens: int, codec: str,
             block: int = codecs.DEFAULT_BLOCK, body=None, body_len: Optional[int] = None,
             body_iter: Optional[Iterable] = None, final: bool = False, wait: bool = False,
             timeout: Optional[float] = None, blend: bool = False,
             patience: Optional[float] = None) -> Optional[PushReply]:
        """Send a fragment's encoded delta. See the module docstring. ``patience``: seconds until the island
        blocks for this push's answer (the syncer's pace window counts on it)."""
        conn = self._need()
        numel, body_len = push_size(self.welcome, fragment, codec, block, body, body_len, body_iter)
        self.local_step = max(self.local_step, int(local_step))
        meta = push_meta(fragment, numel, base_version=base_version, local_step=local_step, steps=steps,
                         tokens=tokens, codec=codec, block=block, final=final, blend=blend, patience=patience,
                         rate=self.rate, pinned=self.pinned, pretrained=self.pretrained)
        key = (fragment, int(base_version))
        if wait:
            with self._cv:
                self._waiting.add(key)
                self._replies.pop(key, None)
        try:
            if body_iter is not None:
                conn.send(MsgType.PUSH, meta, body_len=body_len, body_iter=body_iter)
            else:
                conn.send(MsgType.PUSH, meta, body)
            if not wait:
                return None
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            with self._cv:
                while key not in self._replies:
                    if self._error is not None:
                        raise self._error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise WireTimeout(f"no reply from the syncer to the push of fragment {fragment} "
                                          f"(base v{base_version}) within the timeout")
                    self._cv.wait(min(left, 0.5))
                r, m = self._replies.pop(key)
        finally:
            if wait:
                with self._cv:
                    self._waiting.discard(key)
        if r.status == "refused":
            raise SyncerRefusal(m.get("code", "refused"), r.message, fragment, base_version)
        return r

    # ------------------------------------------------------------------------------------------- bases
    def poll(self) -> list:
        """Bases received since the last poll (newest per fragment, arrival order); never blocks."""
        self.check()
        with self._cv:
            out = list(self._bases.values())
            self._bases.clear()
            return out

    def wait_base(self, fragment: int, min_version: int, timeout: float) -> Base:
        """Wait (bounded) for a base of ``fragment`` with version >= ``min_version``; consumes it."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            with self._cv:
                b = self._bases.get(fragment)
                if b is not None and b.version >= min_version:
                    return self._bases.pop(fragment)
                fb = self._final.get(fragment)
                if fb is not None and fb.version >= min_version:
                    self._bases.pop(fragment, None)
                    return fb
                left = deadline - time.monotonic()
                if left <= 0:
                    have = None if b is None else b.version
                    raise WireTimeout(f"waited {timeout}s for the base of fragment {fragment} at version >= "
                                      f"{min_version} (newest received: {have})")
                self._cv.wait(min(left, 0.5))

    def wait_event(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until the reader received something (a base, a reply, an INIT
        request, an error); then re-raise a failure if there is one."""
        with self._cv:
            if self._error is None and not self._refusals:
                self._cv.wait(max(0.0, timeout))
        self.check()

    def wait_activity(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until the reader received something; raises nothing (a failure or
        a refusal stays queued for ``check``/``poll``)."""
        with self._cv:
            self._cv.wait(max(0.0, timeout))

    @property
    def final_cut(self) -> bool:
        with self._cv:
            return bool(self._final)

    def final_cut_complete(self) -> bool:
        return self.welcome is not None and len(self._final) == len(self.welcome.owned)

    # --------------------------------------------------------------------------------------- final cut
    def finish(self, last_step: Optional[int] = None, timeout: Optional[float] = None) -> dict:
        """Final cut: FINAL, wait for every fragment's FINAL_BASE, ACK; returns {fragment: Base} (float32)."""
        timeout = self.timeout if timeout is None else timeout
        if self.conn is None:
            raise ProtocolError("not connected: call connect() first")
        conn = self.conn
        if not self._final_sent and not self.final_cut_complete():
            if self._error is not None:
                raise self._error
            conn.send(MsgType.FINAL, final_meta(self.local_step if last_step is None else last_step))
            self._final_sent = True
        deadline = time.monotonic() + timeout
        n, owned = self.welcome.fragments, self.welcome.owned
        with self._cv:
            while len(self._final) < len(owned):
                if self._error is not None and not (self._bye_seen and self.final_cut_complete()):
                    raise self._error
                left = deadline - time.monotonic()  # (refused pushes stay queued for check(): the final
                if left <= 0:                        # model comes regardless)
                    raise WireTimeout(f"waited {timeout}s for the final model: have fragments "
                                      f"{sorted(self._final)} of {owned}")
                self._cv.wait(min(left, 0.5))
            out = dict(self._final)
        try:
            conn.send(MsgType.ACK, ack_meta([out[f].version if f in out else None for f in range(n)]))
        except (ProtocolError, OSError):
            if not self._bye_seen:  # the syncer already closed after the final cut: the model is complete
                raise
        return out

    def abort(self) -> None:
        """Close without a goodbye (the link is being replaced: the syncer must not think the island left)."""
        self._close(bye=False)

    def beat_soon(self) -> None:
        """Send a HEARTBEAT now rather than at the next period (what it says changed in a way the syncer should
        hear before then: the island's schedule, first known)."""
        with self._cv:
            self._beat_now = True
            self._cv.notify_all()

    def close(self) -> None:
        self._close(bye=True)

    def _close(self, bye: bool) -> None:
        if self._closed:
            return
        conn = self.conn
        if bye and conn is not None and not conn.broken:
            try:
                if not self._bye_seen:
                    conn.send(MsgType.BYE, {"reason": "island closing"})
            except ProtocolError:
                pass
        with self._cv:
            self._closed = True
            self._notify()
        if conn is not None:
            conn.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
