"""One round of one fragment: the typed state machine that alone decides when a merge happens and what it holds.

A fragment's open round (``Round``) collects the islands' **answers** (pushes relative to the round's base) and the
**carried** pushes (relative to an older base, accepted late); the coordinator (rounds/coordinator.py) feeds it
under its lock and folds pushes outside it. Its phases and the only transitions between them::

    OPEN --answer--> GATHERING --quorum reached--> GRACE --due--> MERGING --> MERGED
      |                  |  (round-timeout: due below the floor)      |
      +------------------+------------------------------------> MERGING (final cut: forced)
                                               MERGING --nothing to merge--> back where it was

``TRANSITIONS`` lists them; every change goes through :meth:`Round._move`, which refuses any other edge and keeps
the path in ``history`` (tests/syncer/test_round_order.py drives the real coordinator and checks it).

The rules a round keeps (docs/protocol.md, "Rounds"; docs/operations.md):

* **the decision** (:meth:`Round.decide`): every island the round expects answered -> due now; at least the floor
  answered -> due at the end of the grace (``--grace``, or the pace window of rounds/window.py); below the floor
  it waits, but never past ``--round-timeout`` after its first answer unless the roster is fixed
  (``--quorum`` = ``--islands``: reproducible runs wait for every member), nor for islands that are blocked in
  another round (their answer there ran out of patience: rounds of different fragments waiting below their floors
  for each other's islands would otherwise stand still until the timeout); answers that weigh nothing (no new
  steps) do not count towards the floor, so a round of them alone never merges;
* **each island once** (:func:`fold_carried`): an island's carried pushes join its answer as one contribution,
  whose weight (on time and carried together) is at most the cap of one island (rounds/weights.py), however
  many bases it pushed against while it was silent.
"""
from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ...wire import codecs
from ...wire.frames import CodecError
from .pushes import ReceivedPush
from .window import LATE_STEPS as window_late_steps

log = logging.getLogger("yeto.syncer")

__all__ = ["Contribution", "Phase", "TRANSITIONS", "Decision", "Round", "AccumulatorPool", "refusal_code",
           "validate_encoded", "fold_carried", "responder", "WAIT_LOG_S"]

WAIT_LOG_S = 60.0   # a round that waits below its floor says so at most this often (after --round-timeout)


@dataclass
class Contribution:
    """One accepted push in a round: its weights and how it is held."""
    push: ReceivedPush
    weight_raw: float            # its on-time weight (checked and capped: rounds/weights.py)
    folded: bool = False         # in the accumulator (or, held, kept encoded for the merge)
    lag: int = 0
    encoded: bool = False        # body kept encoded until the merge (exact mode / carried / weighed at merge)
    claimed: float = 0.0         # its weight from its checked fields, before the cap
    unreferenced: bool = False   # nobody else was on record: capped against the round at merge time

    @property
    def island(self) -> str:
        return self.push.island


class Phase(enum.Enum):
    OPEN = "open"             # no answer yet (carried pushes may wait in it)
    GATHERING = "gathering"   # answers below the floor
    GRACE = "grace"           # the floor answered: waiting (the window or --grace) for the rest
    MERGING = "merging"       # closed: the merge took its pushes
    MERGED = "merged"         # done; the coordinator opens the next round


TRANSITIONS: dict[Phase, frozenset] = {
    Phase.OPEN: frozenset({Phase.GATHERING, Phase.GRACE, Phase.MERGING}),
    Phase.GATHERING: frozenset({Phase.GRACE, Phase.MERGING}),
    Phase.GRACE: frozenset({Phase.MERGING}),
    Phase.MERGING: frozenset({Phase.MERGED, Phase.OPEN, Phase.GATHERING, Phase.GRACE}),
    Phase.MERGED: frozenset(),
}


@dataclass
class Decision:
    at: Optional[float]                            # clock time the round merges by time alone (None: events only)
    waits_for: list = field(default_factory=list)  # missing islands it waits for
    floor: int = 1
    why: str = ""
    left_out: dict = field(default_factory=dict)   # missing island -> why the round would go without it

    def due(self, now: float) -> bool:
        return self.at is not None and now >= self.at


