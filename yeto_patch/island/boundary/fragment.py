"""One fragment's boundary, from snapshot to installed base: a typed state machine with the same shape on every
rank of the island (torch-free).

The syncer's layout fixes each fragment's tensors (``FragmentShape``). A ``Fragment`` then owns everything its
boundary goes through, on two sides that move independently:

- the push side: ``IDLE`` -> ``IN_LANE`` (the boundary's snapshot is in the background push lane, not at the
  syncer yet) -> ``AT_SYNCER`` (handed to the link; waiting for its answer) -> ``IDLE`` when its answer is
  installed: a base whose merge took the push, or after a refusal the newest base (``settle`` when there is none
  newer than the anchor). A newer base whose merge did not take the push goes in as a newer base and the push
  stays at the syncer (the link keeps sending it until the syncer merges or refuses it);
- the base side: ``NONE`` -> ``STAGING`` (a merged base handed to the background base lane) -> ``ARMED`` (taken
  for installing in this optimizer step) -> ``NONE`` once installed (the base is the anchor then).

A base can be staged while the fragment's push is still in the lane (it arrived unasked, merged by a quorum
without this island): it is not armed until the push is at the syncer, because the push's delta is taken
against the anchor that an install would change. The transitions are methods that check where they start from
(an illegal one is an internal error, raised at once rather than corrupting a round).

Everything every rank needs lives in typed fields present on every rank (``Push``, ``Staging``); what only
island rank 0 has (the syncer's bases as they arrive, the encoded push and its figures, the error-feedback
residual, what the syncer said of the push) is in one field of its own type, ``Rank0Side`` (None on the other ranks), so
that no code can read rank 0's shape on another rank by accident: such a read raises at once, on that rank,
instead of hanging the island in a collective.

This class is the only writer of that state: the link's news arrive as records (island/records.py) through
``Fragments.receive``, and the installs, the restart state and the driver use the methods below.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from yeto_patch.island.errors import EngineError
from yeto_patch.wire.codecs import DEFAULT_BLOCK
from yeto_patch.island.records import ArrivedBase, Carried, Inbox, OutgoingPush, Refusal, Sent, took_by


class PushPhase(enum.Enum):
    IDLE = "idle"
    IN_LANE = "in lane"
    AT_SYNCER = "at syncer"


class BasePhase(enum.Enum):
    NONE = "none"
    STAGING = "staging"
    ARMED = "armed"


@dataclass(frozen=True)
class FragmentShape:
    """The fragment's tensors in the syncer's layout: manifest indices (ascending), their offsets in the
    fragment's flat vector and its size."""
    index: int
    entries: Tuple[int, ...]
    offsets: Dict[int, int]     # manifest index -> offset in the flat vector
    starts: Tuple[int, ...]     # offsets in `entries` order
    numel: int


@dataclass
class Push:
    """A push awaiting its answer, the same on every rank: the boundary's step, the anchor version its delta is
    relative to, the steps and tokens since the fragment's previous push (what the syncer's merge weights see),
    and where it is."""
    step: int
    base_version: int
    steps: int
    tokens: int
    final: bool = False
    phase: PushPhase = PushPhase.IN_LANE


@dataclass
class PushWire:
    """Rank 0: the encoded push with the codec and block it was encoded with (sent again after a restart) and the
    figures its boundary log record reports (``figures``: JSON fields measured on the way: gather/encode/snapshot
    times, bytes, codec ...; ``send_ms`` once the link said it went out)."""
    body: object                      # numpy uint8 array
    codec: str
    figures: Dict[str, object] = field(default_factory=dict)
    send_ms: Optional[float] = None
    block: int = DEFAULT_BLOCK

    @classmethod
    def of(cls, body, figures: Dict[str, object]) -> "PushWire":
        """The encoded push with the codec and block it carries (``push_encoder.PushBody``; a plain array, as
        tests' fakes make, is float32)."""
        return cls(body, getattr(body, "codec", None) or "f32", figures,
                   block=getattr(body, "block", None) or DEFAULT_BLOCK)


