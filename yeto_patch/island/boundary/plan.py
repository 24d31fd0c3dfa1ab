"""What happens at an optimizer step: a pure function of the step, the schedule and the fragments' state.

Rank 0 computes the plan and broadcasts it (as JSON) so that every rank runs the same collectives:

- ``needs_plan``: on a step where no fragment is due, no push awaits its base and it is not the last step,
  nothing can happen and the island skips the plan (no collective on most steps). A base that arrives unasked
  (merged by a quorum without this island) is installed at the next step that has a plan.
- ``plan``: the final cut (the last step, or the syncer ended the run), the fragments due that push, those that
  skip their boundary (merged before this island's restart), and the arrived bases to install first. A fragment
  that pushes now takes a newer base as the push's answer: installing it before the push would throw the local
  progress away (a fragment the syncer is behind on adopts the syncer's base first); so does a fragment whose
  push is still in the background (island/boundary/push_lane.py). With a base stager the arrived bases are staged
  first (every holder gets its part in the background, island/boundary/base_lane.py) and installed, locally on every
  rank, at the first plan after rank 0's part of the staging ended.
- ``overdue``: pushes waited on because tau steps passed without their answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, List, Optional, Sequence

from yeto_patch.island.errors import EngineError


@dataclass
class Plan:
    install: List[list] = field(default_factory=list)   # [fragment, version, number of base updates, held]
    push: List[int] = field(default_factory=list)
    skip: List[int] = field(default_factory=list)
    final: bool = False
    by_syncer: bool = False
    stage: List[list] = field(default_factory=list)     # [fragment, version, number of base updates]: to stage
    staged: List[int] = field(default_factory=list)     # fragments whose staged base is installed now
    sync_every: Optional[int] = None                    # YETO_DILOCO_SYNC_EVERY=auto: H from the next boundaries
    shift: dict = field(default_factory=dict)           # auto: fragment -> steps its next boundary comes earlier

    def as_json(self) -> dict:
        return {"install": self.install, "push": self.push, "skip": self.skip, "final": self.final,
                "by_syncer": self.by_syncer, "stage": self.stage, "staged": self.staged,
                "sync_every": self.sync_every, "shift": {str(f): k for f, k in self.shift.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        h = d.get("sync_every")
        return cls([[int(f), int(v), int(k), bool(h)] for f, v, k, h in d["install"]], [int(f) for f in d["push"]],
                   [int(f) for f in d["skip"]], bool(d["final"]), bool(d["by_syncer"]),
                   [[int(f), int(v), int(k)] for f, v, k in d["stage"]], [int(f) for f in d["staged"]],
                   None if h is None else int(h), {int(f): int(k) for f, k in d.get("shift", {}).items()})


def needs_plan(step: int, total: int, due: Sequence[int], any_pending: bool) -> bool:
    return bool(any_pending or step >= total or due)


def install_spec(state) -> list:
    """Rank 0: [fragment, version, number of base updates, held] for installing the base held for `state`
    (held: the base is the weights this island already holds, plus the updates)."""
    b = state.arrived
    if not b.relative:
        return [state.index, b.version, 0, False]
    if b.held:
        return [state.index, b.version, len(b.deltas), True]
    if b.start != state.anchor_version:
        raise EngineError(f"yeto-patch: fragment {state.index}: the syncer's base update applies to v{b.start}, but "
                          f"this island's anchor is v{state.anchor_version}")
    return [state.index, b.version, len(b.deltas), False]


def stageable(state) -> bool:
    """Rank 0: the arrived base may be staged in the background (not an adoption after a restart, nor a base
    that is this island's own weights: those install synchronously)."""
    return not state.adopt and not (state.arrived.relative and state.arrived.held)


def plan(step: int, total: int, due: Sequence[int], states, by_syncer: bool, staged: AbstractSet[int] = frozenset(),
         stage: bool = False) -> Plan:
    """The plan of `step` (rank 0, after taking the bases received): `due` from the schedule, `states` the
    fragments' states, `by_syncer` whether the syncer started its final cut; `staged`: fragments whose staged
    base is ready on rank 0; `stage`: arrived bases are staged in the background (installed at a later plan)
    rather than installed synchronously."""
    final = step >= total or by_syncer
    due = [] if final else list(due)
    skip = [f for f in due if states[f].skip]
    due = [f for f in due if f not in skip]
    pushing = set(range(len(states))) if final else set(due)
    # a push still in the background (tau >= 1) is not at the syncer yet: a base arriving meanwhile waits for it
    pushing |= {s.index for s in states if s.pending is not None and s.pending.get("_in_flight")}
    p = Plan(push=due, skip=skip, final=final, by_syncer=by_syncer)
    if by_syncer:
        return p
    for s in states:
        if s.staging is not None:   # nothing else goes into a fragment while its base is staged
            if s.index in staged and s.index not in pushing:
                p.staged.append(s.index)
        elif s.arrived is not None and (s.adopt or (s.arrived.version > s.anchor_version and s.index not in pushing)):
            if stage and not final and stageable(s):
                p.stage.append(install_spec(s)[:3])
            else:
                p.install.append(install_spec(s))
    return p


def overdue(step: int, tau: int, states) -> List[int]:
    """Fragments whose push was made tau or more steps ago and is still unanswered."""
    return [s.index for s in states if s.pending is not None and step - s.pending["step"] >= tau]


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