class Round:
    """The open round of fragment ``fragment`` on base ``base_version`` (the coordinator's lock protects it; the
    accumulator has its own ``fold_lock``)."""

    def __init__(self, fragment: int, base_version: int):
        self.fragment = fragment
        self.base_version = base_version
        self.phase = Phase.OPEN
        self.history: list[Phase] = [Phase.OPEN]
        self.answers: dict[str, Contribution] = {}   # island -> its answer (registered; folded once ``folded``)
        self.carried: list[Contribution] = []        # late pushes merged with this round
        self.acc: Optional[np.ndarray] = None
        self.inflight = 0
        self.fold_lock = threading.Lock()
        self.t_first: Optional[float] = None
        self.t_quorum: Optional[float] = None
        self.next_wait_log = 0.0
        self._before_merge: Optional[Phase] = None

    # ----------------------------------------------------------------------------------------- transitions
    def _move(self, to: Phase) -> None:
        if to is self.phase:
            return
        if to not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"fragment {self.fragment} round on v{self.base_version}: no transition "
                               f"{self.phase.value} -> {to.value}")
        self.phase = to
        self.history.append(to)

    @property
    def closed(self) -> bool:
        """The merge took this round's pushes (nothing joins it any more)."""
        return self.phase in (Phase.MERGING, Phase.MERGED)

    def register(self, c: Contribution) -> None:
        """An answer whose fold starts now (``answered`` once it is in the accumulator, ``unregister`` if not)."""
        self.answers[c.island] = c
        self.inflight += 1

    def answered(self, c: Contribution, now: float) -> None:
        """``c`` is folded (or kept encoded for the merge): it answers the round now."""
        c.folded = True
        if self.t_first is None:
            self.t_first = now
        if self.phase is Phase.OPEN:
            self._move(Phase.GATHERING)

    def unregister(self, island: str) -> None:
        """A fold that failed: the push never was an answer."""
        self.answers.pop(island, None)

    def carry(self, c: Contribution) -> None:
        """A late push (relative to an older base) joins this round's merge."""
        self.carried.append(c)

    # ------------------------------------------------------------------------------------------- views
    def counted(self) -> set:
        """Islands whose answer counts towards the floor: folded, and weighing something (a push with no new steps
        is accepted, but a round of such pushes alone must not merge: it would advance the base by nothing)."""
        return {i for i, c in self.answers.items() if c.folded and c.weight_raw > 0}

    def answered_islands(self) -> set:
        """Every island whose answer is in (weighing something or not)."""
        return {i for i, c in self.answers.items() if c.folded}

    def islands(self) -> set:
        """Islands with a push in this round, answered or carried (busy: their ledger entry is kept)."""
        return {c.island for c in list(self.answers.values()) + self.carried}

    def pending(self) -> bool:
        return bool(self.answers or self.carried)

    def patience(self) -> list:
        """(arrival, patience) of the answers that say their patience (rounds/window.py)."""
        return [(c.push.arrived, c.push.patience) for c in self.answers.values() if c.folded]

    # ----------------------------------------------------------------------------------------- decision
    def blocked(self, now: float) -> set:
        """Islands whose answer here has run out of patience: they wait for this round's merge and push nothing
        else meanwhile."""
        return {i for i, c in self.answers.items() if c.folded and c.push.patience is not None
                and c.push.arrived is not None and now >= c.push.arrived + c.push.patience}

    def decide(self, rs, roster, window, now: float, blocked: frozenset = frozenset()) -> Optional[Decision]:
        """The decision of this round now (None: nothing to merge: no answer that counts, or merging). ``rs``:
        RoundSettings; ``roster``: rounds/roster.Roster; ``window``: rounds/window.PaceWindow; ``blocked``: the
        islands blocked in another round of this syncer (``Round.blocked``)."""
        answered = self.counted()
        if self.closed or not answered:
            return None
        exp = roster.expected(self.fragment, now)
        floor = roster.floor(self.fragment, now)
        joined = roster.joined_enough()
        if exp <= self.answered_islands() and joined and len(answered) >= floor:
            return Decision(now, [], floor, "every island it expects answered")
        need = floor if rs.elastic else rs.k
        missing = (exp if rs.elastic else roster.counted(self.fragment)) - self.answered_islands()
        timeout_at = self.t_first + rs.timeout_s
        if len(answered) < need:
            if rs.fixed_roster:
                return Decision(None, sorted(missing), need, "below its quorum")
            if missing and missing <= blocked:   # they wait for other rounds, which may wait for this one's
                return Decision(now, [], need, "every island it waits for is blocked in another round",
                                {i: "blocked in another fragment's round" for i in missing})
            return Decision(timeout_at, sorted(missing), need, "below its floor until --round-timeout",
                            {i: "--round-timeout ran out" for i in missing})
        if self.phase is Phase.GATHERING:
            self._move(Phase.GRACE)
            self.t_quorum = now
        if not joined:   # (fewer than the minimum quorum of islands joined the run so far)
            return Decision(timeout_at, sorted(missing), need, "islands of the run have not joined yet",
                            {i: "--round-timeout ran out" for i in missing})
        if rs.adaptive:
            keeper = roster.rhythm(now)
            late = window_late_steps if keeper is not None else 0.0
            theirs = self.answers.get(keeper.island) if keeper is not None else None
            aimed_at = theirs.push.arrived if theirs is not None and theirs.folded else None
            w = window.deadline(self.fragment, self.patience(), exp - self.answered_islands(), now,
                                self.t_first, rs.timeout_s, late, aimed_at)
            return Decision(min(w.at, timeout_at), w.waits_for, need, "the pace window", w.why)
        return Decision(min(self.t_quorum + rs.grace_s, timeout_at), sorted(exp - self.answered_islands()), need,
                        "--grace", {i: "--grace ran out" for i in exp - self.answered_islands()})

    def log_wait(self, rs, roster, d: Decision, version: int, now: float) -> None:
        """Past --round-timeout below the floor of a fixed roster: say (then every WAIT_LOG_S) who it waits for."""
        if d.at is not None or now < self.t_first + rs.timeout_s or now < self.next_wait_log:
            return
        self.next_wait_log = now + WAIT_LOG_S
        answered = sorted(self.counted())
        log.warning("fragment %d round on v%d waits: %d of quorum %d answered (%s); missing %s", self.fragment,
                    version, len(answered), d.floor, ", ".join(answered),
                    ", ".join(roster.describe(d.waits_for, now)) or "none")

    # -------------------------------------------------------------------------------------------- merge
    def begin_merge(self) -> bool:
        """Mark the round closed before waiting for the folds in flight (pushes arriving meanwhile are carried into
        the next round); False when it is already merging."""
        if self.closed:
            return False
        self._before_merge = self.phase
        self._move(Phase.MERGING)
        return True

    def contents(self, force: bool) -> Optional[tuple[list, list]]:
        """(answers, carried) of a round in MERGING, sorted; None (and the round reopened) when there is nothing
        to merge (without ``force`` carried pushes alone do not merge)."""
        fresh = sorted((c for c in self.answers.values() if c.folded), key=lambda c: c.island)
        if not fresh and not (force and self.carried):
            self.reopen()
            return None
        return fresh, sorted(self.carried, key=lambda c: (c.island, c.push.base_version))

    def reopen(self) -> None:
        """The merge found nothing to merge: back to the phase it came from."""
        self._move(self._before_merge or Phase.OPEN)

    def merged(self) -> None:
        self._move(Phase.MERGED)


