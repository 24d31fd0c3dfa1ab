"""What happens at an optimizer step: a pure function of the step, the schedule and the fragments' state.

Rank 0 computes the plan and broadcasts it (as JSON) so that every rank runs the same collectives:

- ``needs_plan``: on a step where no fragment is due, no push awaits its base and it is not the last step,
  nothing can happen and the island skips the plan (no collective on most steps). A base that arrives unasked
  (merged by a quorum without this island) is staged at the next step that has a plan.
- ``plan``: the final cut (the last step, or the syncer ended the run), the fragments due that push, those that
  skip their boundary (merged before this island's restart), the arrived bases to stage in the background, the
  staged bases to arm for this step, and the bases that must be installed synchronously (an adoption after a
  restart, or a base that is the island's own weights). A fragment that pushes now takes a newer base as the
  push's answer: installing it before the push would throw the local progress away (a fragment the syncer is
  behind on adopts the syncer's base first); so does a fragment whose push is still in the background.
- When: ``InstallRule`` is the one place that decides how and when a merged base goes into the masters during
  training. With tau > 0 a base answering a push is armed exactly at the push's step + tau (as in the Streaming
  DiLoCo paper), never earlier, whenever it arrived: a quiet and a busy machine install it at the same step. A
  base that answers no push of this island is armed at the first plan after its staging ended.
- ``overdue``: pushes waited on because tau steps passed without their answer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import AbstractSet, Dict, List, Optional, Sequence

from yeto_patch.island.boundary.fragment import PushPhase
from yeto_patch.island.errors import EngineError


@dataclass(frozen=True)
class InstallRule:
    """How and when a merged base goes into the masters during training (tau = YETO_DILOCO_OVERLAP_STEPS,
    alpha = YETO_DILOCO_MERGE_ALPHA): tau > 0 blends, ``alpha * local + (1 - alpha) * base``, at the push's step
    + tau; tau = 0 replaces the masters with the base at the push's own step."""
    tau: int
    alpha: float

    @classmethod
    def of(cls, settings) -> "InstallRule":
        return cls(int(settings.overlap_steps), float(settings.merge_alpha))

    @property
    def blend(self) -> bool:
        return self.tau > 0

    @property
    def mode(self) -> str:
        return "blend" if self.blend else "replace"

    @property
    def alpha_or_none(self) -> Optional[float]:
        """The blend's alpha, None when the base replaces the masters."""
        return self.alpha if self.blend else None

    def alpha_for(self, mode: str) -> Optional[float]:
        """A synchronous install's alpha: None to replace, the blend's alpha, or 1.0 to keep the local masters
        (a restart where the syncer is still at the anchor)."""
        if mode not in ("replace", "blend", "keep"):
            raise EngineError(f"internal: install mode {mode!r}")
        return {"replace": None, "blend": self.alpha, "keep": 1.0}[mode]

    def install_step(self, push_step: int) -> int:
        return push_step + self.tau


@dataclass(frozen=True)
class BaseSpec:
    """A base rank 0 holds for a fragment: its version, its number of base updates (0: an absolute base),
    whether it is this island's own weights plus those updates (``own_weights``: the syncer matched the start
    digests this island declared) and whether it answers the fragment's push at the syncer (``answers``: False
    for a newer base whose merge did not take it: it goes in and the push still waits)."""
    fragment: int
    version: int
    updates: int = 0
    own_weights: bool = False
    answers: bool = True

    @classmethod
    def from_json(cls, d: dict) -> "BaseSpec":
        return cls(int(d["fragment"]), int(d["version"]), int(d["updates"]), bool(d["own_weights"]),
                   bool(d.get("answers", True)))


