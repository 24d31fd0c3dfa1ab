"""One fragment's boundary, from snapshot to installed base: a typed state machine with the same shape on every
rank of the island (torch-free).

The syncer's layout fixes each fragment's tensors (``FragmentShape``). A ``Fragment`` then owns everything its
boundary goes through, on two sides that move independently:

- the push side: ``IDLE`` -> ``IN_LANE`` (the boundary's snapshot is in the background push lane, not at the
  syncer yet) -> ``AT_SYNCER`` (handed to the link; waiting for its answer) -> ``IDLE`` when a base answering it
  is installed;
- the base side: ``NONE`` -> ``STAGING`` (a merged base handed to the background base lane) -> ``ARMED`` (taken
  for installing in this optimizer step) -> ``NONE`` once installed (the base is the anchor then).

A base can be staged while the fragment's push is still in the lane (it arrived unasked, merged by a quorum
without this island): it is not armed until the push is at the syncer, because the push's delta is taken
against the anchor that an install would change. The transitions are methods that check where they start from
(an illegal one is an internal error, raised at once rather than corrupting a round).

Everything every rank needs lives in typed fields present on every rank (``Push``, ``Staging``); what only
island rank 0 has (the syncer's bases as they arrive, the encoded push and its figures, the error-feedback
residual, the restart bookkeeping) is in one field of its own type, ``Rank0Side`` (None on the other ranks), so
that no code can read rank 0's shape on another rank by accident: such a read raises at once, on that rank,
instead of hanging the island in a collective.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set, Tuple

from yeto_patch.island.errors import EngineError


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
    """Rank 0: the encoded push (sent again after a reconnect) and the figures its boundary log record reports
    (``figures``: JSON fields measured on the way: gather/encode/snapshot times, bytes, codec ...)."""
    body: object                      # numpy uint8 array
    codec: str
    figures: Dict[str, object] = field(default_factory=dict)
    send_ms: Optional[float] = None   # set by the sender thread once the push went out


@dataclass
class Staging:
    """A merged base in the background base lane (every rank): its version and number of base updates; once
    armed, this rank's staged part (``job``) and the install's timings."""
    version: int
    updates: int
    phase: BasePhase = BasePhase.STAGING
    job: object = None                # base_lane.StageJob, once armed
    why: str = "arrived"
    wait_s: float = 0.0               # the training thread's wait for this rank's part when arming
    in_step_s: float = 0.0            # time spent installing it inside the optimizer step


class Rank0Side:
    """What only island rank 0 knows of a fragment: bases from the syncer, the encoded push, the residual."""
    __slots__ = ("arrived", "wire", "residual", "adopt", "repushed")

    def __init__(self):
        self.arrived = None            # wire.client.Base: the newest base received, not staged or installed
        self.wire: Optional[PushWire] = None
        self.residual = None           # float32 array (error feedback): what the push codec dropped so far
        self.adopt = False             # the syncer is behind this island: its older base replaces the anchor
        self.repushed: Set[int] = set()   # base versions of pushes sent again (a 'duplicate' refusal expected)

    def take_base(self, b) -> None:
        """A base received from the syncer; kept if it is the newest (an update of the previous base,
        --base-wire int8/int4, is applied to it in order)."""
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

    def answered(self) -> bool:
        """Rank 0: a base that answers the outstanding push is at hand (staged, or arrived), or the syncer is
        behind and its base is adopted."""
        p = self.push
        if p is None:
            return True
        if self.staging is not None and self.staging.version > p.base_version:
            return True
        b = self.side.arrived
        return b is not None and (b.version > p.base_version or self.side.adopt)

    # ------------------------------------------------------------------------------------------ transitions
    def count(self, tokens: int) -> None:
        self.steps_since += 1
        self.tokens_since += tokens

    def take_counts(self) -> Tuple[int, int]:
        """(steps, tokens) since the previous push, for the push made now; counting starts again."""
        out = (self.steps_since, self.tokens_since)
        self.steps_since = self.tokens_since = 0
        return out

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
        if self.rank0 is not None:
            self.rank0.wire = wire

    def resume_push(self, push: Push, wire: Optional[PushWire]) -> None:
        """A restart: the push saved with the checkpoint awaits its answer again (rank 0 sends it again)."""
        if self.push is not None:
            raise EngineError(f"internal: {self.describe()} already has a push")
        push.phase = PushPhase.AT_SYNCER
        self.push = push
        if self.rank0 is not None:
            self.rank0.wire = wire

    def stage(self, version: int, updates: int) -> Staging:
        """A merged base goes to the background base lane."""
        if self.staging is not None:
            raise EngineError(f"internal: {self.describe()} stages a base while another one is staged")
        self.staging = Staging(int(version), int(updates))
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

    def installed(self, version: int, keep_counts: bool = False) -> Optional[Push]:
        """The base of `version` is the anchor now: the push it answers (returned) and the staged base are done.
        `keep_counts`: the base was blended in (or the local masters kept), so the local progress since the
        previous push stays and the next push reports it; otherwise (the masters replaced) counting starts
        again."""
        answered, self.push = self.push, None
        self.staging = None
        self.anchor_version = int(version)
        if not keep_counts:
            self.steps_since = 0
            self.tokens_since = 0
        if self.rank0 is not None:
            self.rank0.adopt = False
        return answered

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

    def count_step(self, tokens: int) -> None:
        for s in self.states:
            s.count(tokens)

    def pushing(self) -> List[Fragment]:
        """Fragments with a push awaiting its answer, by fragment number."""
        return [s for s in self.states if s.push is not None]

    def anchors(self) -> List[int]:
        return [s.anchor_version for s in self.states]
