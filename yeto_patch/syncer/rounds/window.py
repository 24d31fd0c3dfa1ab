"""The pace window: how long a round waits for the rest once its floor answered (no ``--grace``).

A round waits for a missing island only if that island's **own pace** says it pushes soon, never because of who
pushed first. The syncer keeps, per island and fragment, the steps between its pushes of that fragment (from the
pushes' ``local_step``) and, from its heartbeats and pushes, its step, when it last moved, and its compute rate
(rounds/members.py). For a missing island ``i`` the window estimates when its next push of the fragment arrives:

* ``arrival(i)``: when it last said its step + (its next boundary: its last push's step + a whole number of its
  usual steps between pushes, the first after that step - that step) / its rate, and no sooner than its last
  push's arrival + the same steps / its rate (a push arrives a lane delay after its boundary); its usual steps from
  its other fragments before its second push of this one; before its first push of the fragment, or its second of
  any, the schedule its heartbeats say (its H and each fragment's next boundary step), so that a run's first rounds
  know when each island comes; unknown (None) for a newcomer that said neither (or no rate yet),
  infinite for an island whose step has not moved for ``STALL_PERIODS`` of its push intervals (and at least
  ``STALL_MIN_S``): an island that stalls while it stays connected is not waited for, and is waited for again as
  soon as it moves;
* the **deadline**: the round merges at the latest when the answers' patience runs out (an answer's patience: the
  seconds after sending until that island blocks for its answer, tau steps of its step time). Taken as the
  **upper median** over the answers of ``arrival + patience``, so one push with a tiny patience (fewer than half of
  the answers) cannot close the window on the others; capped by ``PERIOD_SHARE`` of the fleet's period of this
  fragment (the median over islands of their steps between pushes / their rate) and by ``--round-timeout``;
  ``FIRST_BOUND_S`` after the first answer while nothing is known;
* the round waits for each island whose ``arrival`` is within the deadline until that arrival plus ``SLACK_S``
  (and, while the islands keep a rhythm, ``LATE_STEPS`` of that island's steps: a boundary aimed at the rhythm,
  island/boundary/schedule.aim, moves by a step), never past the deadline; in a round the rhythm island's push is
  in, an island that aims at it is due at once and waited for ``AIM_SHARE`` of the rest of the window (its own
  steps between pushes vary by aim); a newcomer is waited for until the deadline; an island due beyond it is not
  waited for (its push is carried into the next round). ``Window.why`` says, per missing island, which of these
  applied (the merge line names those a merge went without).

An early push (even one with a zero delta the moment each base arrives) only opens a round: the honest islands' own
pace decides whether they are waited for. Everything is a pure function of the recorded steps and times and of the
clock the coordinator passes (tests use a fake one).
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Iterable, Optional

__all__ = ["PaceWindow", "Window", "said_boundary", "HISTORY", "PERIOD_SHARE", "FIRST_BOUND_S", "SLACK_S", "LATE_STEPS", "STALL_PERIODS", "STALL_MIN_S"]

HISTORY = 8           # step intervals kept per island and fragment
PERIOD_SHARE = 0.5    # the deadline: at most this share of the fleet's period of the fragment after the first answer
FIRST_BOUND_S = 30.0  # the deadline while no patience and no period is known (a run's first rounds)
SLACK_S = 0.05        # added to the latest eta waited for
LATE_STEPS = 1        # ... and, while the islands keep a rhythm, this many of the island's steps
AIM_STEPS = 1         # an island aiming at the rhythm island's push is waited for this many of its steps after it,
AIM_SHARE = 0.75      # ... or this share of the rest of the window, whichever is longer
STALL_PERIODS = 2.0   # an island whose step has not moved for this many of its push intervals ...
STALL_MIN_S = 2.0     # ... (and at least this long) is stalled: not waited for


def upper_median(xs: list) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class PaceWindow:
    """Per island and fragment: its last pushed step and its recent steps between pushes (owned by the coordinator,
    under its lock). The islands' steps and rates live in their ``Member`` records (rounds/members.py)."""

    def __init__(self, members: dict):
        self.members = members   # the roster's members (read only: their steps, rates, when they last moved)
        self.last_step: dict[tuple[str, int], int] = {}
        self.intervals: dict[tuple[str, int], collections.deque] = {}

    # --------------------------------------------------------------------------------------------- record
    def pushed(self, island: str, fragment: int, local_step: int) -> None:
        """A push of ``island`` for ``fragment`` made at its step ``local_step`` was accepted."""
        key = (island, fragment)
        prev = self.last_step.get(key)
        if prev is not None and local_step > prev:
            self.intervals.setdefault(key, collections.deque(maxlen=HISTORY)).append(local_step - prev)
        if prev is None or local_step > prev:
            self.last_step[key] = local_step

    def forget(self, island: str) -> None:
        """A restarted island (new incarnation): its old steps say nothing about its new process."""
        for key in [k for k in self.last_step if k[0] == island]:
            self.last_step.pop(key, None)
            self.intervals.pop(key, None)

    # --------------------------------------------------------------------------------------------- read
    def interval(self, island: str, fragment: int, member=None) -> Optional[float]:
        """``island``'s usual steps between pushes of ``fragment``; before its second push of it, its usual steps
        between pushes of its other fragments (one H for all: a run's first rounds need not wait for a second push
        of every fragment); before its second push of any, the H its heartbeats say (``member``); else None."""
        xs = self.intervals.get((island, fragment))
        if xs:
            return statistics.median(xs)
        every = [x for (i, _), ys in self.intervals.items() if i == island for x in ys]
        if every:
            return statistics.median(every)
        return None if member is None or member.sync_every is None else float(member.sync_every)

    def arrival(self, island: str, fragment: int, member, now: float) -> Optional[float]:
        """The clock time ``island``'s next push of ``fragment`` is due by its own pace (None: unknown; inf:
        stalled). It can be in the past: the island is overdue. Before its first push of the fragment: the boundary
        its heartbeats say, so that a run's first rounds know when it comes."""
        h = self.interval(island, fragment, member)
        last = self.last_step.get((island, fragment))
        if member is None or h is None or member.rate <= 0 or member.step_at is None:
            return None
        stalled_after = max(STALL_MIN_S, STALL_PERIODS * h / member.rate)
        if member.moved_at is not None and now - member.moved_at > stalled_after:
            return math.inf
        step = max(member.step, member.pushed_step or 0)
        if last is None:
            boundary = said_boundary(fragment, member, step)
            return None if boundary is None else member.step_at + (boundary - member.step) / member.rate
        ahead = max(1, math.ceil((step - last) / h))   # its next boundary (after any it skipped)
        boundary = last + ahead * h
        due = member.step_at + (boundary - member.step) / member.rate   # when it reaches that boundary ...
        if member.pushed_at is not None:   # ... and its push arrives, counted from its last push's arrival
            due = max(due, member.pushed_at + (boundary - member.pushed_step) / member.rate)
        return due

    def rhythm(self, island: str, fragment: int, member, now: float) -> Optional[tuple[float, float]]:
        """(seconds until ``island``'s next push of ``fragment`` is due by its pace, its period of the fragment in
        seconds), or None when unknown or stalled: what a pinned H keeps its phase with (the syncer's HEARTBEAT
        sends it to the other islands; island/boundary/schedule.aim)."""
        at = self.arrival(island, fragment, member, now)
        h = self.interval(island, fragment, member)
        if at is None or h is None or math.isinf(at) or member.rate <= 0:
            return None
        return at - now, h / member.rate

    def period(self, fragment: int, members: dict) -> Optional[float]:
        """The fleet's period of ``fragment`` (s): the median over islands of their steps between pushes / rate."""
        ps = []
        for (island, fr), xs in self.intervals.items():
            m = members.get(island)
            if fr == fragment and xs and m is not None and m.rate > 0:
                ps.append(statistics.median(xs) / m.rate)
        return statistics.median(ps) if ps else None

    def deadline(self, fragment: int, patience: Iterable[tuple], missing: Iterable[str], now: float,
                 t_first: float, timeout_s: float, late_steps: float = 0.0,
                 aimed_at: Optional[float] = None) -> "Window":
        """When the round merges at the latest, the missing islands it waits for, and why it does not wait for the
        others. ``patience``: the answers' (arrival time, patience or None); ``late_steps``: each island's steps
        added to its arrival (while the islands keep a rhythm, their aimed boundaries move by a step or so). With
        nobody worth waiting for the deadline is now."""
        members = self.members
        ends = [t + p for t, p in patience if p is not None and p > 0 and t is not None]
        period = self.period(fragment, members)
        caps = [t_first + timeout_s]
        if period:
            caps.append(t_first + PERIOD_SHARE * period)
        if ends:
            caps.append(upper_median(ends))
        elif not period:
            caps.append(t_first + FIRST_BOUND_S)
        bound = min(caps)
        w = Window(now, bound)
        for i in sorted(missing):
            m = members.get(i)
            due = self.arrival(i, fragment, m, now)
            if due is None:
                arrive = bound                    # a newcomer: waited for until the deadline
                w.why[i] = "its pace is not known yet: waited for until the window closed"
            elif math.isinf(due):
                w.why[i] = "stalled: its step has not moved for two of its push intervals"
                continue
            else:
                extra = SLACK_S + late_steps / m.rate
                if aimed_at is not None:   # it aims its boundaries at the rhythm island's push, which is in
                    due = aimed_at         # (its own steps between pushes vary by aim: not its pace)
                    extra = max(SLACK_S + (late_steps + AIM_STEPS) / m.rate, AIM_SHARE * (bound - aimed_at))
                if due > bound:                   # not within the others' patience: carried
                    w.why[i] = f"due {due - bound:.2f}s after the window closed"
                    continue
                # due within the window: waited for until then, and a little more (never past the window)
                arrive = min(bound, due + extra)
                w.why[i] = (f"overdue by {now - arrive:.2f}s by its pace" if arrive <= now else
                            "due within the window")
            w.waits_for.append(i)
            w.at = max(w.at, arrive)
        return w


def said_boundary(fragment: int, member, step: int) -> Optional[int]:
    """The step of ``member``'s next boundary of ``fragment`` after ``step`` by the schedule its heartbeats said
    (its next boundary, then every H); None when it said none of this fragment."""
    nxt, h = member.next_boundaries, member.sync_every
    if nxt is None or h is None or not 0 <= fragment < len(nxt):
        return None
    boundary = nxt[fragment]
    if boundary <= step:
        boundary += h * math.ceil((step - boundary + 1) / h)
    return boundary


class Window:
    """What ``PaceWindow.deadline`` decided for a round: ``at``, the clock time it merges at the latest;
    ``waits_for``, the missing islands it waits for; ``why``, for each missing island, what its pace says (the merge
    line names those it went without, and why)."""

    def __init__(self, now: float, bound: float):
        self.at = now
        self.bound = bound
        self.waits_for: list = []
        self.why: dict = {}
