"""Island rank 0's link to its syncer: the client, the background sender, reconnects, refusals and the bases
that arrived (torch-free).

Connecting (at start-up and after a lost link) follows ONE back-off policy, ``Backoff``: attempts 0.5 s apart at
first, doubling up to 10 s, +-20% jitter, for up to YETO_DILOCO_TIMEOUT (an island may be started before its
syncer; a syncer may restart). Each attempt is one TCP connect and handshake (``SyncerClient`` with
``connect_retries=0``: ``wire.transport.connect``'s own retry loop is not used by islands); its TCP connect and
the wait for the syncer's first message have their own short bound (``attempt_timeout``: at most 10 s), so a dead
link fails an attempt quickly and the back-off applies even when YETO_DILOCO_TIMEOUT is short. Errors that a retry
cannot help (a bad key, another run's manifest, a refusal) end the attempts at once.

The link moves records (island/records.py) and writes no fragment: the boundary hands it ``OutgoingPush`` records
and takes an ``Inbox`` from every ``poll``. It keeps its own unanswered pushes, each until the syncer answers it:
a base whose merge took it (the BASE's merge figures name this island's lag in the merge: ``records.took_by``;
pushes of one fragment go out in order on one connection, so such a merge also answers the older ones) or a
refusal. Nothing else removes one: a push handed over while the link is stalled or being replaced is sent once it
is up.

After a lost link (syncer restart, cut link, dead peer) the link reconnects in the background (the island trains on
until it needs an answer: its tau bound), keeps the incarnation, and the reconnecting thread itself sends every
unanswered push again (the syncer refuses it as a duplicate if it had it: counted once either way; one it merged
past without it is carried into its next round, within its --max-base-lag) and wakes whoever waits on the link:
a restored link is used at once, not at the island's next poll. The current bases come with every welcome; the
``Reconnected`` record tells the fragments the syncer's versions (one behind this island, which resumed from an
older checkpoint, is adopted). An island blocked at its tau bound for a push whose round merged without it asks
again (``ask_again``: the push is sent again, at most every ASK_AGAIN_S): the syncer merges it, or refuses it as a
duplicate or stale, each an answer.

The link also carries what waits need (``island/link/patience.py``): whether the syncer is reachable, what its
heartbeats say this island's rounds wait for, the fleet's pace, and this island's step and compute rate (sent in
heartbeats; ``stepped``), and each push says its patience: the seconds until the island would block for its
answer (tau steps of its step time), which bounds how long the syncer's pace window holds a round.
"""
from __future__ import annotations

import collections
import logging
import random
import threading
import time
from typing import Callable, Optional

from yeto_patch.island.errors import EngineError, describe
from yeto_patch.island.link.patience import Patience, StepClock
from yeto_patch.island.records import (ArrivedBase, Carried, Inbox, OutgoingPush, Reconnected, Refusal, Sent,
                                       took_by)

log = logging.getLogger("yeto_patch")
CONNECT_TIMEOUT_S = 10.0   # the longest one attempt waits for a TCP connect and for the syncer's CHALLENGE
ASK_AGAIN_S = 5.0          # an island blocked for a push's answer sends it again at most this often


def attempt_timeout(total: float) -> float:
    """One connection attempt's bound on its TCP connect and on the syncer's first message: a quarter of
    YETO_DILOCO_TIMEOUT, at least 1 s and at most CONNECT_TIMEOUT_S (several attempts fit in any timeout)."""
    return min(CONNECT_TIMEOUT_S, max(1.0, total / 4))


class Backoff:
    """The waits between connection attempts: `first`, doubling up to `cap`, each +-`jitter` (a fraction)."""

    def __init__(self, first: float = 0.5, cap: float = 10.0, jitter: float = 0.2, rng=None):
        self.first, self.cap, self.jitter = float(first), float(cap), float(jitter)
        self._next = self.first
        self._rng = rng or random.Random()

    def next(self) -> float:
        w = self._next
        self._next = min(self._next * 2, self.cap)
        return w * self._rng.uniform(1 - self.jitter, 1 + self.jitter)


