"""Rounds per fragment: accepting pushes, folding them, deciding when to merge, merging.

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
* A round merges when every current member (alive by lease, not finished) answered and at least ``quorum``
  of the islands that have not finished did, once at least ``quorum`` islands have joined the run (so a late
  launch is not left behind and a crashed island is waited for), or when ``quorum``
  answered and ``grace_s`` passed since the quorum was reached, or when ``timeout_s`` passed since the first
  answer and at least ``quorum`` answered.  Otherwise it keeps waiting and says so in the log.
* Weights: ``equal`` (1 per push), ``steps`` or ``tokens`` (as reported by the push, bounded by
  ``MAX_PUSH_STEPS`` / ``MAX_PUSH_TOKENS``: exact float64 weights whose sums stay finite).  The outer gradient
  is ``sum(w_i * delta_i) / sum(w_i)`` in float32 (a round whose weights sum to zero merges ``g = 0``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from ..wire import codecs
from ..wire.frames import CodecError
from .fragment import Fragment
from .layout import fragment_numels, partition
from .limits import stateless_members
from .members import Member
from .merge import ChunkRunner
from .outer import NonFiniteMerge, outer_lr_inputs
from .records import MergeRecord
from .round_state import _Contrib, _Round, _refusal_code, validate_encoded
from .shards import ShardSpec, assign
from .settings import (INT64_MAX, MAX_PUSH_STEPS, MAX_PUSH_TOKENS, WEIGHTINGS, MergeSettings, Push,
                       PushRefused, RoundSettings, bounded_int, shown)

__all__ = ["Coordinator"]

log = logging.getLogger("yeto.syncer")
_Fragment = Fragment  # (the name this module used before fragments got their own owner)


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
        self.opt = merge.optimizer()
        self.runner = runner or ChunkRunner()
        self.clock = clock
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.manifest: Optional[list] = None
        self.layout: Optional[list] = None
        self.frags: list[_Fragment] = []   # every fragment of the layout (state only in those this shard owns)
        self.shard = shard
        self.owned: list[int] = []        # this shard's fragments (shards.assign), ascending
        self._owners: list[list[int]] = []   # every shard's fragments (for refusals naming the owner)
        self.members: dict[str, Member] = {}
        self.seen: set = set()  # (island, fragment, base_version) accepted
        self.merges_total = 0
        self.initialized = False
        self.protect: Optional[Callable[[int], None]] = None  # called before a fragment's state changes
        self.guard = None  # a guard.NormGuard: refuses pushes far outside what the fragment has seen
        self._spare: Optional[np.ndarray] = None  # one released accumulator, reused (no fresh page faults)
        self._spare_lock = threading.Lock()
        # --base-wire int8/int4: merged bases go out as quantized updates of a shadow base (what every island
        # holds), with the quantization error left in base - shadow and so carried into the next update
        self.down_codec: Optional[str] = None
        self.down_block = codecs.DEFAULT_BLOCK

    def _take_acc(self, n: int) -> np.ndarray:
        with self._spare_lock:
            sp = self._spare
            if sp is not None and sp.size >= n:
                self._spare = None
                acc = sp[:n]
                self.runner.map(n, lambda a, b: acc[a:b].fill(0.0))
                return acc
        return np.zeros(n, np.float32)

    def _give_acc(self, acc: Optional[np.ndarray]) -> None:
        if acc is None:
            return
        full = acc.base if isinstance(acc.base, np.ndarray) else acc
        with self._spare_lock:
            if self._spare is None or full.size > self._spare.size:
                self._spare = full

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

    def mine(self) -> list[_Fragment]:
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
    def join(self, island: str, incarnation: str) -> Member:
        now = self.clock()
        with self.lock:
            self._prune()
            m = self.members.get(island)
            alive = [i for i, mm in self.members.items() if mm.alive(now, self.rs.lease_s) and i != island]
            if m is None and len(alive) >= self.rs.islands:
                raise PushRefused("too-many-islands", f"this run expects {self.rs.islands} island(s) and already has "
                                                      f"{sorted(alive)}; refusing island {island!r}")
            if m is None:
                m = self.members[island] = Member(island, incarnation, now)
            else:
                if m.incarnation != incarnation:
                    m.finished = False
                    m.final_fragments = set()
                m.incarnation = incarnation
                m.last_seen = now
            m.connected += 1
            self.cond.notify_all()
            return m

    def touch(self, island: str) -> None:
        with self.lock:
            m = self.members.get(island)
            if m is not None:
                m.last_seen = self.clock()

    def disconnected(self, island: str, bye: bool) -> None:
        with self.lock:
            m = self.members.get(island)
            if m is None:
                return
            m.connected = max(0, m.connected - 1)
            if bye and not m.connected:
                m.last_seen = -float("inf")  # leaves the expected set now
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
        for i in stateless_members(self.members, busy, self.clock(), self.rs.lease_s):
            del self.members[i]

    def finish(self, island: str, last_step: int) -> None:
        with self.lock:
            m = self.members.get(island)
            if m is not None:
                m.finished = True
                m.last_step = max(m.last_step, int(last_step))
                self.cond.notify_all()

    def alive_members(self, now: Optional[float] = None) -> list[str]:
        now = self.clock() if now is None else now
        with self.lock:
            return sorted(i for i, m in self.members.items() if m.alive(now, self.rs.lease_s))

    def all_finished(self) -> bool:
        now = self.clock()
        with self.lock:
            alive = [m for m in self.members.values() if m.alive(now, self.rs.lease_s)]
            # FINALs end the run only once the roster (the quorum of islands, as for rounds) has joined: an
            # island that finished before the others ever joined must not cut the run at v0 without them
            return bool(alive) and all(m.finished for m in alive) and self._joined_enough()

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
    def _weight(self, p: Push) -> float:
        """The push's weight (float64, exact: the counters are bounded) after checking its counters."""
        for name, hi in (("local_step", INT64_MAX), ("steps", MAX_PUSH_STEPS), ("tokens", MAX_PUSH_TOKENS)):
            v = getattr(p, name)
            if not bounded_int(v, hi):
                raise PushRefused("bad-push", f"push reports {name} = {shown(v)}; need an integer in [0, {hi}]")
        if self.ms.weights == "equal":
            return 1.0
        return float(p.steps if self.ms.weights == "steps" else p.tokens)

    def _checked(self, p: Push) -> tuple[_Fragment, float]:
        """(lock held) The push's fragment and weight, after the checks of its fields; raises PushRefused."""
        if not self.initialized:
            raise PushRefused("not-initialized", "the run has no base yet (waiting for INIT); push refused")
        if not bounded_int(p.fragment, len(self.frags) - 1):
            raise PushRefused("bad-fragment", f"push for fragment {shown(p.fragment)}; the layout has "
                                              f"{len(self.frags)} fragments")
        wrong = self.owner_refusal(p.fragment, "push")
        if wrong is not None:
            raise wrong
        f = self.frags[p.fragment]
        if not bounded_int(p.base_version, f.version):
            raise PushRefused("bad-base", f"push of fragment {f.index} relative to base v{shown(p.base_version)}, "
                                          f"but the syncer's newest is v{f.version}")
        try:
            codecs.check_codec(p.codec, p.block)
        except CodecError as e:
            raise PushRefused("bad-codec", str(e)) from None
        w = self._weight(p)
        p.nbytes = memoryview(p.body).nbytes
        return f, w

    def _admit(self, p: Push, f: _Fragment) -> tuple[Optional[str], int]:
        """(lock held) The checks of a push against the fragment's state now: ("closed", 0) when the fragment
        takes no more pushes, else (None, lag); raises PushRefused for a stale or duplicate push."""
        if f.closed:
            return "closed", 0
        lag = f.version - p.base_version + (1 if f.round.closed else 0)
        if lag > self.ms.max_base_lag:
            raise PushRefused("stale", f"push of fragment {f.index} is relative to base v{p.base_version} but the "
                                       f"syncer is at v{f.version} (lag {lag} > max-base-lag "
                                       f"{self.ms.max_base_lag}); pull the current base and push again")
        if (p.island, f.index, p.base_version) in self.seen:
            raise PushRefused("duplicate", f"island {p.island!r} already pushed fragment {f.index} relative to "
                                           f"base v{p.base_version}; duplicate refused")
        return None, lag

    def accept(self, p: Push) -> tuple[str, int]:
        """Accept a push (fold it if it answers the open round). Returns (status, lag); raises PushRefused.

        A push held in its encoded form (carried, or ``exact``) is validated outside the lock first; the state
        checks (:meth:`_admit`) then run on the state at registration, looking again if a merge moved it."""
        with self.lock:
            f, w = self._checked(p)
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
                held = lag != 0 or self.ms.exact
                if not held or validated:
                    why = guard.admit(f.index, norm, p.island, base_norm, first_round=first_round) \
                        if guard is not None else None
                    if why is not None:
                        raise PushRefused("outlier", why)
                    c = self._register(p, f, r, w, lag, held, key)
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

    def _register(self, p: Push, f: _Fragment, r: _Round, w: float, lag: int, held: bool,
                  key) -> Optional[_Contrib]:
        """(lock held) Record an accepted push; returns the contribution when it still has to be folded."""
        c = _Contrib(p, w, lag=lag, held=held)
        self.seen.add(key)
        if lag != 0:
            self._credit(p, f)
            f.carry.append(c)
            self.cond.notify_all()
            return None
        if not self.ms.exact:
            r.inflight += 1
        r.contribs[p.island] = c
        if self.ms.exact:
            c.folded = True
            self._answer(r, p, f)
            self.cond.notify_all()
            return None
        return c

    def _answer(self, r: _Round, p: Push, f: _Fragment) -> None:
        """(lock held) A push became an answer of round ``r``: round timing and the island's bookkeeping."""
        now = self.clock()
        if r.t_first is None:
            r.t_first = now
        if r.t_quorum is None and len(r.answered()) >= self.rs.k:
            r.t_quorum = now
        self._credit(p, f)

    def _credit(self, p: Push, f: _Fragment) -> None:
        """(lock held) The island's bookkeeping for an accepted push; a push refused while it is being folded
        must leave none (its final flag would drop the island from the fragment's expected set)."""
        m = self.members.get(p.island)
        if m is not None:
            m.last_seen = self.clock()
            if p.final:
                m.final_fragments.add(f.index)
            m.last_step = max(m.last_step, int(p.local_step or 0))

    def _fold(self, p: Push, f: _Fragment, r: _Round, c: _Contrib, w: float, key) -> tuple[str, int]:
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
                self._answer(r, p, f)
            else:  # it never was an answer: nothing to undo but its registration
                r.contribs.pop(p.island, None)
                self.seen.discard(key)
            self.cond.notify_all()
        if err is not None:
            log.warning("refused push of fragment %d from island %s: %s", f.index, p.island, err)
            raise PushRefused(_refusal_code(err), f"push of fragment {f.index} refused: {err}")
        return "accepted", 0

    # --------------------------------------------------------------------------------------- scheduling
    def expected(self, f: _Fragment, now: float) -> set:
        return {i for i, m in self.members.items()
                if m.alive(now, self.rs.lease_s) and not m.finished and f.index not in m.final_fragments}

    def _joined_enough(self) -> bool:
        """(lock held) Whether at least ``quorum`` islands have joined this run so far.  Until then "every
        current member answered" does not close a round, so islands launched a little later than the first
        one are not left behind by rounds merged without them.  Islands that joined and then left (lease,
        BYE, final cut) still count: they leave the expected set as before."""
        return len(self.members) >= min(self.rs.k, self.rs.islands)

    def _floor(self, f: _Fragment) -> int:
        """(lock held) The fewest answers that may close a round of ``f`` by "every member answered": the
        quorum, or fewer once islands have finished (final push or last step).  An island that crashed, lost
        its link or said BYE before its end still counts, so with ``--quorum`` equal to ``--islands`` (a fixed
        roster) the others wait for it to come back instead of merging without it."""
        active = sum(1 for m in self.members.values() if not m.finished and f.index not in m.final_fragments)
        return max(1, min(self.rs.k, active))

    def due(self) -> list[int]:
        """Fragments whose open round should merge now (logs rounds that wait below quorum past the timeout)."""
        now = self.clock()
        out = []
        with self.lock:
            for f in self.mine():
                r = f.round
                answered = r.answered()
                if f.closed or r.closed or not answered:
                    continue
                exp = self.expected(f, now)
                if exp <= answered and self._joined_enough() and len(answered) >= self._floor(f):
                    out.append(f.index)
                elif len(answered) >= self.rs.k:
                    if r.t_quorum is None:
                        r.t_quorum = now
                    if now >= r.t_quorum + self.rs.grace_s or now >= r.t_first + self.rs.timeout_s:
                        out.append(f.index)
                elif now >= r.t_first + self.rs.timeout_s and now >= r.next_wait_log:
                    r.next_wait_log = now + max(self.rs.timeout_s, 1.0)
                    log.warning("fragment %d round on v%d waits: %d of quorum %d answered (%s); missing %s",
                                f.index, f.version, len(answered), self.rs.k, sorted(answered),
                                sorted(exp - answered))
        return out

    def next_deadline(self) -> Optional[float]:
        """Earliest clock time at which a round may become due by grace/timeout (None: only events matter)."""
        with self.lock:
            ts = []
            for f in self.mine():
                r = f.round
                if f.closed or r.closed or len(r.answered()) < self.rs.k:
                    continue  # below quorum only events (pushes, lease expiry) can make a round due
                if r.t_quorum is not None:
                    ts.append(r.t_quorum + self.rs.grace_s)
                ts.append(r.t_first + self.rs.timeout_s)
            return min(ts) if ts else None

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

    def _merge_locked(self, f: _Fragment, index: int, force: bool) -> Optional[MergeRecord]:
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

    def _merge_fold(self, f: _Fragment, r: _Round, fresh: list, carried: list, version: int, index: int) -> tuple:
        """(accumulator, total weight, responders) of a merge: fresh pushes were folded on arrival (here only with
        --exact, in island order), carried ones are folded now with weight x late_factor^lag."""
        acc = r.acc
        if acc is None:
            acc = r.acc = self._take_acc(f.numel)
        if self.ms.exact:
            for c in fresh:
                codecs.decode_accumulate(c.push.codec, c.push.body, f.numel, c.weight_raw, acc, c.push.block,
                                         threads=self.runner.threads)
        weights = [c.weight_raw for c in fresh]
        responders = [self._resp(c, 0, c.weight_raw, False) for c in fresh]
        for c in carried:
            lag = version - c.push.base_version
            w = c.weight_raw * (self.ms.late_factor ** lag)
            try:
                codecs.decode_accumulate(c.push.codec, c.push.body, f.numel, w, acc, c.push.block,
                                         threads=self.runner.threads)
            except CodecError as e:  # validated on arrival, so not expected; never poisons the round
                log.error("fragment %d: carried push from island %s dropped: %s", index, c.island, e)
                continue
            weights.append(w)
            responders.append(self._resp(c, lag, w, True))
        total = 0.0
        for w in weights:  # fixed order
            total += w
        return acc, total, responders

    def _base_update(self, f: _Fragment, scratch: np.ndarray, version: int) -> None:
        """shadow += decode(encode(base - shadow)) (the merge holds the fragment's write lock; ``scratch`` is the
        spent accumulator)."""
        f.encode_update(self.down_codec, self.down_block, scratch, version, self.runner.threads)

    @staticmethod
    def _resp(c: _Contrib, lag: int, w: float, carried: bool) -> dict:
        p = c.push
        return {"island": p.island, "lag": lag, "weight": w, "carried": carried, "base_version": p.base_version,
                "steps": p.steps, "tokens": p.tokens, "local_step": p.local_step, "codec": p.codec,
                "bytes": int(p.nbytes)}

    def resumed(self, merges_total: int, members: dict, merged: set) -> None:
        """(restore) The rest of a checkpoint's committed state, once every fragment's arrays are installed."""
        with self.lock:
            self.merges_total = merges_total
            self.members.update(members)
            self.seen = merged
            self.initialized = True
            self._check_total_rounds()