@dataclass
class Staging:
    """A merged base in the background base lane (every rank): its version and number of base updates, whether it
    answers the fragment's push (rank 0's decision, broadcast in the plan); once armed, this rank's staged part
    (``job``) and the install's timings."""
    version: int
    updates: int
    answers: bool = True
    phase: BasePhase = BasePhase.STAGING
    job: object = None                # base_lane.StageJob, once armed
    why: str = "arrived"
    wait_s: float = 0.0               # the training thread's wait for this rank's part when arming
    in_step_s: float = 0.0            # time spent installing it inside the optimizer step


class Rank0Side:
    """What only island rank 0 knows of a fragment: bases from the syncer, the encoded push, the residual, and
    what the syncer said of the push at the syncer (``answer``: the version of a base whose merge took it;
    ``refused``: the code of its refusal; ``carried``: the syncer holds it for the next merge, so any newer base
    answers it; ``floor``: the newest base known when it was handed, which a base without merge figures must be
    newer than to answer it). Written only by ``Fragment``'s methods."""
    __slots__ = ("arrived", "wire", "residual", "adopt", "answer", "refused", "carried", "floor", "newest")

    def __init__(self):
        self.arrived = None            # wire.client.Base: the newest base received, not staged or installed
        self.wire: Optional[PushWire] = None
        self.residual = None           # float32 array (error feedback): what the push codec dropped so far
        self.adopt = False             # the syncer is behind this island: its older base replaces the anchor
        self.answer: Optional[int] = None
        self.refused: Optional[str] = None
        self.carried = False
        self.floor = -1
        self.newest: Tuple[int, float] = (-1, 0.0)   # (newest base version received, when: monotonic seconds)

    def take_base(self, b) -> None:
        """A base received from the syncer; kept if it is the newest (an update of the previous base,
        --base-wire int8/int4/topk, is applied to it in order)."""
        cur = self.arrived
        if b.relative:
            self.arrived = b if cur is None else cur.then(b)
        elif cur is None or b.version >= cur.version or self.adopt:
            self.arrived = b


