"""The coordinator: the syncer's state of the run (fragments, their open rounds, the roster, the weights) and the
only code that changes it; no sockets (the server feeds it pushes and asks which rounds are due).

Thread-safety: one central lock (``self.lock`` / ``self.cond``) protects the bookkeeping; decoding and folding a push
into its round's accumulator happens outside that lock (under the round's own fold lock), and so does the merge
arithmetic (the round is MERGING meanwhile, so nothing else touches it).

Semantics (docs/protocol.md, "Syncer protocol"):

* A fragment's version counts its merges. Its open round (rounds/round.py, the state machine that decides when it
  merges) merges onto base ``version``.
* A push relative to base ``b`` has lag ``version - b`` (plus one while the round it belongs to is merging).
  Lag 0 answers the open round and is folded into its accumulator as it arrives (``exact`` mode holds the
  encoded pushes and folds them at merge time in island order). A lag in ``1..max_base_lag`` is accepted and
  carried, in its encoded wire form, into the next merge of that fragment, weight x ``late_factor ** lag``, joining
  its island's answer as one contribution (at most one island's cap). A larger lag is refused (the island must
  pull). A second push for the same (island, fragment, base) is refused. A non-finite push is refused first.
* Who a round waits for: rounds/roster.py; how long: rounds/round.py with the pace window of rounds/window.py.
* Weights: rounds/weights.py (checked steps, tokens per step fixed per island process, capped at a few times the
  other islands' low median). The outer gradient is ``sum(w_i * delta_i) / sum(w_i)`` in float32; a round whose
  weights sum to zero does not move the base.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple, Optional

import numpy as np

from ...wire import codec_names, codecs
from ...wire.frames import CodecError
from ...wire.schema import MAX_RHYTHM, bounded_int, shown
from ...wire.values import SyncerStatus
from ..model.fragment import GlobalFragment
from ..model.guard import init_refusal
from ..model.layout import fragment_numels, partition
from ..model.outer import NonFiniteMerge, outer_lr_inputs
from ..model.runner import ChunkRunner
from ..shards.spec import ShardSpec, assign
from .lockstep import Advice
from .members import Member
from .pushes import ReceivedPush, PushRefused, check_counters, push_standing, push_target
from .records import MergeRecord
from .round import AccumulatorPool, Contribution, Round, fold_carried, refusal_code, validate_encoded
from .roster import Roster
from .settings import WEIGHTINGS, MergeSettings, RoundSettings
from .weights import WeightBook
from .window import PaceWindow

__all__ = ["Coordinator", "IslandView", "RoundView"]

log = logging.getLogger("yeto.syncer")


class IslandView(NamedTuple):
    island: str
    finished: bool
    up: bool
    down_s: float      # seconds since its link was lost or it was last heard of (when not up)
    step: int
    rate: float
    pushes: int
    tokens: int


class RoundView(NamedTuple):
    fragment: int
    version: int
    closed: bool
    answered: list
    waits: list
    age: Optional[float]   # seconds since its first answer (None: no answer yet)


class Coordinator:
    """Built with everything it needs: ``merge`` and ``rounds`` settings, the merge ``runner``, the ``clock``, its
    ``shard``; ``guard`` (a model.guard.NormGuard or None) refuses pushes far outside what a fragment has seen;
    ``down_codec`` (``--base-wire int8/int4/topk:F+intB``): merged bases go out as encoded updates of a shadow
    base, what was not sent carried into the next update; ``protect(fragment)`` is called before a fragment's arrays
    change (a background checkpoint copies them first); ``heartbeat_s``: a lost link counts as up for one period."""

    def __init__(self, merge: MergeSettings, rounds: RoundSettings, runner: Optional[ChunkRunner] = None,
                 clock: Callable[[], float] = time.monotonic, shard: ShardSpec = ShardSpec(), *, guard=None,
                 down_codec: Optional[str] = None, down_block: int = codecs.DEFAULT_BLOCK,
                 protect: Optional[Callable[[int], None]] = None, heartbeat_s: Optional[float] = None):
        if merge.weights not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {merge.weights!r} (known: {', '.join(WEIGHTINGS)})")
        if merge.max_base_lag < 0:
            raise ValueError("max_base_lag must be >= 0")
        if not 0.0 <= merge.late_factor <= 1.0:
            raise ValueError("late_factor must be in [0, 1]")
        self.ms = merge
        self.rs = rounds
        self.roster = Roster(rounds, clock, heartbeat_s)
        self.members: dict[str, Member] = self.roster.members
        self.window = PaceWindow(self.members)   # each island's pace: whom a round waits for
        self.book = WeightBook(merge.weights)    # checked, bounded merge weights
        self.opt = merge.optimizer()
        self.runner = runner or ChunkRunner()
        self.clock = clock
        self.shard = shard
        self.guard = guard
        self.down_codec = down_codec
        self.down_block = down_block
        self.protect = protect
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.manifest: Optional[list] = None
        self.layout: Optional[list] = None
        self.frags: list[GlobalFragment] = []   # every fragment of the layout (state only in those this shard owns)
        self.rounds: list[Round] = []     # each fragment's open round
        self._next: dict[int, list] = {}  # fragment -> late pushes accepted while its round merges (the next round's)
        self._left_out: dict[int, dict] = {}  # fragment -> {island: why} of the decision that made its round due
        self.owned: list[int] = []        # this shard's fragments (shards.assign), ascending
        self._owners: list[list[int]] = []   # every shard's fragments (for refusals naming the owner)
        self.seen: set = set()  # (island, fragment, base_version) accepted
        self.merges_total = 0
        self.initialized = False
        self._accs = AccumulatorPool()   # one released accumulator, reused (no fresh page faults)
        self._said_lr_start: Optional[bool] = None   # the last start (pretrained or not) the outer lr auto was logged for
        self._said_codec: set[str] = set()   # sparse push dtypes warned of (outer momentum on)
        self._lockstep = Advice()   # the H said to islands that wait for the slowest one's rounds (--quorum)

    # ------------------------------------------------------------------------------------------ setup
    def set_manifest(self, manifest: list, fragments: int) -> None:
        with self.lock:
            layout = partition(manifest, fragments)
            self.manifest = manifest
            self.layout = layout
            numels = fragment_numels(manifest, layout)
            self._owners = assign(numels, self.shard.count)
            self.frags = [GlobalFragment(i, n) for i, n in enumerate(numels)]
            self.rounds = [Round(i, 0) for i in range(len(numels))]
            self.owned = self._owners[self.shard.index]

    def mine(self) -> list[GlobalFragment]:
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
            f = self._init_target(index, values)
        bad = init_refusal(f"INIT of fragment {index}", values, self.runner)
        if bad is not None:
            raise PushRefused(*bad)
        with self.lock:
            if f.has_base:   # (one initializer, one reader thread: not expected)
                raise PushRefused("duplicate-init", f"a second INIT of fragment {index}; refused")
            f.install_init(values, shadow=self.down_codec is not None)
            if not all(fr.has_base for fr in self.mine()):
                return False
            for fr in self.mine():
                self.opt.ensure_state(fr.t)
            self.initialized = True
            self._check_total_rounds()
            self.cond.notify_all()
            return True

    def _init_target(self, index: int, values: np.ndarray) -> GlobalFragment:
        """(lock held) The fragment an INIT is for, after its checks; raises PushRefused."""
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
        return f

    def versions(self) -> list[Optional[int]]:
        """Each fragment's version; None for those another shard owns."""
        with self.lock:
            mine = set(self.owned)
            return [f.version if f.index in mine else None for f in self.frags]

    def reset_rounds(self) -> None:
        """(restore) Every owned fragment's open round starts afresh on its version."""
        with self.lock:
            self._next = {}
            for f in self.mine():
                self.rounds[f.index] = Round(f.index, f.version)

    def waiting_pushes(self, index: int) -> list:
        """(lock held) The pushes of fragment ``index`` not merged yet: its open round's answers and carried pushes,
        and late pushes accepted while it merges."""
        r = self.rounds[index]
        return list(r.answers.values()) + list(r.carried) + list(self._next.get(index, ()))

    # ------------------------------------------------------------------------------------- membership
    def join(self, island: str, incarnation: str) -> Member:
        with self.lock:
            self._prune()
            old = self.members.get(island)
            if old is not None and old.incarnation != incarnation:
                self.window.forget(island)   # a restarted island: its old pace says nothing of the new process
                old.restarted()
            m = self.roster.join(island, incarnation)
            self.cond.notify_all()
            return m

    def touch(self, island: str, step: Optional[int] = None, rate: Optional[float] = None,
              pinned: Optional[bool] = None, schedule=None) -> None:
        """A message from ``island`` renewed its lease; a heartbeat also says its step, compute rate, whether it
        pinned H and its schedule (a wire.values.Schedule), as wire/schema.read_island_beat bounds them: None when not
        said."""
        with self.lock:
            self.roster.touch(island)
            m = self.members.get(island)
            if m is not None:
                m.progress(step, rate, self.clock(), pinned, schedule)
                self._say_lockstep()

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
        checkpoint forever; see rounds/roster.stateless_members)."""
        busy = {k[0] for k in self.seen}
        for f in self.mine():
            busy.update(self.rounds[f.index].islands())
            busy.update(c.island for c in self._next.get(f.index, ()))
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

    def close_all(self) -> None:
        """(the final cut) No fragment takes pushes any more."""
        with self.lock:
            for f in self.mine():
                f.closed = True

    def _check_total_rounds(self) -> None:
        tr = self.rs.total_rounds
        if tr is not None:
            for f in self.mine():
                if f.version >= tr:
                    f.closed = True

    # ------------------------------------------------------------------------------------------ pushes
    def _checked(self, p: ReceivedPush) -> tuple[GlobalFragment, tuple]:
        """(lock held) The push's fragment and (weight, claimed weight, kept encoded until the merge), after the
        checks of its fields (rounds/pushes.py, rounds/weights.py); raises PushRefused."""
        f = push_target(p, self.initialized, self.frags, self.owner_refusal)
        check_counters(p)
        w = self.book.weight(p)
        p.nbytes = memoryview(p.body).nbytes
        return f, w

    def accept(self, p: ReceivedPush) -> tuple[str, int]:
        """Accept a push (fold it if it answers the open round). Returns (status, lag); raises PushRefused.

        A push kept in its encoded form (carried, or ``exact``) is validated outside the lock first; the state
        checks (rounds/pushes.push_standing) then run on the state at registration, looking again if a merge moved
        it."""
        with self.lock:
            f, (w, claimed, unref) = self._checked(p)
            self._say_codec_momentum(p)
        key = (p.island, f.index, p.base_version)
        guard = self.guard
        first_round = p.base_version == 0   # (the guard keeps the first round's pushes apart: model/guard.py)
        norm = guard.measure(p.codec, p.body, f.numel, p.block, cold=(f.index, p.island, f.t.base, first_round)) \
            if guard is not None else None
        base_norm = guard.base_norm(f.index, f.version, f.t.base) \
            if norm is not None and guard.needs_base_norm(f.index) else 0.0
        validated = False
        while True:
            with self.lock:
                r = self.rounds[f.index]
                status, lag = push_standing(p, f, r.closed, self.seen, self.ms.max_base_lag)
                if status is not None:
                    return status, 0
                encoded = lag != 0 or self.ms.exact or unref
                if not encoded or validated:
                    why = guard.admit(f.index, norm, p.island, base_norm, first_round=first_round) \
                        if guard is not None else None
                    if why is not None:
                        raise PushRefused("outlier", why)
                    c = Contribution(p, w, lag=lag, encoded=encoded, claimed=claimed, unreferenced=unref)
                    if not self._register(p, f, r, c, key):
                        return ("carried", lag) if lag else ("accepted", 0)
                    break
            try:  # a push kept encoded is validated now: it is decoded only at merge time
                validate_encoded(p.codec, p.body, f.numel, p.block)
            except CodecError as e:
                log.warning("refused push of fragment %d from island %s: %s", f.index, p.island, e)
                raise PushRefused(refusal_code(e), f"push of fragment {f.index} refused: {e}") from None
            validated = True
        return self._fold(p, f, r, c, w, key)

    def _register(self, p: ReceivedPush, f: GlobalFragment, r: Round, c: Contribution, key) -> bool:
        """(lock held) Record an accepted push in its round; True when it still has to be folded."""
        self.seen.add(key)
        if c.lag != 0:
            self._credit(p, f)
            if r.closed:   # its round is merging: the push joins the next one (the merge took its contents)
                self._next.setdefault(f.index, []).append(c)
            else:
                r.carry(c)
            self.cond.notify_all()
            return False
        r.register(c)
        if c.encoded:
            r.inflight -= 1
            self._answer(r, p, f, c)
            self.cond.notify_all()
            return False
        return True

    def _answer(self, r: Round, p: ReceivedPush, f: GlobalFragment, c: Contribution) -> None:
        """(lock held) A push became an answer of round ``r``: its timing and the island's bookkeeping."""
        r.answered(c, self.clock())
        self._credit(p, f)

    def _credit(self, p: ReceivedPush, f: GlobalFragment) -> None:
        """(lock held) The island's bookkeeping for an accepted push (its arrival, its pace, its final flag); a push
        refused while it is being folded leaves none (its final flag would drop the island from the fragment's
        expected set)."""
        now = self.clock()
        p.arrived = now
        self.window.pushed(p.island, f.index, int(p.local_step or 0))
        m = self.members.get(p.island)
        if m is not None:
            m.last_seen = now
            if p.final:
                m.final_fragments.add(f.index)
            m.last_step = max(m.last_step, int(p.local_step or 0))
            if p.local_step:
                m.pushed(int(p.local_step), p.rate, now, True if p.pinned else None)

    def _fold(self, p: ReceivedPush, f: GlobalFragment, r: Round, c: Contribution, w: float, key) -> tuple[str, int]:
        """Streaming fold of an accepted push into its round's accumulator, outside the central lock."""
        err = None
        try:
            with r.fold_lock:
                if r.acc is None:
                    r.acc = self._accs.take(f.numel, self.runner)
                codecs.decode_accumulate(p.codec, p.body, f.numel, w, r.acc, p.block,
                                         threads=self.runner.threads)
        except CodecError as e:
            err = e
        with self.lock:
            r.inflight -= 1
            c.push.body = None  # the decoded values live in the accumulator now
            if err is None:
                self._answer(r, p, f, c)
            else:  # it never was an answer: nothing to undo but its registration
                r.unregister(p.island)
                self.seen.discard(key)
            self.cond.notify_all()
        if err is not None:
            log.warning("refused push of fragment %d from island %s: %s", f.index, p.island, err)
            raise PushRefused(refusal_code(err), f"push of fragment {f.index} refused: {err}")
        return "accepted", 0

    # --------------------------------------------------------------------------------------- scheduling
    def _decisions(self, now: float):
        blocked: dict[int, set] = {f.index: self.rounds[f.index].blocked(now) for f in self.mine() if not f.closed}
        for f in self.mine():
            if f.closed:
                continue
            r = self.rounds[f.index]
            elsewhere = frozenset().union(*(b for i, b in blocked.items() if i != f.index))
            d = r.decide(self.rs, self.roster, self.window, now, elsewhere)
            if d is not None:
                yield f, r, d

    def due(self) -> list[int]:
        """Fragments whose open round merges now (rounds waiting below their floor past the timeout are logged)."""
        with self.lock:
            now = self.clock()
            out = []
            for f, r, d in self._decisions(now):
                if d.due(now):
                    out.append(f.index)
                    self._left_out[f.index] = d.left_out
                else:
                    r.log_wait(self.rs, self.roster, d, f.version, now)
            return out

    def next_deadline(self) -> Optional[float]:
        """Earliest clock time at which a round may become due by time (None: only events matter)."""
        with self.lock:
            ts = [d.at for _, _, d in self._decisions(self.clock()) if d.at is not None]
            return min(ts) if ts else None

    def round_status(self, island: str) -> SyncerStatus:
        """What ``island`` may be waiting for (the HEARTBEAT the syncer sends it; docs/protocol.md, "Membership"):
        the open rounds it answered ``[fragment, version, answered, floor]``, the islands they wait for ("(down Ns)"
        marking those that are not up), after its FINAL the islands still training, and the fleet's pace."""
        with self.lock:
            now = self.clock()
            rounds, missing = [], set()
            for f, r, d in self._decisions(now):
                if island not in r.answered_islands():
                    continue
                if len(rounds) < MAX_STATUS_ROUNDS:
                    rounds.append([f.index, f.version, len(r.counted()), d.floor])
                missing.update(d.waits_for)
            m = self.members.get(island)
            unfinished = self.roster.describe(sorted(self.roster.unfinished(now))[:MAX_STATUS_IDS], now) \
                if m is not None and m.finished else None
            return SyncerStatus(rounds, self.roster.describe(sorted(missing)[:MAX_STATUS_IDS], now), unfinished,
                                self.roster.pace(now), self._rhythm(island, now), opened=self._opened(island, now))

    def keeps_rhythm(self, island: str) -> bool:
        """Whether ``island`` is the one the fleet keeps its rhythm with now (its pushes open rounds the others
        follow: the server sends them a HEARTBEAT at once, ``round_status``'s ``opened``)."""
        with self.lock:
            keeper = self.roster.rhythm(self.clock())
            return keeper is not None and keeper.island == island

    def _opened(self, island: str, now: float) -> list:
        """(lock held) ``[[fragment, seconds ago], ...]``: the open rounds the rhythm island's push opened or joined
        and ``island`` has not answered (it follows them: island/boundary/schedule.follow)."""
        keeper = self.roster.rhythm(now)
        if keeper is None or keeper.island == island:
            return []
        out = []
        for f in self.mine():
            r = self.rounds[f.index]
            c = r.answers.get(keeper.island)
            if c is None or not c.folded or r.closed or c.push.arrived is None or island in r.answered_islands():
                continue
            if len(out) < MAX_RHYTHM:
                out.append([f.index, round(max(0.0, now - c.push.arrived), 3)])
        return out

    def pace(self) -> float:
        """The fleet's pace in steps/s (rounds/roster.py)."""
        with self.lock:
            return self.roster.pace(self.clock())

    def rhythm(self, island: str) -> list:
        """``[[fragment, eta_s, period_s], ...]`` for ``island`` (see ``_rhythm``)."""
        with self.lock:
            return self._rhythm(island, self.clock())

    def rhythm_after(self, p: ReceivedPush) -> Optional[list]:
        """[eta_s, period_s] for the PUSH_REPLY of ``p``: when the rhythm island pushes ``p``'s fragment next,
        counted from ``p``'s arrival (the island aims its next boundary of the fragment from that push's step);
        None without a rhythm, or for the rhythm island itself."""
        with self.lock:
            now = self.clock()
            for f, eta, period in self._rhythm(p.island, now):
                if f == p.fragment:
                    return [eta + (now - p.arrived if p.arrived is not None else 0.0), period]
            return None

    def _rhythm(self, island: str, now: float) -> list:
        """(lock held) When the island the fleet keeps its rhythm with (the slowest that is up, when all pinned H:
        rounds/roster.Roster.rhythm) pushes each owned fragment next, and its period of it; empty when ``island``
        is that island or the fleet has none. An island that pinned H aims its boundaries at these
        (island/boundary/schedule.aim), so that it shares the slowest island's rounds."""
        slow = self.roster.rhythm(now)
        if slow is None or slow.island == island:
            return []
        out = []
        for f in self.mine():
            r = self.window.rhythm(slow.island, f.index, slow, now)
            if r is not None and not f.closed and len(out) < MAX_RHYTHM:
                out.append([f.index, round(r[0], 3), round(r[1], 3)])
        return out

    def islands_view(self, now: float) -> list["IslandView"]:
        """Every island of the roster as a status page shows it, by id."""
        with self.lock:
            out = []
            for m in sorted(self.members.values(), key=lambda m: m.island):
                since = m.link_lost if m.link_lost is not None else m.last_seen
                out.append(IslandView(m.island, m.finished, self.roster.is_up(m, now), max(0.0, now - since),
                                      m.step, m.rate, m.pushes, m.tokens))
            return out

    def rounds_view(self, now: float) -> list["RoundView"]:
        """Each owned fragment's open round as a status page shows it: its answers, whom it waits for, its age."""
        with self.lock:
            out = []
            for f in self.mine():
                r = self.rounds[f.index]
                has = sorted(r.answered_islands()) if not f.closed else []
                waits = sorted(self.roster.expected(f.index, now) - set(has)) if has else []
                age = now - r.t_first if r.t_first is not None and has else None
                out.append(RoundView(f.index, f.version, f.closed, has, waits, age))
            return out

    def pending(self, index: int) -> bool:
        with self.lock:
            return self.rounds[index].pending() or bool(self._next.get(index))

    # ------------------------------------------------------------------------------------------- merge
    def merge(self, index: int, force: bool = False, wait_streams: bool = True) -> Optional[MergeRecord]:
        """Merge the open round of fragment ``index``. ``force`` (final cut) merges carried pushes alone too.

        The fragment's base is written in place, so the merge holds its write lock: bases of this fragment being
        streamed to islands finish first.  With ``wait_streams=False`` a merge that would have to wait for such
        a stream returns None at once (the round stays open; the caller retries later and merges other
        fragments meanwhile)."""
        f = self.frags[index]
        with f.writing(wait_streams) as writing:
            return self._merge_locked(f, index, force) if writing else None

    def _merge_locked(self, f: GlobalFragment, index: int, force: bool) -> Optional[MergeRecord]:
        with self.lock:
            r = self.rounds[index]
            if (f.closed and not force) or not r.begin_merge():
                return None
            while r.inflight:
                self.cond.wait()
            contents = r.contents(force)
            if contents is None:
                return None
            fresh, carried = contents
            version = f.version
            expected = sorted(self.roster.expected(index, self.clock()))
            on_time = {c.island for c in fresh}
            left_out = {i: why for i, why in self._left_out.pop(index, {}).items() if i not in on_time}
            t_first = r.t_first if r.t_first is not None else self.clock()
        t0 = self.clock()
        t_wall = time.time()
        responders, total, norm, outer_lr, ok, reason = [], 0.0, float("nan"), None, True, ""
        try:
            acc, total, responders = self._merge_fold(f, r, fresh, carried, version, index)
            if total > 0:
                if self.protect is not None:
                    self.protect(index)
                li = outer_lr_inputs([c.push for c in fresh or carried])
                outer_lr = self.opt.lr_at(li.steps, li.blended, li.pretrained)
                self._say_lr_start(li, outer_lr)
                norm = self.opt.step(f.t, acc, total, version + 1, self.runner, steps=li.steps, blended=li.blended,
                                     pretrained=li.pretrained)
            else:
                ok, reason = False, "every push weighs nothing (no new steps): the base is not moved"
        except (NonFiniteMerge, CodecError) as e:
            ok, reason, norm, outer_lr = False, str(e), float("nan"), None
        if ok and f.t.shadow is not None:
            f.encode_update(self.down_codec, self.down_block, acc, version + 1, self.runner.threads)
        self._close_round(f, r, fresh + carried, ok, reason, responders, index)
        t1 = self.clock()
        return MergeRecord(fragment=index, version=f.version, ok=ok, responders=responders, total_weight=total
                           if ok else 0.0, bytes=sum(x["bytes"] for x in responders), quorum_s=max(0.0, t0 - t_first),
                           merge_s=t1 - t0, grad_norm=norm, expected=expected, reason=reason, t_wall=t_wall,
                           outer_lr=outer_lr, left_out=left_out)

    def _say_codec_momentum(self, p: ReceivedPush) -> None:
        """(lock held) Warn once per sparse push dtype while the outer step uses momentum: a coordinate reaches the
        syncer in bursts (when its carried residual enters its block's top F) and momentum repeats each burst
        (topk:0.05+int2 on Megatron-LM with Nesterov 0.9 diverged; docs/benchmarks.md)."""
        if not self.opt.uses_momentum or codec_names.sparse(p.codec) is None \
                or p.codec in self._said_codec or len(self._said_codec) >= 16:
            return
        self._said_codec.add(p.codec)
        log.warning("yeto-syncer: island %s pushes %s, which sends a fraction of each push and leaves the rest to "
                    "error feedback, while the outer step uses momentum %g: momentum repeats each coordinate's "
                    "bursts (it diverged on Megatron-LM at 0.9); start the syncer with --outer-lr 1 --outer-momentum "
                    "0 for sparse pushes (docs/benchmarks.md; said once per push dtype)",
                    p.island, p.codec, self.opt.momentum)

    def _say_lockstep(self) -> None:
        """(lock held) With ``--quorum``: tell the operator, once per island, the H that lets an island
        waiting for the slowest island's rounds train at its own pace (rounds/lockstep.py)."""
        now = self.clock()
        for h in self._lockstep.new(self.roster.lockstep(now), now):
            log.info("yeto-syncer: island %s has waited for the rounds of island %s for a minute (%d steps at "
                     "%.1f steps/s against its %d at %.1f: about %.0f%% of its time): pin YETO_DILOCO_SYNC_EVERY=%d "
                     "on it to train at its own pace, rounds still keyed by push count (the median of that minute's "
                     "rates, which swing under load; docs/operations.md)", shown(h.island), shown(h.slowest),
                     h.slowest_every, h.slowest_rate, h.sync_every, h.rate, 100 * h.wait_share, h.suggested)

    def _say_lr_start(self, li, outer_lr: float) -> None:
        """Log when the outer lr auto first goes by a pretrained start (a fine-tune), and when that changes."""
        if not self.opt.auto or not li.blended or self._said_lr_start == li.pretrained:
            return
        if li.pretrained or self._said_lr_start is not None:
            log.info("yeto-syncer: outer lr auto: %g (the merged islands say their run started from %s)", outer_lr,
                     "pretrained weights: a fine-tune" if li.pretrained else "fresh weights")
        self._said_lr_start = li.pretrained

    def _close_round(self, f: GlobalFragment, r: Round, merged: list, ok: bool, reason: str, responders: list,
                     index: int) -> None:
        """After the merge arithmetic: the version, the ledger and the weight book, and the next open round."""
        with self.lock:
            for c in merged:
                c.push.body = None
            if ok:
                f.version += 1
                self.merges_total += 1
                for c in merged:
                    self.book.merged(c.push, c.claimed)
                    m = self.members.get(c.island)
                    if m is not None:
                        m.credit(c.push.steps, c.push.tokens)
                self._check_total_rounds()
                lo = f.version - self.ms.max_base_lag - 1
                self.seen = {k for k in self.seen if k[1] != index or k[2] >= lo}
            else:
                log.error("fragment %d: merge at v%d refused (%s); pushes from %s dropped, state unchanged",
                          index, f.version, reason, [x["island"] for x in responders])
                for c in merged:
                    self.seen.discard((c.island, index, c.push.base_version))
            r.merged()
            nxt = self.rounds[index] = Round(index, f.version)
            for c in self._next.pop(index, []):   # late pushes accepted during the merge
                nxt.carry(c)
            self.cond.notify_all()
        self._accs.give(r.acc)
        r.acc = None

    def _merge_fold(self, f: GlobalFragment, r: Round, fresh: list, carried: list, version: int, index: int) -> tuple:
        """(accumulator, total weight, responders) of a merge (rounds/round.fold_carried)."""
        acc = r.acc
        if acc is None:
            acc = r.acc = self._accs.take(f.numel, self.runner)
        total, responders = fold_carried(self.book, acc, fresh, carried, version, self.ms.late_factor, f.numel,
                                         self.runner.threads, index, self.book.cap)
        return acc, total, responders

    def resumed(self, merges_total: int, members: dict, merged: set) -> None:
        """(restore) The rest of a checkpoint's committed state, once every fragment's arrays are installed."""
        with self.lock:
            self.merges_total = merges_total
            self.members.update(members)
            self.seen = merged
            self.initialized = True
            self._check_total_rounds()


MAX_STATUS_ROUNDS = 64    # rounds listed in one HEARTBEAT
MAX_STATUS_IDS = 16       # island ids listed in one HEARTBEAT
