"""The boundary's step loop: plans, pushes and answers of an island's fragments, on every rank.

Per optimizer step the engine calls ``plan_ahead`` (before the update: rank 0's plan of the step, broadcast;
its staged bases are armed so that they go into the masters inside the step) and ``after_step`` (after the
update: what the plan says about pushes, skips and synchronous installs; waits at the tau bound). ONE push
route: at a fragment's boundary every rank snapshots its own shard of the fragment's masters into the
background push lane (push_lane.py), whose gather and encoding run beside training; rank 0 hands the finished
push to the link at a later plan, or at once when something waits for it (tau = 0 waits for the answer in the
same step, the final cut for every push).

Collective order (the rule every method here keeps): every rank calls the same channel and view collectives in
the same order, because a gloo collective that one rank skips leaves the others waiting in it until the timeout.
So every decision that changes what happens next is rank 0's and reaches the other ranks through one broadcast
(``channel.rank0``): the plan, the pushes rank 0 handed to the link (``Plan.handed`` and ``Answers.handed``: the
other ranks mark them too, so every rank's fragments have the same state), and how each awaited answer is
installed. Code that only rank 0 can run (the link, the log) runs inside those broadcasts' functions; no branch
on the rank may contain a collective. ``tests/island/boundary/test_collective_order.py`` drives these plans on
several ranks with recording fakes and fails if the ranks' sequences of collectives differ.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

from yeto_patch.island.boundary.fragment import PushPhase, PushWire
from yeto_patch.island.boundary.installs import Installer
from yeto_patch.island.boundary.parts import IslandParts
from yeto_patch.island.boundary.plan import BaseSpec, Plan, base_spec, needs_plan, overdue, plan, stageable
from yeto_patch.island.boundary.schedule import (Cadence, aim_floor, catch_up, follow, hold, keep_rhythm,
                                                 reply_aims, rhythm_period, suggest)
from yeto_patch.island.errors import EngineError

log = logging.getLogger("yeto_patch")


@dataclass
class PlannedStep:
    """The plan made before a step's update (``plan_ahead``), kept for the rest of that step."""
    step: int
    plan: Plan
    seconds: float


@dataclass(frozen=True)
class Answer:
    """How one awaited answer is installed (rank 0's decision, broadcast): "staged" (already in the lane),
    "stage" (staged now, then installed), "now" (synchronously: an adoption after a restart, or the island's
    own weights), "settle" (refused, with nothing newer than the anchor: the push is done) or "none" (no push
    left). A base that does not answer the push (its ``spec.answers``) goes in by the same routes."""
    route: str
    spec: Optional[BaseSpec] = None

    def as_json(self) -> dict:
        return {"route": self.route, "spec": None if self.spec is None else asdict(self.spec)}

    @classmethod
    def from_json(cls, d: dict) -> "Answer":
        if d["route"] not in ("staged", "stage", "now", "settle", "none"):
            raise EngineError(f"internal: unknown install route {d['route']!r}")
        return cls(d["route"], None if d["spec"] is None else BaseSpec.from_json(d["spec"]))