def dial(attempt: Callable[[], object], deadline: float, what: str, backoff: Optional[Backoff] = None,
         sleep=time.sleep, on_retry: Optional[Callable[[BaseException, float], None]] = None):
    """Call `attempt()` until it succeeds, an error that is not `recoverable` or the monotonic `deadline`;
    returns (result, attempts). At the deadline a ConnectError says how long and how often it tried.
    `on_retry(error, seconds left)` is called after each failed attempt that is tried again."""
    from yeto_patch.wire.client import recoverable
    from yeto_patch.wire.transport import ConnectError
    backoff = backoff or Backoff()
    t0, n = time.monotonic(), 0
    while True:
        n += 1
        try:
            return attempt(), n
        except Exception as e:  # noqa: BLE001 - classified below
            if not recoverable(e):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectError(f"{what}: no answer within YETO_DILOCO_TIMEOUT ({time.monotonic() - t0:.0f}s, "
                                   f"{n} attempts); last: {type(e).__name__}: {e}") from e
            if on_retry is not None:
                on_retry(e, left)
            sleep(min(backoff.next(), left))


def load_key(settings) -> Optional[bytes]:
    from yeto_patch.wire import auth
    key = auth.load_key(settings.key_file) if (settings.key_file or settings.key_from_env) else None
    if key is None and not settings.insecure:
        raise EngineError("no key: set YETO_DILOCO_KEY_FILE (or YETO_KEY)")
    return key


class _Unanswered:
    """One push the link holds until the syncer answers it: the record, whether it went out fully on the current
    connection (``sent_on``: the connection's number), whether it was sent again (a duplicate refusal is expected)
    and when it was last asked again."""
    __slots__ = ("push", "sent_on", "again", "asked_at")

    def __init__(self, push: OutgoingPush):
        self.push = push
        self.sent_on: Optional[int] = None
        self.again = bool(push.again)
        self.asked_at = 0.0


MAX_OUTLIERS = 3   # outlier refusals in a row that fail the island (its training diverged)


