"""Rounds per fragment: accepting pushes, folding them, merging; the coordinator that owns the syncer's state.

This module holds no sockets: the server feeds it pushes and asks it which fragments are due.  Thread-safe:
one central lock (``self.lock`` / ``self.cond``) protects the bookkeeping; decoding and folding a push into
its round's accumulator happens outside that lock (under the round's own fold lock), and so does the merge
arithmetic (the fragment's round is marked closed while it merges, so nothing else touches it).

Semantics (see docs/protocol.md, "Syncer protocol"):

* A fragment's version counts its merges.  The open round of a fragment merges onto base ``version``.
* A push relative to base ``b`` has lag ``version - b`` (plus one while the round it belongs to is merging).
  Lag 0 answers the open round and is folded into its accumulator as it arrives (``exact`` mode holds the
  encoded pushes and folds them at merge time in island order).  A lag in ``1..max_base_lag`` is accepted and
  carried, in its encoded wire form, into the next merge of that fragment, with its weight scaled by
  ``late_factor ** lag``.  A larger lag is refused (the island must pull).  A second push for the same
  (island, fragment, base) is refused.  A non-finite push is refused before it touches anything.
* Who a round waits for: syncer/rounds/roster.py (fixed roster, explicit quorum, elastic); when it merges:
  syncer/rounds/due.py, with the adaptive grace window of syncer/rounds/window.py.
* Weights: syncer/rounds/weights.py (checked steps, tokens per step fixed per island process, each push at most a few
  times the other islands' median).  The outer gradient is ``sum(w_i * delta_i) / sum(w_i)`` in float32 (a round
  whose weights sum to zero merges ``g = 0``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from ...wire import codecs
from ...wire.frames import CodecError
from .due import due_now, next_deadline, pace, round_status
from ..model.fragment import Fragment
from .window import ArrivalBook
from ..model.layout import fragment_numels, partition
from .members import Member
from ..model.runner import ChunkRunner
from ..model.outer import NonFiniteMerge, outer_lr_inputs
from .push_checks import check_counters, push_standing, push_target
from .records import MergeRecord
from .roster import Roster
from .round import AccumulatorPool, _Contrib, _Round, _refusal_code, fold_held, validate_encoded
from ..shards.spec import ShardSpec, assign
from .settings import WEIGHTINGS, MergeSettings, Push, PushRefused, RoundSettings, bounded_int, shown
from .weights import WeightBook

__all__ = ["Coordinator"]

log = logging.getLogger("yeto.syncer")
MAX_RATE = 1e6            # steps/s an island's heartbeat may say (larger: ignored)


class Coordinator:
    def __init__(self, merge: MergeSettings, rounds: RoundSettings, runner: Optional[ChunkRunner] = None,
                 clock: Callable[[], float] = time.monotonic, shard: ShardSpec = ShardSpec()):
        if merge.weights not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {merge.weights!r} (known: {', '.join(WEIGHTINGS)})")
        if merge.max_base_lag < 0:
            raise ValueError("max_base_lag must be >= 0")
        if not 0.0 <= merge.late_factor <= 1.0:
            raise ValueError("late_factor must be in [0, 1]")
        self.ms = merge
        self.rs = rounds
        self.roster = Roster(rounds, clock)
        self.arrivals = ArrivalBook()        # arrival offsets and round periods (the adaptive grace window)
        self.book = WeightBook(merge.weights)   # checked, bounded merge weights
        self.opt = merge.optimizer()
        self.runner = runner or ChunkRunner()
        self.clock = clock
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.manifest: Optional[list] = None
        self.layout: Optional[list] = None
        self.frags: list[Fragment] = []   # every fragment of the layout (state only in those this shard owns)
        self.shard = shard
        self.owned: list[int] = []        # this shard's fragments (shards.assign), ascending
        self._owners: list[list[int]] = []   # every shard's fragments (for refusals naming the owner)
        self.members: dict[str, Member] = self.roster.members
        self.seen: set = set()  # (island, fragment, base_version) accepted
        self.merges_total = 0
        self.initialized = False
        self.protect: Optional[Callable[[int], None]] = None  # called before a fragment's state changes
        self.guard = None  # a guard.NormGuard: refuses pushes far outside what the fragment has seen
        self._accs = AccumulatorPool()   # one released accumulator, reused (no fresh page faults)
        # --base-wire int8/int4: merged bases go out as quantized updates of a shadow base (what every island
        # holds), with the quantization error left in base - shadow and so carried into the next update
        self.down_codec: Optional[str] = None
        self.down_block = codecs.DEFAULT_BLOCK

    def _take_acc(self, n: int) -> np.ndarray:
        return self._accs.take(n, self.runner)

    def _give_acc(self, acc: Optional[np.ndarray]) -> None:
        self._accs.give(acc)

    # ------------------------------------------------------------------------------------------ setup
    def set_manifest(self, manifest: list, fragments: int) -> None:
        with self.lock:
            layout = partition(manifest, fragments)
            self.manifest = manifest
            self.layout = layout
            numels = fragment_numels(manifest, layout)
            self._owners = assign(numels, self.shard.count)
            self.frags = [Fragment(i, n, _Round(0)) for i, n in enumerate(numels)]
            self.owned = self._owners[self.shard.index]

    def mine(self) -> list[Fragment]:
        """The fragments this shard owns (all of them unless sharded)."""
        return [self.frags[i] for i in self.owned]

    def owner_refusal(self, index: int, what: str) -> Optional[PushRefused]:
        """A refusal for `what` of a fragment another shard owns (None: this shard owns it)."""
        if index in self.owned:
            return None
        owner = next(s for s, fr in enumerate(self._owners) if index in fr)
        return PushRefused("wrong-shard", f"{what} of fragment {index} sent to syncer shard {self.shard}; "
                                          f"shard {owner} owns it")

    def missing_init(self) -> list[int]:
        with self.lock:
            return [f.index for f in self.mine() if not f.has_base]

    def drop_partial_init(self) -> None:
        """The initializing island left before INIT completed: forget what it sent (another island sends it)."""
        with self.lock:
            if not self.initialized:
                for f in self.mine():
                    f.drop_init()

    def init_fragment(self, index: int, values: np.ndarray) -> bool:
        """Install INIT values (float32, finite) for a fragment; True when every fragment has its base."""
        with self.lock:
            if self.initialized:
                raise PushRefused("already-initialized", "the run is already initialized; INIT ignored")
            if not bounded_int(index, len(self.frags) - 1):
                raise PushRefused("bad-fragment", f"INIT for fragment {shown(index)}, the layout has "
                                                  f"{len(self.frags)}")
            wrong = self.owner_refusal(index, "INIT")
            if wrong is not None:
                raise wrong
            f = self.frags[index]
            if f.has_base:
                raise PushRefused("duplicate-init", f"a second INIT of fragment {index}; refused")
            try:
                f.check_init(values)
            except ValueError as e:
                raise PushRefused("bad-init", str(e)) from None
        a = f.first_nonfinite(values)
        if a is not None:
            raise PushRefused("nonfinite", f"INIT of fragment {index} has a non-finite value near {a}")
        with self.lock:
            if f.has_base:   # (one initializer, one reader thread: not expected)
                raise PushRefused("duplicate-init", f"a second INIT of fragment {index}; refused")
            f.install_init(values, shadow=self.down_codec is not None)
            if all(fr.has_base for fr in self.mine()):
                for fr in self.mine():
                    self.opt.ensure_state(fr.t)
                self.initialized = True
                self._check_total_rounds()
                self.cond.notify_all()
                return True
            return False

    def versions(self) -> list[Optional[int]]:
        """Each fragment's version; None for those another shard owns."""
        with self.lock:
            mine = set(self.owned)
            return [f.version if f.index in mine else None for f in self.frags]

    # ------------------------------------------------------------------------------------- membership
    @property
    def rs(self) -> RoundSettings:
        return self._rs

    @rs.setter
    def rs(self, value: RoundSettings) -> None:
        self._rs = value
        if getattr(self, "roster", None) is not None:
            self.roster.rs = value

    def join(self, island: str, incarnation: str) -> Member:
        with self.lock:
            self._prune()
            old = self.members.get(island)
            if old is not None and old.incarnation != incarnation:
                self.arrivals.forget(island)   # a restarted island: its old arrival times say nothing now
            m = self.roster.join(island, incarnation)
            self.cond.notify_all()
            return m

    def touch(self, island: str, step=None, rate=None) -> None:
        """A message from ``island`` renewed its lease; a heartbeat also says its step and compute rate (bounded
        numbers; anything else is ignored)."""
        with self.lock:
            self.roster.touch(island)
            m = self.members.get(island)
            if m is not None:
                if bounded_int(step):
                    m.step = step
                if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= MAX_RATE:
                    m.rate = float(rate)

    def disconnected(self, island: str, bye: bool) -> None:
        with self.lock:
            self.roster.disconnected(island, bye)
            self._prune()
            self.cond.notify_all()

    def prune(self) -> None:
        """Forget ledger entries that carry no state now (also done on every join and disconnect)."""
        with self.lock:
            self._prune()

    def _prune(self) -> None:
        """(lock held) Forget ledger entries that carry no state (churned ids must not grow the ledger and the
        checkpoint forever; see limits.stateless_members)."""
        busy = {k[0] for k in self.seen}
        for f in self.mine():
            busy.update(c.island for c in list(f.round.contribs.values()) + list(f.carry))
        self.roster.prune(busy)

    def finish(self, island: str, last_step: int) -> None:
        with self.lock:
            self.roster.finish(island, last_step)
            self.cond.notify_all()

    def alive_members(self, now: Optional[float] = None) -> list[str]:
        with self.lock:
            return self.roster.alive(now)

    def all_finished(self) -> bool:
        with self.lock:
            return self.roster.all_finished()

    def all_closed(self) -> bool:
        with self.lock:
            return self.initialized and all(f.closed for f in self.mine())

    def _check_total_rounds(self) -> None:
        tr = self.rs.total_rounds
        if tr is not None:
            for f in self.mine():
                if f.version >= tr:
                    f.closed = True

    # ------------------------------------------------------------------------------------------ pushes
    def _checked(self, p: Push) -> tuple[Fragment, tuple]:
        """(lock held) The push's fragment and (weight, claimed weight, held until the merge), after the checks of
        its fields (syncer/rounds/push_checks.py, syncer/rounds/weights.py); raises PushRefused."""
        f = push_target(p, self.initialized, self.frags, self.owner_refusal)
        check_counters(p)
        w = self.book.weight(p)
        p.nbytes = memoryview(p.body).nbytes
        return f, w

    def _admit(self, p: Push, f: Fragment) -> tuple[Optional[str], int]:
        """(lock held) The checks of a push against the fragment's state now (push_checks.push_standing)."""
        return push_standing(p, f, self.seen, self.ms.max_base_lag)

    def accept(self, p: Push) -> tuple[str, int]:
        """Accept a push (fold it if it answers the open round). Returns (status, lag); raises PushRefused.

        A push held in its encoded form (carried, or ``exact``) is validated outside the lock first; the state
        checks (:meth:`_admit`) then run on the state at registration, looking again if a merge moved it."""
        with self.lock:
            f, (w, claimed, unref) = self._checked(p)
        key = (p.island, f.index, p.base_version)
        guard = self.guard
        first_round = p.base_version == 0   # (the guard keeps the first round's pushes apart: guard.py)
        norm = guard.measure(p.codec, p.body, f.numel, p.block, cold=(f.index, p.island, f.t.base, first_round)) \
            if guard is not None else None
        base_norm = guard.base_norm(f.index, f.version, f.t.base) \
            if norm is not None and guard.needs_base_norm(f.index) else 0.0
        validated = False
        while True:
            with self.lock:
                status, lag = self._admit(p, f)
                if status is not None:
                    return status, 0
                r = f.round
                held = lag != 0 or self.ms.exact or unref
                if not held or validated:
                    why = guard.admit(f.index, norm, p.island, base_norm, first_round=first_round) \
                        if guard is not None else None
                    if why is not None:
                        raise PushRefused("outlier", why)
                    c = self._register(p, f, r, _Contrib(p, w, lag=lag, held=held, claimed=claimed,
                                                         unreferenced=unref), key)
                    if c is None:
                        return ("carried", lag) if lag else ("accepted", 0)
                    break
            try:  # a held push is validated now: it is decoded only at merge time
                validate_encoded(p.codec, p.body, f.numel, p.block)
            except CodecError as e:
                log.warning("refused push of fragment %d from island %s: %s", f.index, p.island, e)
                raise PushRefused(_refusal_code(e), f"push of fragment {f.index} refused: {e}") from None
            validated = True
        return self._fold(p, f, r, c, w, key)

    def _register(self, p: Push, f: Fragment, r: _Round, c: _Contrib, key) -> Optional[_Contrib]:
        """(lock held) Record an accepted push; returns the contribution when it still has to be folded."""
        self.seen.add(key)
        if c.lag != 0:
            self._credit(p, f, c)
            f.carry.append(c)
            self.cond.notify_all()
            return None
        r.contribs[p.island] = c
        if c.held:
            c.folded = True
            self._answer(r, p, f, c)
            self.cond.notify_all()
            return None
        r.inflight += 1
        return c

    def _answer(self, r: _Round, p: Push, f: Fragment, c: _Contrib) -> None:
        """(lock held) A push became an answer of round ``r``: round timing and the island's bookkeeping."""
        now = self.clock()
        if r.t_first is None:
            r.t_first = now
            self.arrivals.round_opened(f.index, r.base_version, now)
        if r.t_quorum is None and len(r.answered()) >= self.rs.k:
            r.t_quorum = now
        self._credit(p, f, c)

    def _credit(self, p: Push, f: Fragment, c: _Contrib) -> None:
        """(lock held) The island's bookkeeping for an accepted push (its arrival time, its checked weight, its
        final flag); a push refused while it is being folded leaves none (its final flag would drop the island
        from the fragment's expected set)."""
        now = self.clock()
        self.arrivals.arrived(p.island, f.index, p.base_version, now)
        m = self.members.get(p.island)
        if m is not None:
            m.last_seen = now
            if p.final:
                m.final_fragments.add(f.index)
            m.last_step = max(m.last_step, int(p.local_step or 0))

    def _fold(self, p: Push, f: Fragment, r: _Round, c: _Contrib, w: float, key) -> tuple[str, int]:
        """Streaming fold of an accepted push into its round's accumulator, outside the central lock."""
        err = None
        try:
            with r.fold_lock:
                if r.acc is None:
                    r.acc = self._take_acc(f.numel)
                codecs.decode_accumulate(p.codec, p.body, f.numel, w, r.acc, p.block,
                                         threads=self.runner.threads)
        except CodecError as e:
            err = e
        with self.lock:
            r.inflight -= 1
            c.push.body = None  # the decoded values live in the accumulator now
            if err is None:
                c.folded = True
                self._answer(r, p, f, c)
            else:  # it never was an answer: nothing to undo but its registration
                r.contribs.pop(p.island, None)
                self.seen.discard(key)
            self.cond.notify_all()
        if err is not None:
            log.warning("refused push of fragment %d from island %s: %s", f.index, p.island, err)
            raise PushRefused(_refusal_code(err), f"push of fragment {f.index} refused: {err}")
        return "accepted", 0

    # --------------------------------------------------------------------------------------- scheduling
    def expected(self, f: Fragment, now: float) -> set:
        return self.roster.expected(f.index, now)

    def due(self) -> list[int]:
        """Fragments whose open round should merge now (logs rounds that wait below quorum past the timeout)."""
        with self.lock:
            return due_now(self.rs, self.roster, self.arrivals, self.mine(), self.clock())

    def next_deadline(self) -> Optional[float]:
        """Earliest clock time at which a round may become due by time (None: only events matter)."""
        with self.lock:
            return next_deadline(self.rs, self.roster, self.arrivals, self.mine(), self.clock())

    def round_status(self, island: str) -> dict:
        """What ``island`` may be waiting for (the HEARTBEAT the syncer sends it; syncer/rounds/due.py)."""
        with self.lock:
            return round_status(self.rs, self.roster, self.arrivals, self.mine(), island, self.clock())

    def pace(self) -> float:
        """The fleet's pace in steps/s (syncer/rounds/due.py)."""
        with self.lock:
            return pace(self.roster, self.clock())

    def pending(self, index: int) -> bool:
        with self.lock:
            f = self.frags[index]
            return bool(f.round.contribs or f.carry)

    # ------------------------------------------------------------------------------------------- merge
    def merge(self, index: int, force: bool = False, wait_streams: bool = True) -> Optional[MergeRecord]:
        """Merge the open round of fragment ``index``. ``force`` (final cut) merges carried pushes alone too.

        The fragment's base is written in place, so the merge holds its write lock: bases of this fragment being
        streamed to islands finish first.  With ``wait_streams=False`` a merge that would have to wait for such
        a stream returns None at once (the round stays open; the caller retries later and merges other
        fragments meanwhile)."""
        f = self.frags[index]
        with f.writing(wait_streams) as held:
            return self._merge_locked(f, index, force) if held else None

    def _merge_locked(self, f: Fragment, index: int, force: bool) -> Optional[MergeRecord]:
        with self.lock:
            r = f.round
            if r.closed or (f.closed and not force):
                return None
            r.closed = True
            while r.inflight:
                self.cond.wait()
            fresh = sorted(r.contribs.values(), key=lambda c: c.island)
            carried = sorted(f.carry, key=lambda c: (c.island, c.push.base_version))
            if not fresh and not (force and carried):
                r.closed = False
                return None
            f.carry = []
            version = f.version
            expected = sorted(self.expected(f, self.clock()))
            if self.rs.adaptive and fresh:   # up, waited for (or not), and not there: a miss for the window
                for i in set(expected) - {c.island for c in fresh}:
                    self.arrivals.missed(i)
            t_first = r.t_first if r.t_first is not None else self.clock()
        t0 = self.clock()
        t_wall = time.time()
        responders, total = [], 0.0
        try:
            acc, total, responders = self._merge_fold(f, r, fresh, carried, version, index)
            if self.protect is not None:
                self.protect(index)
            steps, blended = outer_lr_inputs([c.push for c in fresh or carried])
            outer_lr = self.opt.lr_at(steps, blended)
            norm = self.opt.step(f.t, acc, total, version + 1, self.runner, steps=steps, blended=blended)
            ok, reason = True, ""
        except (NonFiniteMerge, CodecError) as e:
            ok, reason, norm, outer_lr = False, str(e), float("nan"), None
        if ok and f.t.shadow is not None:
            self._base_update(f, acc, version + 1)
        nbytes = sum(r_["bytes"] for r_ in responders)
        with self.lock:
            for c in fresh + carried:
                c.push.body = None
            if ok:
                f.version = version + 1
                self.merges_total += 1
                for c in fresh + carried:
                    self.book.merged(c.push, c.claimed)
                    m = self.members.get(c.island)
                    if m is not None:
                        m.credit(c.push.steps, c.push.tokens)
                self._check_total_rounds()
                lo = f.version - self.ms.max_base_lag - 1
                self.seen = {k for k in self.seen if k[1] != index or k[2] >= lo}
            else:
                log.error("fragment %d: merge at v%d refused (%s); pushes from %s dropped, state unchanged",
                          index, version, reason, [x["island"] for x in responders])
                for c in fresh + carried:
                    self.seen.discard((c.island, index, c.push.base_version))
            f.round = _Round(f.version)
            self.cond.notify_all()
        self._give_acc(r.acc)
        r.acc = None
        t1 = self.clock()
        return MergeRecord(fragment=index, version=f.version, ok=ok, responders=responders, total_weight=total
                           if ok else 0.0, bytes=nbytes, quorum_s=max(0.0, t0 - t_first), merge_s=t1 - t0,
                           grad_norm=norm, expected=expected, reason=reason, t_wall=t_wall, outer_lr=outer_lr)

    def _merge_fold(self, f: Fragment, r: _Round, fresh: list, carried: list, version: int, index: int) -> tuple:
        """(accumulator, total weight, responders) of a merge (round_state.fold_held)."""
        acc = r.acc
        if acc is None:
            acc = r.acc = self._take_acc(f.numel)
        total, responders = fold_held(self.book, acc, fresh, carried, version, self.ms.late_factor, f.numel,
                                      self.runner.threads, index)
        return acc, total, responders

    def _base_update(self, f: Fragment, scratch: np.ndarray, version: int) -> None:
        """shadow += decode(encode(base - shadow)) (the merge holds the fragment's write lock; ``scratch`` is the
        spent accumulator)."""
        f.encode_update(self.down_codec, self.down_block, scratch, version, self.runner.threads)

    def resumed(self, merges_total: int, members: dict, merged: set) -> None:
        """(restore) The rest of a checkpoint's committed state, once every fragment's arrays are installed."""
        with self.lock:
            self.merges_total = merges_total
            self.members.update(members)
            self.seen = merged
            self.initialized = True
            self._check_total_rounds()