class Fragment:
    """One fragment's boundary state (see the module docstring). `rank0`: ``Rank0Side`` on island rank 0."""
    __slots__ = ("shape", "anchor_version", "steps_since", "tokens_since", "push", "staging", "skip", "rank0")

    def __init__(self, shape: FragmentShape, rank0: bool):
        self.shape = shape
        self.anchor_version = -1          # the base version the anchor is (-1 before the first install)
        self.steps_since = 0              # optimizer steps and tokens since the previous push (``take_counts``)
        self.tokens_since = 0
        self.push: Optional[Push] = None
        self.staging: Optional[Staging] = None
        self.skip = 0                     # boundaries merged before a restart: not pushed again
        self.rank0: Optional[Rank0Side] = Rank0Side() if rank0 else None

    # ------------------------------------------------------------------------------------------ reading
    @property
    def index(self) -> int:
        return self.shape.index

    @property
    def entries(self) -> Tuple[int, ...]:
        return self.shape.entries

    @property
    def numel(self) -> int:
        return self.shape.numel

    @property
    def side(self) -> Rank0Side:
        """Rank 0's side; an internal error elsewhere (a rank-0-only read on another rank fails here, at once)."""
        if self.rank0 is None:
            raise EngineError(f"internal: fragment {self.index}: rank 0's side read on another rank")
        return self.rank0

    @property
    def push_phase(self) -> PushPhase:
        return PushPhase.IDLE if self.push is None else self.push.phase

    @property
    def base_phase(self) -> BasePhase:
        return BasePhase.NONE if self.staging is None else self.staging.phase

    def describe(self) -> str:
        return f"fragment {self.index} (v{self.anchor_version}, push {self.push_phase.value}, base " \
               f"{self.base_phase.value})"

    def answers(self, base) -> bool:
        """Rank 0: `base` (one received) answers the push at the syncer: its merge took the push, the push was
        refused (the newest base follows it), the syncer is behind (adoption), or a base without merge figures is
        newer than every base known when the push was handed. A newer base that did not take the push is
        installed as a newer base, and the push still waits for its own answer."""
        p, side = self.push, self.side
        if p is None or base is None:
            return p is None
        if p.phase is not PushPhase.AT_SYNCER:
            return False
        if side.adopt or side.refused is not None:
            return True
        if side.carried and base.version > p.base_version:
            return True
        if side.answer is not None:
            return base.version >= side.answer
        if took_by(base) is None:   # no figures (an older or restarted syncer): newer than what the push knew
            return base.version > max(p.base_version, side.floor)
        return False

    def answered(self) -> bool:
        """Rank 0: the push at the syncer is answered by a base at hand (staged, or arrived), or was refused, or
        there is no push."""
        p = self.push
        if p is None:
            return True
        if p.phase is not PushPhase.AT_SYNCER:
            return False
        st = self.staging
        if st is not None and st.answers:
            return True
        if self.side.refused is not None:
            return True
        if self.side.carried and self.anchor_version > p.base_version:
            return True   # carried into the next merge, and a newer base went in already: the push is done
        return self.answers(self.side.arrived)

    def newer_at_hand(self) -> bool:
        """Rank 0: a base newer than the anchor that does not answer the push is staged or arrived (it goes in as
        a newer base while the push waits for its answer)."""
        st, b = self.staging, self.side.arrived
        return (st is not None and not st.answers) or (b is not None and b.version > self.anchor_version
                                                       and not self.answers(b))

    # ------------------------------------------------------------------------------------------ rank 0: the link's news
    def receive(self, arrived: ArrivedBase) -> None:
        """Rank 0: a base from the syncer (kept if newest); a merge that took the push at the syncer answers it."""
        side, p = self.side, self.push
        side.take_base(arrived.base)
        if arrived.version > side.newest[0]:
            side.newest = (arrived.version, arrived.at)
        if p is not None and p.phase is PushPhase.AT_SYNCER and arrived.took is not None \
                and arrived.took >= p.base_version:
            side.answer = arrived.version if side.answer is None else min(side.answer, arrived.version)

    def refused(self, r: Refusal) -> None:
        """Rank 0: the syncer refused a push of this fragment; the one at the syncer is answered by it."""
        p = self.push
        if p is not None and p.phase is PushPhase.AT_SYNCER and p.base_version == r.base_version:
            self.side.refused = r.code

    def carried(self, c: Carried) -> None:
        """Rank 0: the syncer carried the push at the syncer into the next merge (its round merged without it): a
        newer base answers it, as it will be merged with the next round (the link holds it until a merge takes it,
        so a lost link sends it again)."""
        p = self.push
        if p is not None and p.phase is PushPhase.AT_SYNCER and p.base_version == c.base_version:
            self.side.carried = True

    def sent(self, s: Sent) -> None:
        """Rank 0: the push at the syncer went out (its send time goes to its boundary log record)."""
        p, wire = self.push, self.side.wire
        if p is not None and wire is not None and p.base_version == s.base_version:
            wire.send_ms = s.ms

    def syncer_at(self, version: int) -> None:
        """Rank 0 (a reconnect): the syncer is at `version`; behind this island's anchor (it resumed from an older
        checkpoint), its base is adopted."""
        if int(version) < self.anchor_version:
            self.side.adopt = True

    def behind_by(self) -> Optional[float]:
        """Rank 0: seconds since a base newer than the anchor arrived (a round merged without this island), or
        None."""
        v, at = self.side.newest
        return None if v <= self.anchor_version or self.side.adopt else at

    def take_arrived(self, version: int, updates: int, own_weights: bool):
        """Rank 0: the arrived base a plan named (checked against it); it leaves the fragment's hands."""
        side = self.side
        base, side.arrived = side.arrived, None
        if base is None or base.version != version or \
                (len(base.deltas) if base.relative else 0) != updates or bool(base.held) != own_weights:
            raise EngineError(f"internal: fragment {self.index}'s base is not the planned v{version}")
        return base

    def final_base(self, base) -> None:
        """Rank 0: the syncer's final model of this fragment replaces whatever arrived."""
        self.side.arrived = base

    def residual_buffer(self):
        """Rank 0: the error-feedback residual (zeros at first), carried from push to push."""
        side = self.side
        if side.residual is None:
            import numpy as np
            side.residual = np.zeros(self.numel, dtype=np.float32)
        return side.residual

    def note_wait(self, ms: float) -> None:
        """Rank 0: how long the island waited at the tau bound for the push's answer (its log record)."""
        if self.side.wire is not None:
            self.side.wire.figures["wait_ms"] = ms

    def outgoing(self, blend: bool, again: bool = False) -> OutgoingPush:
        """Rank 0: the push at the syncer as the record the link sends."""
        p, wire = self.push, self.side.wire
        if p is None or wire is None:
            raise EngineError(f"internal: {self.describe()} has no encoded push to send")
        return OutgoingPush(self.index, p.base_version, p.step, p.steps, p.tokens, p.final, wire.codec, wire.block,
                            bool(blend), wire.body, again)

    # ------------------------------------------------------------------------------------------ transitions
    def count(self, tokens: int) -> None:
        self.steps_since += 1
        self.tokens_since += tokens

    def take_counts(self) -> Tuple[int, int]:
        """(steps, tokens) since the previous push, for the push made now; counting starts again."""
        out = (self.steps_since, self.tokens_since)
        self.steps_since = self.tokens_since = 0
        return out

    def restore(self, steps_since: int, tokens_since: int) -> None:
        """A restart: the counters saved with the island's sync state."""
        self.steps_since, self.tokens_since = int(steps_since), int(tokens_since)

    def skip_boundaries(self, n: int) -> None:
        """A restart: the next `n` boundaries were merged with this island's pushes before it died."""
        self.skip = int(n)

    def skipped(self) -> None:
        """One boundary merged before the restart passed without a push."""
        self.skip = max(0, self.skip - 1)

    def restore_residual(self, residual) -> None:
        """Rank 0, a restart: the error-feedback residual saved with the sync state."""
        self.side.residual = residual

    def begin_push(self, step: int, final: bool = False) -> Push:
        """The boundary's push: its delta against the current anchor goes into the background push lane; it
        reports the steps and tokens since the previous push (``take_counts``)."""
        if self.push is not None:
            raise EngineError(f"internal: {self.describe()} pushes again before its previous push was answered")
        if self.staging is not None and self.staging.phase is BasePhase.ARMED:
            raise EngineError(f"internal: {self.describe()} pushes while a base is armed")
        self.push = Push(step, self.anchor_version, *self.take_counts(), final)
        return self.push

    def push_handed(self, wire: Optional[PushWire]) -> None:
        """The push left the lane for the syncer (rank 0 passes its encoded body and figures)."""
        if self.push is None or self.push.phase is not PushPhase.IN_LANE:
            raise EngineError(f"internal: {self.describe()}: no push in the lane to hand to the link")
        self.push.phase = PushPhase.AT_SYNCER
        self._at_syncer(wire)

    def resume_push(self, push: Push, wire: Optional[PushWire]) -> None:
        """A restart: the push saved with the checkpoint awaits its answer again (rank 0 sends it again)."""
        if self.push is not None:
            raise EngineError(f"internal: {self.describe()} already has a push")
        push.phase = PushPhase.AT_SYNCER
        self.push = push
        self._at_syncer(wire)

    def _at_syncer(self, wire: Optional[PushWire]) -> None:
        side = self.rank0
        if side is not None:
            side.wire, side.answer, side.refused, side.carried = wire, None, None, False
            known = [self.anchor_version, side.newest[0]] + ([] if side.arrived is None else [side.arrived.version])
            side.floor = max(known)

    def stage(self, version: int, updates: int, answers: bool = True) -> Staging:
        """A merged base goes to the background base lane (`answers`: it answers the push at the syncer)."""
        if self.staging is not None:
            raise EngineError(f"internal: {self.describe()} stages a base while another one is staged")
        self.staging = Staging(int(version), int(updates), bool(answers))
        return self.staging

    def arm(self, job, why: str, wait_s: float) -> Staging:
        """The staged base (this rank's part: `job`) is installed in this optimizer step."""
        st = self.staging
        if st is None or st.phase is not BasePhase.STAGING:
            raise EngineError(f"internal: {self.describe()}: no staged base to arm")
        if self.push is not None and self.push.phase is PushPhase.IN_LANE:
            raise EngineError(f"internal: {self.describe()}: armed while its push is still in the lane")
        st.phase, st.job, st.why, st.wait_s = BasePhase.ARMED, job, why, wait_s
        return st

    def in_step(self, seconds: float) -> None:
        """The armed base's share of the time an install point inside the optimizer step took."""
        if self.staging is None or self.staging.phase is not BasePhase.ARMED:
            raise EngineError(f"internal: {self.describe()}: no armed base installed in the step")
        self.staging.in_step_s += seconds

    def installed(self, version: int, keep_counts: bool = False, answers: bool = True) -> Optional[Push]:
        """The base of `version` is the anchor now. `answers`: it answers the push at the syncer (returned, and
        done); otherwise it is a newer base and the push still waits for its answer. The staged base, if any,
        must be this one (a different staged base refuses: it would be dropped unseen). `keep_counts`: the base
        was blended in (or the local masters kept), so the local progress since the previous push stays and the
        next push reports it; otherwise (the masters replaced) counting starts again."""
        st = self.staging
        if st is not None and st.version != int(version):
            raise EngineError(f"internal: {self.describe()}: v{version} installed while v{st.version} is staged")
        answered = None
        if answers:
            answered, self.push = self.push, None
        self.staging = None
        self.anchor_version = int(version)
        if not keep_counts:
            self.steps_since = 0
            self.tokens_since = 0
        side = self.rank0
        if side is not None:
            side.adopt = False
            if answers:
                side.wire, side.answer, side.refused, side.carried = None, None, None, False
        return answered

    def settle(self) -> Optional[Push]:
        """The push at the syncer was refused and no base newer than the anchor is at hand: it is done (every
        rank, as rank 0 decided); the anchor stays."""
        if self.push is None or self.push.phase is not PushPhase.AT_SYNCER:
            raise EngineError(f"internal: {self.describe()}: no push at the syncer to settle")
        if self.staging is not None:
            raise EngineError(f"internal: {self.describe()}: settled while a base is staged")
        done, self.push = self.push, None
        if self.rank0 is not None:
            self.rank0.wire, self.rank0.answer, self.rank0.refused, self.rank0.carried = None, None, None, False
        return done

    def drop_staging(self) -> None:
        """The final cut: a staged base not installed is replaced by the final model."""
        self.staging = None