class AccumulatorPool:
    """One released float32 accumulator kept for the next round (no fresh pages to fault in)."""

    def __init__(self):
        self._spare: Optional[np.ndarray] = None
        self._lock = threading.Lock()

    def take(self, n: int, runner) -> np.ndarray:
        """A zeroed accumulator of `n` values (`runner`: a model.runner.ChunkRunner, to zero it in parallel)."""
        with self._lock:
            sp = self._spare
            if sp is not None and sp.size >= n:
                self._spare = None
                acc = sp[:n]
                runner.map(n, lambda a, b: acc[a:b].fill(0.0))
                return acc
        return np.zeros(n, np.float32)

    def give(self, acc: Optional[np.ndarray]) -> None:
        if acc is None:
            return
        full = acc.base if isinstance(acc.base, np.ndarray) else acc
        with self._lock:
            if self._spare is None or full.size > self._spare.size:
                self._spare = full


def refusal_code(e: CodecError) -> str:
    return "nonfinite" if getattr(e, "code", "") == "nonfinite" else "bad-push"


def validate_encoded(codec: str, body, numel: int, block: int) -> None:
    """Check an encoded push without decoding it (size, scales in range, finite values), exactly as the
    decoder will at merge time: a held push that passes here cannot be dropped later."""
    codecs.check_encoded(codec, memoryview(body).cast("B"), numel, block, threads=1)