class SyncerLink:
    """Rank 0's connection to the syncer. `settings`: syncer, island_id, timeout, insecure, send_queue_bytes,
    key_file / key_from_env, overlap_steps; `step()`: the island's step (for log lines); `record(event, **fields)`:
    the boundary log (or None)."""

    def __init__(self, settings, wire_manifest, *, start_digests=None, step: Callable[[], int] = lambda: 0,
                 record=None, address: Optional[str] = None, arrival=None, run_id: Optional[str] = None):
        self.settings = settings
        self.address = address or settings.syncer   # (one shard's, for a sharded syncer)
        self.arrival = arrival or threading.Event()  # set on every arrival and when a reconnect ends (the bell)
        self.owned: Optional[list] = None           # the fragments this syncer (shard) owns, from its welcome
        self.run_id = run_id                        # the syncer's run: from the first welcome (or the sync state
        #                                             this island restarted from); a syncer of another run is refused
        self.manifest = wire_manifest
        self.start_digests = start_digests          # per-tensor digests of this island's start (or None)
        self.step = step
        self.record = record
        self.key = load_key(settings)
        self.client = None
        self.sender = None
        self.layout = None           # (layout, numels) set by attach() once known: a reconnect must find the same
        self.resilient = False       # after start: a lost link is replaced instead of failing the island
        self.outage: Optional[float] = None   # when the link was lost (None: it is up)
        self.refusals = collections.deque()   # refusals the sender thread met (raised by poll)
        self.outliers = 0                      # outlier refusals in a row (no merge of this island's pushes since)
        self.clock = StepClock()              # this island's step and compute rate
        self.schedule = None   # wire.values.Schedule: H and each fragment's next boundary step (heartbeats say it)
        self.pretrained = False   # the island started from pretrained weights (every push says it: started_from)
        self._told = -1                        # the connection (_conn_no) whose heartbeat said it at once
        self._final_wait: Optional[Patience] = None
        self._redial: Optional[tuple] = None  # (thread, result, cause, deadline) of a reconnect under way
        self._lock = threading.RLock()        # the connection and the unanswered pushes (training and redial threads)
        self._unanswered: dict = {}           # fragment -> [_Unanswered] in the order handed
        self._conn_no = 0                     # the current connection's number (sent_on)
        self._news = collections.deque()      # Reconnected / Sent records for the next poll (any thread appends)
        self._closed = False

    # ---------------------------------------------------------------------------------------------- connecting
    def _client(self, incarnation, timeout, start_digests, connect_timeout):
        from yeto_patch.wire.client import SyncerClient
        s = self.settings
        return SyncerClient(self.address, self.key, s.island_id, self.manifest, incarnation=incarnation,
                            timeout=timeout, insecure=s.insecure, connect_retries=0, held=start_digests,
                            bell=self.arrival, connect_timeout=connect_timeout, run_id=self.run_id,
                            initializer=bool(s.initializer))

    def _dial(self, incarnation, timeout, start_digests, deadline, what, on_retry=None):
        """(client, welcome, attempts): a connected client (``_use`` makes it the link's)."""
        per_attempt = attempt_timeout(self.settings.timeout)

        def attempt():
            left = deadline - time.monotonic()
            c = self._client(incarnation, timeout, start_digests, max(0.5, min(per_attempt, left)))
            try:
                return c, c.connect()
            except BaseException:
                c.abort()
                raise
        said = set()

        def retrying(e, left):   # say once per kind what an attempt met that nothing authenticated, or another run
            if getattr(e, "transient", False) and type(e) not in said:
                said.add(type(e))
                log.warning("yeto-patch: %s: %s: %s; trying again for up to %.0fs", what, type(e).__name__, e, left)
            if on_retry is not None:
                on_retry(e, left)
        (c, w), n = dial(attempt, deadline, what, on_retry=retrying)
        return c, w, n

    def _use(self, c) -> None:
        from yeto_patch.wire.sender import BackgroundSender
        self.client = c
        self._conn_no += 1
        c.local_step, c.rate = max(c.local_step, self.clock.step), self.clock.rate
        c.schedule = self.schedule
        c.pretrained = self.pretrained
        self.sender = BackgroundSender(self.settings.send_queue_bytes, name="yeto-push-sender")

    def open(self):
        """Connect and say hello (start-up); returns the syncer's Welcome. Waits for a syncer that is not up yet
        for up to YETO_DILOCO_TIMEOUT."""
        s = self.settings
        said = []

        def waiting(e, left):
            if not said:   # once: an island started before its syncer says what it waits for
                said.append(True)
                log.info("yeto-patch: the syncer at %s does not answer yet (%s: %s); trying again for up to %.0fs "
                         "(YETO_DILOCO_TIMEOUT)", self.address, type(e).__name__, e, left)
        c, w, n = self._dial(None, s.timeout, self.start_digests, time.monotonic() + s.timeout,
                             f"connect to the syncer at {self.address}", on_retry=waiting)
        with self._lock:
            self._use(c)
        if n > 1:
            log.info("yeto-patch: connected to the syncer at %s (attempt %d)", self.address, n)
        self.owned = list(w.owned)
        self.run_id = w.run_id
        return w

    def attach(self, fragments) -> None:
        """The fragments' layout (``layout``, ``numels``: read once; the link writes no fragment)."""
        self.layout = ([[int(i) for i in frag] for frag in fragments.layout], list(fragments.numels))

    # ---------------------------------------------------------------------------------------------- liveness
    def stepped(self, step: int) -> None:
        """The island finished optimizer step `step` (its heartbeats carry it, with the compute rate)."""
        self.clock.stepped(step)
        c = self.client
        if c is not None:
            c.local_step = max(c.local_step, int(step))
            c.rate = self.clock.rate
            c.pinned = not getattr(self.settings, "sync_auto", True)

    def resumed(self) -> None:
        """The island's work after its last step (installs, hand-overs, waits at the tau bound) ended: not compute
        (``StepClock.resumed``)."""
        self.clock.resumed()

    def started_from(self, pretrained: bool) -> None:
        """Whether the island's run started from pretrained weights (a fine-tune): every push says it, and the
        syncer's outer lr ``auto`` takes its fine-tune value for merges of such pushes."""
        self.pretrained = bool(pretrained)
        c = self.client
        if c is not None:
            c.pretrained = self.pretrained

    def scheduled(self, sync_every: int, next_boundaries) -> None:
        """The island's H and each fragment's next boundary step after its last step (heartbeats carry them: the
        syncer then knows when this island's pushes are due from its first heartbeat, not its second push)."""
        from yeto_patch.wire.values import Schedule
        self.schedule = Schedule(int(sync_every), tuple(int(s) for s in next_boundaries))
        c = self.client
        if c is not None:
            c.schedule = self.schedule
            if self._told != self._conn_no and c.rate > 0:   # once per connection, with a rate: heard at once, not
                self._told = self._conn_no                   # a heartbeat period (--lease / 4) into a run
                c.beat_soon()

    def reachable(self) -> bool:
        """The syncer is connected and was heard from within its silence bound (the client fails a link silent for
        a lease, after which a reconnect is due)."""
        c = self.client
        if c is None or self.outage is not None or c.conn_lost():
            return False
        return c.status()[1] <= max(3 * c.welcome.heartbeat_s, c.welcome.lease_s)

    def waiting_on(self) -> str:
        c = self.client
        return c.status()[0].describe() if c is not None else "not connected"

    def pace(self) -> float:
        """The fleet's pace (steps/s) as the syncer's last heartbeat said (0: unknown)."""
        c = self.client
        return c.status()[0].pace if c is not None else 0.0

    def rate(self) -> float:
        """This island's compute rate (steps/s, from the median step time; 0: unknown)."""
        return self.clock.rate

    def aims(self) -> dict:
        """{fragment: (base_version, eta_s, period_s)}: what the PUSH_REPLY of each fragment's last push said of the
        fleet's rhythm (wire/client.SyncerClient.aims)."""
        c = self.client
        return c.aims() if c is not None else {}

    def rhythm(self) -> dict:
        """``{fragment: (seconds from now, period in seconds)}``: when the island the fleet keeps its rhythm with
        pushes each fragment next, as the syncer's last HEARTBEAT said (its age taken off); empty when it said
        none, or it is older than three heartbeat periods."""
        fresh = self._fresh_status()
        if fresh is None:
            return {}
        st, age = fresh
        return {int(f): (eta - age, period) for f, eta, period in st.rhythm}

    def opened(self) -> dict:
        """``{fragment: seconds ago}``: the open rounds that the push of the island the fleet keeps its rhythm with
        is in and this island has not answered, as the syncer's last HEARTBEAT said (it sends one at once when
        that island pushes; its age added); empty when none or older than three heartbeat periods."""
        fresh = self._fresh_status()
        if fresh is None:
            return {}
        st, age = fresh
        return {int(f): a + age for f, a in st.opened}

    def _fresh_status(self):
        """(the syncer's last HEARTBEAT status, its age in seconds), or None when there is none or it is older than
        three heartbeat periods."""
        c = self.client
        if c is None or c.welcome is None:
            return None
        st = c.status()[0]
        age = time.monotonic() - st.at
        if not st.at or age > 3 * c.welcome.heartbeat_s:
            return None
        return st, age

    def patience(self, push_step: int, final: bool = False) -> float:
        """Seconds from now until this island blocks for the answer of a push made at `push_step` (tau rule);
        0 with tau = 0 or before the step time is known. A final push's: at least one H of this island's steps (it
        trains no more and waits for the final model, which needs every island's last push: its round may wait
        for the others' next pushes by their pace, as the rhythm's rounds do, instead of merging it alone)."""
        tau, step_s = self.settings.overlap_steps, self.clock.step_s
        if not step_s:
            return 0.0
        blocks = max(0.0, (int(push_step) + tau - self.clock.step) * step_s) if tau > 0 else 0.0
        if final and self.schedule is not None:
            return max(blocks, self.schedule.sync_every * step_s)
        return blocks

    # ---------------------------------------------------------------------------------------------- reconnecting
    def reconnect(self, cause) -> None:
        """The link is gone: replace it (same incarnation) and reconcile, waiting for it; gives up
        YETO_DILOCO_TIMEOUT after the link was lost."""
        self._lost(cause)
        self._redialed(block=True)

    def _lost(self, cause) -> None:
        """The link is gone: redial in the background (same incarnation) while the island trains on; the
        reconnecting thread sends the unanswered pushes again and rings the bell when it is up."""
        with self._lock:
            if self._redial is not None:
                return
            s = self.settings
            now = time.monotonic()
            if self.outage is None:
                self.outage = now
            deadline = self.outage + s.timeout
            log.warning("yeto-patch: step %d: lost the syncer at %s (%s: %s); reconnecting for up to %.0fs while "
                        "training on", self.step(), self.address, type(cause).__name__, cause, deadline - now)
            old_client, old_sender = self.client, self.sender
            if old_sender is not None:
                old_sender.abort(timeout=2.0)
            if old_client is not None:
                old_client.abort()
            box: dict = {}
            th = threading.Thread(target=self._redial_thread, args=(box, old_client.incarnation, cause, deadline),
                                  name="yeto-redial", daemon=True)
            self._redial = (th, box, cause, deadline)
        th.start()

    def _redial_thread(self, box: dict, incarnation, cause, deadline) -> None:
        s = self.settings
        try:
            c, w, attempts = self._dial(incarnation, min(s.timeout, 60.0), None, deadline, "reconnect")
            if self._closed:
                c.abort()
                return
            with self._lock:
                self._use(c)
                self._check_same_run(w)
                self._reconcile(w, cause, attempts)
            box["ok"] = True
        except Exception as e:  # noqa: BLE001 - raised by _redialed on the training thread
            box["err"] = e
        finally:
            self.arrival.set()   # whoever waits on the link hears of it now, not at its next poll

    def _redialed(self, block: bool) -> bool:
        """Take a background reconnect that ended (or wait for it when `block`): True when the link is up; an
        EngineError when it failed for good (YETO_DILOCO_TIMEOUT, or a refusal a retry cannot help)."""
        if self._redial is None:
            return True
        th, box, cause, deadline = self._redial
        th.join(None if block else 0)
        if th.is_alive():
            return False
        self._redial = None
        if "err" in box:
            e, s = box["err"], self.settings
            if isinstance(e, EngineError):
                raise e
            late = time.monotonic() >= deadline
            raise EngineError(f"yeto-patch: lost the syncer at {self.address} at step {self.step()} "
                              f"({type(cause).__name__}: {cause}) and could not reconnect"
                              f"{' within YETO_DILOCO_TIMEOUT=%.0fs' % s.timeout if late else ''}: "
                              f"{describe(e, 'reconnect')}") from e
        return True

    def _check_same_run(self, w) -> None:
        if self.layout is not None and ([[int(i) for i in frag] for frag in w.layout] != self.layout[0]
                                        or list(w.numels) != self.layout[1] or list(w.owned) != self.owned):
            self.client.abort()
            raise EngineError(f"yeto-patch: the syncer at {self.address} came back with a different fragment "
                              f"layout (another --fragments, --shard or run); this island cannot continue with it")
        if w.versions is None:
            self.client.abort()
            raise EngineError(f"yeto-patch: the syncer at {self.address} came back without this run's state (no "
                              f"checkpoint, or restarted without --resume); restart it with --checkpoint ... "
                              f"--resume")

    def _reconcile(self, w, cause, attempts) -> None:
        """(under the lock, the reconnecting thread) Every unanswered push goes again, in order: one the syncer merged
        meanwhile is refused as a duplicate (counted once), one it merged past without it is carried into its next
        round (or refused as stale beyond its --max-base-lag), as the syncer decides. A push relative to a version
        the syncer does not have (it resumed from an older checkpoint) cannot be merged: it is dropped, said here,
        and the fragment adopts the syncer's base."""
        versions = {f: int(w.versions[f]) for f in self.owned}
        resent, dropped = [], []
        for f in sorted(self._unanswered):
            keep = []
            for u in self._unanswered[f]:
                if u.push.base_version > versions.get(f, -1):
                    dropped.append(u.push.key)
                    continue
                u.again = True
                keep.append(u)
                resent.append(u.push.key)
                self._queue(u)
            self._unanswered[f] = keep
        if dropped:
            log.warning("yeto-patch: the syncer at %s is behind this island (it resumed from an older checkpoint: run "
                        "it with --checkpoint-every 1 to lose nothing): its base is adopted and the pushes "
                        "(fragment, base version) %s, relative to versions it never made, are dropped",
                        self.address, dropped)
        secs = time.monotonic() - self.outage
        log.warning("yeto-patch: step %d: reconnected to the syncer at %s after %.1fs (attempt %d, versions %s); "
                    "pushing again (fragment, base version) %s", self.step(), self.address, secs, attempts,
                    w.versions, resent)
        self._news.append(Reconnected(versions, tuple(resent), round(secs, 3)))
        if self.record is not None:
            self.record("reconnect", step=self.step(), cause=f"{type(cause).__name__}: {cause}",
                        seconds=round(secs, 3), versions=list(w.versions), repushed=[f for f, _ in resent],
                        dropped=[list(k) for k in dropped])

    # ---------------------------------------------------------------------------------------------- data
    def send_push(self, push: OutgoingPush) -> None:
        """Hold `push` until the syncer answers it and queue it on the background sender (a lost link: the
        reconnect sends it)."""
        with self._lock:
            u = _Unanswered(push)
            self._unanswered.setdefault(push.fragment, []).append(u)
            if self._redial is None:
                self._queue(u)

    def ask_again(self, fragment: int, base_version: int) -> bool:
        """The island is blocked for this push's answer and its round merged without it: send it again (once it
        went out on this connection, at most every ASK_AGAIN_S). The syncer merges it, or refuses it as a
        duplicate (it holds it) or stale: each answers it. True when it was sent again."""
        with self._lock:
            u = next((u for u in self._unanswered.get(fragment, ()) if u.push.base_version == base_version), None)
            now = time.monotonic()
            if u is None or self._redial is not None or u.sent_on != self._conn_no or now - u.asked_at < ASK_AGAIN_S:
                return False
            u.asked_at, u.again = now, True
            log.info("yeto-patch: step %d: fragment %d's push relative to v%d is still unanswered and its round merged "
                     "without it: sending it again", self.step(), fragment, base_version)
            self._queue(u)
            return True

    def _queue(self, u: _Unanswered) -> None:
        """(under the lock) Queue `u` on the current connection's sender."""
        from yeto_patch.wire.client import SyncerRefusal, recoverable
        client, sender, conn, push = self.client, self.sender, self._conn_no, u.push
        u.sent_on = None

        def send():
            t = time.perf_counter()
            while True:
                try:
                    client.push(push.fragment, base_version=push.base_version, local_step=push.step,
                                steps=push.steps, tokens=push.tokens, codec=push.codec, block=push.block,
                                body=push.body, final=push.final, blend=push.blend,
                                patience=self.patience(push.step, push.final))
                    break
                except SyncerRefusal as e:   # an earlier push's refusal, raised before this one went out:
                    self.refusals.append(e)   # the training thread handles it (poll); send this push still
            if self._conn_no == conn:   # (no lock here: a submit that waits for room holds it)
                u.sent_on = conn
            self._news.append(Sent(push.fragment, push.base_version, round((time.perf_counter() - t) * 1000, 2)))
        try:
            sender.submit(send, push.nbytes, timeout=self.settings.timeout)
        except Exception as e:  # noqa: BLE001
            if not recoverable(e):
                raise
            self._lost(e)   # the reconnect sends every unanswered push again, this one included

    def _answered(self, fragment: int, upto: int, sent_only: bool = False) -> None:
        """(under the lock) A merge took this island's push of `fragment` relative to `upto`: it and the older ones
        (sent before it on one connection, so the syncer had them first) are answered. `sent_only`: only those
        that went out whole on the current connection (a base without merge figures says no more)."""
        keep = [u for u in self._unanswered.get(fragment, ())
                if u.push.base_version > upto or (sent_only and u.sent_on != self._conn_no)]
        self._unanswered[fragment] = keep

    def unanswered(self) -> list:
        """(fragment, base_version) of the pushes the link holds, in order."""
        with self._lock:
            return [u.push.key for f in sorted(self._unanswered) for u in self._unanswered[f]]

    def send_init(self, f: int, arrays) -> None:
        self.client.send_init(f, arrays)

    def init_requested(self) -> list:
        return self.client.init_requested()

    @property
    def final_cut(self) -> bool:
        return self.client.final_cut

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` (at most 0.5 s) for the next message from the syncer, or for a reconnect to end;
        a lost link or a refusal surfaces from the next poll, which knows how to handle it."""
        t = max(0.0, min(timeout, 0.5))
        if self._redial is not None:
            self.arrival.wait(t)
            self.arrival.clear()
        else:
            self.client.wait_activity(t)

    def poll(self) -> Inbox:
        """What arrived since the last poll (bases with what their merge took, refusals, sends, a reconnect);
        surface failures. After start a lost link is replaced (``reconnect``) instead of failing the island."""
        from yeto_patch.wire.client import SyncerRefusal, recoverable
        if not self._redialed(block=False):
            return self._take_news()   # reconnecting in the background: nothing arrives meanwhile
        refused = []
        while True:
            try:
                if self.refusals:
                    raise self.refusals.popleft()
                if self.sender is not None:
                    self.sender.check()
                bases = self.client.poll()
                break
            except SyncerRefusal as e:
                r = self._expected_refusal(e)
                if r is None:
                    raise
                refused.append(r)
            except Exception as e:  # noqa: BLE001 - classified below
                if not self.resilient or not recoverable(e):
                    raise
                self._lost(e)
                return self._take_news() + Inbox(refusals=tuple(refused))
        self.outage = None
        now = time.monotonic()
        arrived = []
        with self._lock:
            for b in bases:
                a = ArrivedBase(b, took_by(b), now)
                if a.took is not None and a.took >= 0:
                    self._answered(a.fragment, a.took)
                    self.outliers = 0   # a merge took a push of this island
                elif a.took is None:   # no merge figures (an older or restarted syncer): a push that went out on
                    self._answered(a.fragment, a.version - 1, sent_only=True)   # this link is at the syncer
                arrived.append(a)
                if b.merge and self.record is not None:   # the syncer's figures of the merge (the boundary log)
                    self.record("merge", step=self.step(), fragment=b.fragment, version=b.version, **b.merge)
        carried = tuple(Carried(f, v) for f, v in self.client.take_carried()
                        if isinstance(f, int) and isinstance(v, int))
        return self._take_news() + Inbox(bases=tuple(arrived), refusals=tuple(refused), carried=carried)

    def _take_news(self) -> Inbox:
        news = []
        while self._news:
            news.append(self._news.popleft())
        return Inbox(reconnected=tuple(n for n in news if isinstance(n, Reconnected)),
                     sent=tuple(n for n in news if isinstance(n, Sent)))

    def _expected_refusal(self, e) -> Optional[Refusal]:
        """A refusal that answers a push without failing the island: a push the syncer already holds (duplicate),
        one it merged past beyond its --max-base-lag (stale), or up to MAX_OUTLIERS - 1 outliers in a row (the
        guard judges a push against the other islands' recent ones, and an honest push early in a run was refused
        by 0.5%: the island keeps its progress, which its next push carries again; MAX_OUTLIERS in a row, with no
        merge of its pushes between, say its training diverged and fail it). Its reason is logged here and by the
        syncer."""
        if e.code not in ("duplicate", "stale", "outlier"):
            return None
        f, v = e.fragment, e.base_version
        if not (isinstance(f, int) and isinstance(v, int)):
            return None
        if e.code == "outlier":
            self.outliers += 1
            if self.outliers >= MAX_OUTLIERS:
                return None
            log.warning("yeto-patch: step %d: the syncer refused the push of fragment %s relative to v%s as an "
                        "outlier (%d in a row; %d fail the island): %s", self.step(), f, v, self.outliers,
                        MAX_OUTLIERS, e.message)
        with self._lock:
            mine = self._unanswered.get(f, [])
            u = next((u for u in mine if u.push.base_version == v), None)
            self._unanswered[f] = [x for x in mine if x is not u]
        if e.code == "duplicate":   # sent again after a lost link or a restart, or asked again: counted once
            (log.debug if u is not None and u.again else log.info)(
                "yeto-patch: step %d: the syncer already holds this island's push of fragment %s relative to v%s; "
                "it counts once", self.step(), f, v)
        elif e.code == "stale":
            log.warning("yeto-patch: step %d: the syncer refused the push of fragment %s relative to v%s as stale "
                        "(it merged on without this island): %s", self.step(), f, v, e.message)
        return Refusal(f, v, e.code, str(e.message))

    def final_model(self, last_step: int, deadline: float, slice_s: float, drain: bool):
        """``finish`` for at most `slice_s`; an EngineError once the syncer has been unreachable for
        YETO_DILOCO_TIMEOUT (`deadline`: YETO_DILOCO_TIMEOUT after the final cut began, the earliest it gives up).
        While the syncer is alive the wait goes on (the others may train on for long), with a log line a minute."""
        s = self.settings
        if self._final_wait is None:   # (the other islands may train on for long: only an unreachable syncer ends it)
            self._final_wait = Patience(s.timeout, self, "the final model", f"the syncer at {self.address}",
                                        self.step, since=deadline - s.timeout)
        self._final_wait.check()
        return self.finish(last_step, slice_s, drain)

    def finish(self, last_step: int, timeout: float, drain: bool):
        """One bounded try at the final model: {fragment: Base}, or None to try again (a reconnect happened, or
        it is not complete yet). `drain`: wait for the pushes queued first."""
        from yeto_patch.wire.client import recoverable
        from yeto_patch.wire.frames import WireTimeout
        try:
            if self.sender is not None and drain:
                self.sender.drain(timeout)
            return self.client.finish(last_step=last_step, timeout=max(0.1, timeout))
        except Exception as e:  # noqa: BLE001
            if isinstance(e, WireTimeout) and not self.client.conn_lost():
                return None
            if not recoverable(e):
                raise
            self.reconnect(e)   # final pushes the syncer lacks are sent again; FINAL again
            return None

    # ---------------------------------------------------------------------------------------------- closing
    @property
    def run_ids(self) -> list:
        """[the syncer's run id] (one syncer: one shard), as ``ShardedLink.run_ids``."""
        return [self.run_id]

    def close(self, graceful: bool = True) -> None:
        """BYE (after the queued pushes when `graceful`); idempotent."""
        self._closed = True
        sender, client, self.sender, self.client = self.sender, self.client, None, None
        if sender is not None and graceful:
            try:
                sender.close(5.0)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass

    def shutdown_quietly(self) -> None:
        self._closed = True
        try:
            if self.client is not None:
                self.client.close()
        except Exception:  # noqa: BLE001
            pass