class Fragments:
    """The island's fragments in the syncer's layout, checked against this island's manifest. `rank0`: whether
    this process is island rank 0 (its fragments carry a ``Rank0Side``)."""

    def __init__(self, layout, numels, entry_numels: List[int], announced: Optional[int] = None,
                 rank0: bool = True):
        n = len(entry_numels)
        layout = [[int(i) for i in frag] for frag in layout]
        if sorted(i for frag in layout for i in frag) != list(range(n)):
            raise EngineError(f"the syncer's fragment layout does not cover this island's {n} tensors exactly "
                              f"once")
        announced = len(layout) if announced is None else int(announced)
        if len(layout) != announced:
            raise EngineError(f"the syncer announced {announced} fragments but sent {len(layout)}")
        if len(numels) != len(layout):
            raise EngineError(f"the syncer announced {len(numels)} fragment sizes for {len(layout)} fragments")
        self.layout = layout
        self.states: List[Fragment] = []
        for f, idx in enumerate(layout):
            off, offs, starts = 0, {}, []
            for e in idx:
                offs[e] = off
                starts.append(off)
                off += int(entry_numels[e])
            if off != int(numels[f]):
                raise EngineError(f"fragment {f}: the syncer counts {numels[f]} values, this island {off}")
            self.states.append(Fragment(FragmentShape(f, tuple(idx), offs, tuple(starts), off), rank0))

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[Fragment]:
        return iter(self.states)

    def __getitem__(self, f: int) -> Fragment:
        return self.states[f]

    @property
    def numels(self) -> List[int]:
        return [s.numel for s in self.states]

    def receive(self, inbox: Optional[Inbox]) -> None:
        """Rank 0: what one poll of the link received, in order: reconnects (a syncer behind this island is
        adopted), sends that ended, bases, refusals."""
        if inbox is None:
            return
        for r in inbox.reconnected:
            for f, v in r.versions.items():
                self.states[f].syncer_at(v)
        for s in inbox.sent:
            self.states[s.fragment].sent(s)
        for a in inbox.bases:
            self.states[a.fragment].receive(a)
        for r in inbox.refusals:
            if 0 <= r.fragment < len(self.states):
                self.states[r.fragment].refused(r)
        for c in inbox.carried:
            if 0 <= c.fragment < len(self.states):
                self.states[c.fragment].carried(c)

    def count_step(self, tokens: int) -> None:
        for s in self.states:
            s.count(tokens)

    def pushing(self) -> List[Fragment]:
        """Fragments with a push awaiting its answer, by fragment number."""
        return [s for s in self.states if s.push is not None]

    def anchors(self) -> List[int]:
        return [s.anchor_version for s in self.states]