@dataclass
class Plan:
    push: List[int] = field(default_factory=list)         # fragments due that push now
    skip: List[int] = field(default_factory=list)         # due, merged before this island's restart
    final: bool = False
    by_syncer: bool = False
    install: List[BaseSpec] = field(default_factory=list)   # installed synchronously (adoption, own weights)
    stage: List[BaseSpec] = field(default_factory=list)     # handed to the background base lane
    arm: List[int] = field(default_factory=list)            # staged bases installed in this step
    sync_every: Optional[int] = None                        # auto, or a pinned H's rhythm: H from the next boundaries
    shift: Dict[int, int] = field(default_factory=dict)     # fragment -> steps its next boundary comes earlier (< 0: later)
    aim: Dict[int, int] = field(default_factory=dict)       # fragment -> the step of its next boundary (the rhythm's)

    def as_json(self) -> dict:
        return {"push": self.push, "skip": self.skip, "final": self.final, "by_syncer": self.by_syncer,
                "install": [asdict(b) for b in self.install], "stage": [asdict(b) for b in self.stage],
                "arm": self.arm, "sync_every": self.sync_every,
                "shift": {str(f): int(k) for f, k in self.shift.items()},
                "aim": {str(f): int(s) for f, s in self.aim.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        h = d["sync_every"]
        return cls([int(f) for f in d["push"]], [int(f) for f in d["skip"]], bool(d["final"]),
                   bool(d["by_syncer"]), [BaseSpec.from_json(b) for b in d["install"]],
                   [BaseSpec.from_json(b) for b in d["stage"]], [int(f) for f in d["arm"]],
                   None if h is None else int(h), {int(f): int(k) for f, k in d["shift"].items()},
                   {int(f): int(s) for f, s in d.get("aim", {}).items()})


def needs_plan(step: int, total: int, due: Sequence[int], any_push: bool) -> bool:
    return bool(any_push or step >= total or due)


def base_spec(fragment) -> BaseSpec:
    """Rank 0: the spec of the base that arrived for `fragment` (checked: base updates must apply to the anchor)."""
    b = fragment.side.arrived
    answers = fragment.answers(b)
    if not b.relative:
        return BaseSpec(fragment.index, b.version, answers=answers)
    if not b.held and b.start != fragment.anchor_version:
        raise EngineError(f"yeto-patch: fragment {fragment.index}: the syncer's base update applies to v{b.start}, "
                          f"but this island's anchor is v{fragment.anchor_version}")
    return BaseSpec(fragment.index, b.version, len(b.deltas), bool(b.held), answers)


def stageable(fragment) -> bool:
    """Rank 0: the arrived base may be staged in the background (not an adoption after a restart, nor a base
    that is this island's own weights: those install synchronously)."""
    side = fragment.side
    return not side.adopt and not (side.arrived.relative and side.arrived.held)


def install_due(fragment, step: int, rule: InstallRule) -> bool:
    """The base staged or arrived for `fragment` may go in at `step`: there is no push of this island, the base does not answer
    the push at the syncer (a newer base: at once), or `step` is the push's step + tau or later (the step the plan
    fixes for an answer, whenever it arrived)."""
    p = fragment.push
    if p is None:
        return True
    if p.phase is not PushPhase.AT_SYNCER:
        return False
    st = fragment.staging
    answers = st.answers if st is not None else fragment.answers(fragment.side.arrived)
    return not answers or step >= rule.install_step(p.step)


def armable(fragment, step: int, rule: InstallRule, ready: AbstractSet[int]) -> bool:
    """Rank 0: fragment's staged base goes into the masters at `step`: rank 0's part of the staging ended and the
    install is due."""
    return fragment.index in ready and install_due(fragment, step, rule)


def plan(step: int, total: int, due: Sequence[int], frags, by_syncer: bool, rule: InstallRule,
         ready: AbstractSet[int] = frozenset()) -> Plan:
    """The plan of `step` (rank 0, after taking the bases received): `due` from the schedule, `frags` the
    fragments, `by_syncer` whether the syncer started its final cut; `ready`: fragments whose staged base is
    ready on rank 0."""
    final = step >= total or by_syncer
    due = [] if final else list(due)
    skip = [f for f in due if frags[f].skip]
    due = [f for f in due if f not in skip]
    pushing = set(range(len(frags))) if final else set(due)
    # a push still in the background is not at the syncer yet: a base arriving meanwhile waits for it
    pushing |= {s.index for s in frags if s.push is not None and s.push.phase is PushPhase.IN_LANE}
    p = Plan(push=due, skip=skip, final=final, by_syncer=by_syncer)
    if by_syncer:
        return p
    for s in frags:
        if s.staging is not None:   # nothing else goes into a fragment while its base is staged
            if s.index not in pushing and armable(s, step, rule, ready):
                p.arm.append(s.index)
            continue
        b = s.side.arrived
        if b is not None and (s.side.adopt or (b.version > s.anchor_version and s.index not in pushing)):
            if not final and stageable(s):
                p.stage.append(base_spec(s))   # staged at once, armed when due
            elif s.side.adopt or final or install_due(s, step, rule):
                p.install.append(base_spec(s))
    return p


def overdue(step: int, rule: InstallRule, frags) -> List[int]:
    """Fragments whose push was made tau or more steps ago and is still unanswered."""
    return [s.index for s in frags if s.push is not None and step >= rule.install_step(s.push.step)]


def final_step(total_steps, train_iters, step: int) -> int:
    """The step of the final cut: YETO_DILOCO_TOTAL_STEPS, else the training loop's train_iters; an
    EngineError when neither says, when it is beyond train_iters or when the run resumes at or past it."""
    total = total_steps if total_steps is not None else train_iters
    if total is None:
        raise EngineError("YETO_DILOCO_TOTAL_STEPS is not set and the training loop does not say how many "
                          "steps it runs: set YETO_DILOCO_TOTAL_STEPS to the step of the final cut")
    if train_iters is not None and total > train_iters:
        raise EngineError(f"YETO_DILOCO_TOTAL_STEPS={total} is beyond Megatron's train_iters="
                          f"{train_iters}: the final cut would never happen")
    if total <= step:
        raise EngineError(f"this run resumes at step {step}, at or past the final cut at step {total} "
                          f"(YETO_DILOCO_TOTAL_STEPS or train_iters)")
    return int(total)