def responder(c: Contribution, lag: int, w: float, carried: bool) -> dict:
    """One push of a merge, as its tape record lists it."""
    p = c.push
    return {"island": p.island, "lag": lag, "weight": w, "on_time_weight": c.weight_raw, "claimed": c.claimed,
            "carried": carried, "base_version": p.base_version, "steps": p.steps, "tokens": p.tokens,
            "local_step": p.local_step, "codec": p.codec, "bytes": int(p.nbytes)}


def fold_carried(book, acc: np.ndarray, fresh: list, carried: list, version: int, late_factor: float, numel: int,
                 threads: int, index: int, cap: Callable[[str, list], Optional[float]]) -> tuple:
    """(total weight, responders) of a merge into ``acc``. Fresh answers were folded on arrival (here only those
    kept encoded: with --exact, in island order, and those weighed against the round); carried pushes are folded now at
    ``weight x late_factor^lag``, each island once: its carried pushes share what its cap leaves beside its
    answer (``cap(island, others' weights)``: the most one island may weigh in this merge, None: no cap), so an
    island silent for rounds that pushes against every base it missed weighs no more than one island.
    ``book``: the coordinator's weights.WeightBook."""
    for c in fresh:
        if c.unreferenced:   # nobody else was on record when it came: weighed against this round's others
            c.weight_raw = book.cap_in_round(c.claimed, [o.claimed for o in fresh if o is not c])
        if c.encoded:
            codecs.decode_accumulate(c.push.codec, c.push.body, numel, c.weight_raw, acc, c.push.block,
                                     threads=threads)
    weights = [c.weight_raw for c in fresh]
    responders = [responder(c, 0, c.weight_raw, False) for c in fresh]
    on_time = {c.island: c.weight_raw for c in fresh}
    for island in sorted({c.island for c in carried}):
        mine = [c for c in carried if c.island == island]
        for c in mine:
            if c.unreferenced:
                c.weight_raw = book.cap_in_round(c.claimed, [o.claimed for o in fresh])
        raw = [c.weight_raw * (late_factor ** (version - c.push.base_version)) for c in mine]
        limit = cap(island, [w for i, w in on_time.items() if i != island])
        scale = 1.0
        if limit is not None and sum(raw) > 0:
            room = max(0.0, limit - on_time.get(island, 0.0))
            scale = min(1.0, room / sum(raw))
        for c, w in zip(mine, raw):
            w *= scale
            try:
                codecs.decode_accumulate(c.push.codec, c.push.body, numel, w, acc, c.push.block, threads=threads)
            except CodecError as e:  # validated on arrival, so not expected; never poisons the round
                log.error("fragment %d: carried push from island %s dropped: %s", index, c.island, e)
                continue
            weights.append(w)
            responders.append(responder(c, version - c.push.base_version, w, True))
    total = 0.0
    for w in weights:  # fixed order
        total += w
    return total, responders