class Boundaries:
    """The fragments' boundaries on one rank (see the module docstring)."""
    __slots__ = ("parts", "installer", "planned", "cadence", "syncer_ended", "aimed", "held")

    def __init__(self, parts: IslandParts, installer: Installer, syncer_ended: bool = False):
        self.parts = parts
        self.installer = installer
        self.planned: Optional[PlannedStep] = None
        # the syncer's welcome said its final cut is done (every rank knows it): the first step plans, and takes it
        self.syncer_ended = bool(syncer_ended)
        # when each fragment is due (every rank; H may follow the fleet's pace: YETO_DILOCO_SYNC_EVERY=auto)
        self.cadence = Cadence(parts.settings.sync_every, len(parts.frags), parts.step())
        # rank 0, a pinned H: fragment -> (base version, step) of the push whose PUSH_REPLY aimed its next boundary
        self.aimed: dict = {}
        self.held: dict = {}   # rank 0: fragment -> steps its aimed boundary waited for the rhythm island (hold)

    # ------------------------------------------------------------------------------------- pushes
    def push(self, f: int, final: bool = False) -> None:
        """Every rank: fragment f's boundary: its push goes into the background push lane (a snapshot of this
        rank's own shard; the rest runs beside training)."""
        p = self.parts
        frag = p.frags[f]
        push = frag.begin_push(p.step(), final)
        p.pushes.submit(frag, push)

    def handover(self) -> List[int]:
        """Rank 0: the pushes whose background stage ended go to the link, in boundary order; returns their
        fragments (announced to the other ranks by the caller's broadcast)."""
        p = self.parts
        handed = []
        for job in p.pushes.take_finished():
            frag, enc = job.fragment, job.result
            frag.push_handed(PushWire.of(enc.body, job.figures(enc, p.step())))
            p.link.send_push(frag.outgoing(p.rule.blend))
            handed.append(frag.index)
        return handed

    def mark_handed(self, fragments: List[int]) -> None:
        """Every rank but 0: rank 0 handed these pushes to the link; this rank's lane lets their jobs go."""
        if self.parts.rank == 0:
            return
        for f in fragments:
            self.parts.pushes.release(f, f"the push of fragment {f}")
            self.parts.frags[f].push_handed(None)

    def drain(self, what: str, fragments: Optional[List[int]] = None) -> None:
        """Every rank: wait for the pushes in the lane (of `fragments` and those before them, or all); rank 0
        hands them to the link."""
        p = self.parts

        def handed():
            p.pushes.wait_for(fragments, what)
            return self.handover()
        self.mark_handed(p.channel.rank0(handed, what))

    # ------------------------------------------------------------------------------------- plans
    def make_plan(self, step: int) -> Optional[PlannedStep]:
        """Every rank: rank 0's plan of `step` (with the seconds it took), or None on a step where nothing can
        happen (no collective)."""
        p = self.parts
        due = self.cadence.due(step)
        if not needs_plan(step, p.total, due, bool(p.frags.pushing())) and not self.syncer_ended:
            return None
        t0 = time.perf_counter()

        def decide():
            handed = self.handover()
            p.bases.check()
            p.frags.receive(p.link.poll())
            ready = {frag.index for frag in p.frags if p.bases.finished(frag.index)}
            rhythm = {} if p.settings.sync_auto else p.link.rhythm()   # (read once per plan)
            held = [] if p.settings.sync_auto else self._hold(step, due, rhythm)
            out = plan(step, p.total, [f for f in due if f not in held], p.frags, p.link.final_cut, p.rule, ready)
            if p.settings.sync_auto:
                self._pace(out)
            else:
                self._keep_rhythm(out, rhythm, step)
                out.aim.update({f: step + 1 for f in held})
            return {"plan": out.as_json(), "handed": handed}
        decided = p.channel.rank0(decide, f"plan step {step}")
        self.mark_handed(decided["handed"])
        return PlannedStep(step, Plan.from_json(decided["plan"]), time.perf_counter() - t0)

    def _pace(self, plan_: Plan) -> None:
        """Rank 0 (YETO_DILOCO_SYNC_EVERY=auto): the plan's H at the fleet's pace, and how much earlier the next
        boundary of each fragment pushing now comes when its round merged without it (schedule.py)."""
        p, h = self.parts, self.cadence.h
        plan_.sync_every = suggest(p.settings.sync_every, p.rule.tau, p.link.rate(), p.link.pace(), h)
        rate, now = p.link.rate(), time.monotonic()
        plan_.shift = {}
        for f in plan_.push:
            at = p.frags[f].behind_by()
            k = 0 if at is None else catch_up(now - at, 1.0 / rate if rate else None, h, p.rule.tau)
            if k:
                plan_.shift[f] = k

    def _opened(self, period: float) -> dict:
        """Rank 0: {fragment: seconds ago} of the open rounds the rhythm island's push is in (the syncer's word),
        within half its period."""
        return {f: age for f, age in self.parts.link.opened().items() if age <= period / 2}

    def _hold(self, step: int, due: list, rhythm: dict) -> list:
        """Rank 0 (a pinned H keeping the rhythm): the fragments due now that wait a step more for the rhythm
        island's push (schedule.hold, at most N steps past their aim; never at the run's last steps)."""
        p = self.parts
        if not due or step + 1 >= p.total:
            return []
        period = rhythm_period(rhythm)
        if period is None:   # (no rhythm, or this island is the rhythm island)
            self.held.clear()
            return []
        return hold(due, self._opened(period), self.held, p.settings.sync_every)

    def _keep_rhythm(self, plan_: Plan, rhythm: dict, step: int) -> None:
        """Rank 0 (a pinned YETO_DILOCO_SYNC_EVERY=N): while the syncer says the fleet keeps the slowest island's
        rhythm, H stretched to this island's steps in its period and each fragment pushing now aimed at its next
        push of that fragment (schedule.keep_rhythm, from the heartbeats); then, once a push's PUSH_REPLY says when
        that island pushes the fragment next counted from this push, its next boundary aimed from the push's step
        (schedule.aim_after: fresher than a heartbeat); N again when the syncer says no rhythm."""
        p = self.parts
        rate = p.link.rate()
        plan_.sync_every, plan_.shift = keep_rhythm(p.settings.sync_every, p.rule.tau, rate, rhythm,
                                                    self.cadence.h, plan_.push, step, self.cadence.fragments)
        pushes = {fr.index: (fr.push.base_version, fr.push.step) for fr in p.frags
                  if fr.push is not None and fr.push.phase is PushPhase.AT_SYNCER and fr.index not in plan_.push}
        h = plan_.sync_every or self.cadence.h
        lo = aim_floor(p.settings.sync_every, p.rule.tau)
        plan_.aim = reply_aims(p.link.aims(), pushes, self.aimed, rate, lo, 2 * h, p.step())
        period = rhythm_period(rhythm)
        if period is not None:   # a round the rhythm island's push opened: this fragment's boundary comes at once
            plan_.aim.update(follow({f: a for f, a in self._opened(period).items() if f not in plan_.push},
                                    self.cadence, p.step(), lo, period))

    def begin(self, plan_: Plan) -> None:
        """Every rank: the plan's new H and boundary shifts go to the cadence (from the next boundaries on), its
        staged bases are armed for this step's install points, and its arrived bases handed to the background
        lane."""
        self.cadence.retune(plan_.sync_every)
        for f, k in plan_.shift.items():
            self.cadence.shift(f, k)
        for f, at in plan_.aim.items():
            self.cadence.aim(f, at)
        for f in plan_.arm:
            self.installer.arm(f, "arrived")
        for spec in plan_.stage:
            self.installer.stage(spec)

    def plan_ahead(self) -> None:
        """Every rank, before the optimizer step's update: the step's plan, so that its staged bases are
        installed inside the step (``Installer.into_leaf``); the rest of the plan runs after the step."""
        self.planned = self.make_plan(self.parts.step() + 1)
        if self.planned is not None:
            self.begin(self.planned.plan)

    def take_plan(self):
        """Every rank, after the optimizer step: the step's plan (made before the update, or now for a loop
        without the step hook's before-call), or None."""
        planned, self.planned = self.planned, None
        if planned is not None and planned.step == self.parts.step():
            return planned
        self.installer.finish()
        planned = self.make_plan(self.parts.step())
        if planned is not None:
            self.begin(planned.plan)
        return planned

    def after_step(self, planned: PlannedStep) -> None:
        """Every rank, after the optimizer step (not the final cut): skips, synchronous installs, the
        installs left from inside the step, the due pushes, and the waits at the tau bound."""
        p, pl = self.parts, planned.plan
        for f in pl.skip:
            self.skip(f)
        for spec in pl.install:
            self.installer.now(spec, p.rule.mode, why="arrived")
        self.installer.finish()
        for f in pl.push:
            if p.frags[f].push is not None:   # its previous base never came within H steps (tau < H)
                self.await_answers([f], f"the base answering fragment {f}'s previous push")
            t0 = time.perf_counter()
            self.push(f)
            p.pushes.note_boundary(f, planned.seconds + time.perf_counter() - t0)
        late = overdue(p.step(), p.rule, p.frags)
        if late:
            self.await_answers(late, None)

    def skip(self, f: int) -> None:
        """Every rank: fragment f's round at this boundary was merged with this island's push before it
        restarted (the steps since were trained again): pushing again would count that progress twice."""
        self.parts.frags[f].skipped()
        if self.parts.rank == 0:
            log.info("yeto-patch: step %d: fragment %d's round at this boundary was merged before the restart "
                     "(with this island's push of then); not pushing it again", self.parts.step(), f)

    # ------------------------------------------------------------------------------------- answers
    def await_answers(self, frags: List[int], what: Optional[str]) -> None:
        """Every rank: wait until rank 0 holds the answer of each fragment's push (its push handed to the link
        first: a base may not overtake it), then install it after the step. The answer is a base whose merge took
        the push, or a refusal (then the newest base, or nothing newer than the anchor: the push is settled). A
        newer base that did not take the push goes in as a newer base meanwhile, and the wait goes on; while it
        waits so, rank 0 asks the link to send the push again (the syncer merges it or refuses it)."""
        p = self.parts
        in_lane = [f for f in frags if p.frags[f].push_phase is PushPhase.IN_LANE]
        if in_lane:   # our own background work first (tau = 0 waits here for the push it just made)
            if p.rank == 0:
                self._say_waiting(in_lane)
            self.drain(f"the pushes of fragments {in_lane}", in_lane)
        desc = what or self._waiting_for(frags)
        t0 = time.perf_counter()
        pending = [f for f in frags if p.frags[f].push is not None]
        while pending:
            handed: List[int] = []

            def ready():
                handed.extend(self.handover())
                p.bases.check()
                p.frags.receive(p.link.poll())
                out = True
                for f in pending:
                    frag = p.frags[f]
                    if frag.push is None or frag.push.phase is not PushPhase.AT_SYNCER or frag.answered():
                        continue
                    newer = frag.newer_at_hand()
                    if newer or frag.anchor_version > frag.push.base_version:   # merged past it: ask again
                        p.link.ask_again(f, frag.push.base_version)              # (at most every ASK_AGAIN_S)
                    if not newer:   # (a newer base goes in now; the wait for the answer goes on after it)
                        out = False
                return out
            p.await_ready(ready, desc)
            waited_ms = round((time.perf_counter() - t0) * 1000, 2)

            def routes():
                return {"handed": handed, "routes": {str(f): self._answer_route(f, waited_ms).as_json()
                                                     for f in pending}}
            out = p.channel.rank0(routes, "answered versions")
            self.mark_handed(out["handed"])
            for f in pending:
                self._install_answer(f, Answer.from_json(out["routes"][str(f)]))
            pending = [f for f in pending if p.frags[f].push is not None]

    def _waiting_for(self, frags) -> str:
        """The wait's description (every rank can make it: pushes are the same on every rank)."""
        p = self.parts
        return ", ".join(f"the base of fragment {f} newer than v{p.frags[f].push.base_version} (pushed at step "
                         f"{p.frags[f].push.step})" for f in frags if p.frags[f].push is not None) + \
            f" [tau={p.rule.tau}]"

    def _say_waiting(self, frags) -> None:
        """Rank 0: a wait at the tau bound for a push still in the background lane is worth a warning."""
        p = self.parts
        if p.rule.tau == 0:
            return
        for f in frags:
            push = p.frags[f].push
            if push is not None:
                log.warning("yeto-patch: step %d: waiting at the tau bound (tau=%d) for fragment %d's push of "
                            "step %d, still in %s", p.step(), p.rule.tau, f, push.step, p.pushes.behind(f))

    def _answer_route(self, f: int, waited_ms: float) -> Answer:
        """Rank 0: how fragment f's answer (or the newer base that goes in first) is installed (see ``Answer``)."""
        frag = self.parts.frags[f]
        if frag.push is None:
            return Answer("none")
        frag.note_wait(waited_ms)
        if frag.staging is not None:
            return Answer("staged")
        b = frag.side.arrived
        if b is None or b.version <= frag.anchor_version and not frag.side.adopt:
            return Answer("settle")   # refused, and nothing newer than the anchor: the push is done
        return Answer("stage" if stageable(frag) else "now", base_spec(frag))

    def _install_answer(self, f: int, answer: Answer) -> None:
        """Every rank: install fragment f's answer after the step, by the route rank 0 chose."""
        p = self.parts
        if answer.route == "none":
            return
        if answer.route == "settle":
            push = p.frags[f].settle()
            if p.rank == 0:
                p.log.write("settled", step=p.step(), fragment=f, base_version=push.base_version,
                            push_step=push.step)
            return
        if answer.route == "now":
            self.installer.now(answer.spec, p.rule.mode, why="answer")
            return
        if answer.route == "stage":
            self.installer.stage(answer.spec)
        self.installer.arm(f, "answer")
        self.installer.finish()
