"""When each fragment reaches a boundary: every H optimizer steps, the P fragments spread evenly over H.

Fragment f is due at the steps s (count of optimizer steps done, 1-based) with
``s % H == ((f + 1) * H // P) % H``: with H=100 and P=4 the fragments are due at steps 25, 50, 75, 100 (+ k*H),
so the island's traffic is spread out and each fragment still syncs once every H steps. With P > H several
fragments share a step.

``Cadence`` holds the same schedule with an H that may change during the run (``YETO_DILOCO_SYNC_EVERY=auto``):
each fragment is due H steps after its previous boundary, and a new H applies from each fragment's next boundary
on. ``suggest`` is the rule of ``auto``: an island pushes every ``H_nominal x its rate / the fleet's pace`` steps
(the syncer's pace: the fastest compute rate among the islands that are up), so islands of different speeds push
at the fleet's wall-clock rhythm, the fastest every ``H_nominal`` steps, a half-speed one every ``H_nominal / 2``;
never fewer than tau + 1 steps, never more than ``H_nominal``; it changes only by at least ``RETUNE_SHARE`` of H.

With ``auto`` an island also keeps its phase with the fleet: a fragment whose round merged before the island
pushed (a restart, a pause or a slow step put it behind the others) has its next boundary brought forward by the
steps it was late plus tau (``catch_up``, at most H / 2 at a time), so its next push lands inside the round rather
than being carried into the one after.
"""
from __future__ import annotations

import math

from typing import Optional

__all__ = ["offset", "due_fragments", "Cadence", "suggest", "stretch", "aim", "aim_after", "reply_aims", "keep_rhythm", "respread", "rhythm_period", "aim_floor", "follow", "hold", "catch_up", "RETUNE_SHARE", "MAX_STRETCH"]

RETUNE_SHARE = 0.1
MAX_STRETCH = 3.0   # a pinned H is stretched at most this much on a fast island (its weight is capped at 2x)
STRETCH_DEADBAND = 0.25   # an island at most this much faster than the rhythm one keeps N (noisy rates made H
                          # flip between N and N + 2 with every step: its aims then missed the rhythm's pushes)
AIM_BEHIND = 2      # an aimed boundary comes this many steps after the rhythm island's push (follow pulls it in)
AIM_SOONER = 0.15   # an aimed push may come this much sooner than N steps (aim_floor; the syncer's KEEPER_MARGIN)
RESPREAD_SHARE = 0.2   # a fragment goes back to its phase by at most this share of H per push (>= 1 step): the
                       # aims of the islands keeping the rhythm island's rhythm absorb that (one step fully)
AIM_CLAMP_STEPS = 1.5   # an aimed push this many steps sooner than H allows comes at H instead (a little late);
                        # sooner still, it aims at the rhythm island's push after that (see aim)


def offset(fragment: int, sync_every: int, fragments: int) -> int:
    return ((fragment + 1) * sync_every // fragments) % sync_every


def due_fragments(step: int, sync_every: int, fragments: int) -> list:
    """Fragments whose boundary is at `step` (steps done so far; step 0 is never a boundary)."""
    if step <= 0:
        return []
    r = step % sync_every
    return [f for f in range(fragments) if offset(f, sync_every, fragments) == r]


def _first_after(step: int, off: int, h: int) -> int:
    """The smallest s > step with s % h == off (s >= 1)."""
    s = step + 1
    return s + (off - s) % h


class Cadence:
    """The fragments' next boundaries with an H that may change. ``due(step)`` is pure; ``passed(step)`` after the
    step's boundaries moves the fragments due at it on by H (and applies an H set by ``retune``). With a fixed H it
    gives exactly ``due_fragments``."""

    def __init__(self, sync_every: int, fragments: int, step: int = 0):
        self.h = int(sync_every)
        self.fragments = int(fragments)
        self.next = [_first_after(int(step), offset(f, self.h, self.fragments), self.h) for f in range(fragments)]
        self.last: list = [None] * self.fragments   # each fragment's previous boundary (None: none yet)
        self._pending: Optional[int] = None
        self._shifts: dict = {}
        self._aims: dict = {}

    def due(self, step: int) -> list:
        return [f for f, s in enumerate(self.next) if s == step] if step > 0 else []

    def retune(self, sync_every: Optional[int]) -> None:
        """Use `sync_every` from the next boundaries on (applied by ``passed``)."""
        if sync_every is not None and int(sync_every) >= 1 and int(sync_every) != self.h:
            self._pending = int(sync_every)

    def aim(self, fragment: int, step: int) -> None:
        """Put `fragment`'s next boundary at `step` (applied by ``passed``, after a new H; at least one step on)."""
        self._aims[int(fragment)] = int(step)

    def shift(self, fragment: int, steps: int) -> None:
        """Bring `fragment`'s next boundary `steps` earlier (later when negative; applied by ``passed``, at least
        one step on)."""
        if steps:
            self._shifts[int(fragment)] = int(steps)

    def passed(self, step: int) -> None:
        """Step `step` is done: fragments due at it (or before: a step that was never shown) move on by H; a new
        H moves every other fragment's next boundary too (H_new after its previous one, at least one step on)."""
        for f, s in enumerate(self.next):
            if s <= step:
                self.last[f] = s
            while self.next[f] <= step:
                self.next[f] += self.h
        if self._pending is not None:
            old, self.h, self._pending = self.h, self._pending, None
            self.next = [max(step + 1, s - old + self.h) for s in self.next]
        for f, k in self._shifts.items():
            if 0 <= f < len(self.next):
                self.next[f] = max(step + 1, self.next[f] - k)
        for f, s in self._aims.items():
            if 0 <= f < len(self.next):
                self.next[f] = max(step + 1, s)
        self._shifts, self._aims = {}, {}


def suggest(nominal: int, tau: int, rate: float, pace: float, current: int) -> int:
    """The H of ``YETO_DILOCO_SYNC_EVERY=auto`` (see the module docstring); `current` when nothing is known or
    the change would be below RETUNE_SHARE of it."""
    if rate <= 0 or pace <= 0:
        return current
    h = max(int(tau) + 1, 1, min(int(nominal), int(round(nominal * min(1.0, rate / pace)))))
    return h if abs(h - current) >= max(1, RETUNE_SHARE * current) else current


def stretch(nominal: int, tau: int, rate: float, period_s: Optional[float], current: int) -> int:
    """The H of a pinned ``YETO_DILOCO_SYNC_EVERY=N`` (see the module docstring): N on the slowest island that is
    up (the rhythm), more on a faster one, its steps in the rhythm island's period of a fragment (``period_s``,
    which the syncer says: N steps of the slowest), so that all push at its wall-clock rhythm and share its
    rounds; at most ``MAX_STRETCH x N``; N when the syncer says no rhythm (None: this island is the rhythm, a
    fleet more than 2x apart, or one island); `current` when the change would be below RETUNE_SHARE of it."""
    n = int(nominal)
    if rate <= 0 or not period_s or period_s <= 0 or rate * period_s < n * (1.0 + STRETCH_DEADBAND):
        h = max(int(tau) + 1, n)   # (within STRETCH_DEADBAND of the rhythm island's speed: N, each push aimed)
    else:
        h = max(int(tau) + 1, n, min(int(MAX_STRETCH * n), int(round(rate * period_s))))
    return h if abs(h - current) >= max(1, RETUNE_SHARE * current) else current


def aim(eta_s: float, period_s: float, rate: float, lo: int, hi: int) -> Optional[int]:
    """Steps from a stretched fragment's boundary now to its next one: the rhythm island's push of the fragment
    (due in ``eta_s``, every ``period_s``) nearest to one period from now, so that this island's pushes land on
    its pushes (a push now shares the round of the rhythm's push within half a period), or the first one after
    that at least ``lo`` steps away (an island as fast as the rhythm one cannot come sooner than its H: clamped to
    ``lo`` it would land between two of its pushes); within [lo, hi]; None when nothing is known."""
    if rate <= 0 or period_s <= 0:
        return None
    phase = eta_s % period_s           # (a push overdue or periods ahead: the same phase)
    target = phase if phase > period_s / 2 else phase + period_s
    if target * rate < lo - AIM_CLAMP_STEPS:   # too soon for this island's H: the rhythm island's next push after
        target += period_s * math.ceil((lo - target * rate) / (period_s * rate))   # that, not between two of them
    return max(int(lo), min(int(hi), int(round(target * rate)) + AIM_BEHIND))


def aim_floor(nominal: int, tau: int) -> int:
    """The fewest steps an aimed boundary may come after the previous push of its fragment: N less AIM_SOONER of it
    (the rhythm island, the slowest by noisy rates, may be a little faster than this one: at N exactly, this island
    would fall behind its pushes a little every period and then miss one), and more than tau."""
    return max(int(tau) + 1, math.ceil(int(nominal) * (1.0 - AIM_SOONER)))


def rhythm_period(rhythm: dict) -> Optional[float]:
    """The rhythm island's period (s): the upper median over the fragments the syncer said it of (``rhythm``:
    {fragment: (eta_s, period_s)}); None when it said none."""
    periods = sorted(period for _, period in rhythm.values())
    return periods[len(periods) // 2] if periods else None


def keep_rhythm(nominal: int, tau: int, rate: float, rhythm: dict, current: int, pushing, step: int = 0,
                fragments: int = 0) -> tuple:
    """(H, {fragment: steps its next boundary comes earlier}) of a pinned ``YETO_DILOCO_SYNC_EVERY=N`` at a plan in
    which the fragments ``pushing`` push: H stretched to this island's steps in the rhythm island's period
    (``stretch``, N when the syncer says no rhythm), and each fragment pushing now aimed at that island's next push
    of it (``aim``). ``rhythm``: {fragment: (seconds until its push, its period)} as the syncer's heartbeat said
    (island/link/syncer.SyncerLink.rhythm). With no rhythm to keep (``rhythm`` empty), each fragment pushing now at
    ``step`` goes back to its own phase of H (``respread``; ``fragments``: how many; 0: left alone)."""
    h = stretch(nominal, tau, rate, rhythm_period(rhythm), current)
    shift = {}
    for f in pushing:
        if f in rhythm:
            steps = aim(*rhythm[f], rate, aim_floor(nominal, tau), 2 * h)
            if steps is not None and steps != h:
                shift[f] = h - steps
        elif not rhythm and fragments:
            k = respread(f, step, h, fragments)
            if k:
                shift[f] = k
    return h, shift


def respread(fragment: int, step: int, h: int, fragments: int) -> int:
    """Steps to bring the next boundary of ``fragment``, pushing at ``step``, earlier (later when negative), so that
    it lands on the fragment's own phase of H (``offset``) again: the nearest such step to ``step + h``. An island
    with no rhythm to keep (the rhythm island itself, or no rhythm) spreads its fragments over H as the schedule
    does: after it was the aiming island (an aim, a follow or a hold moves boundaries, and fragments held until the
    rhythm island's push release together), its fragments could be bunched on one step, each island then pushing
    every fragment at once, the others' aims too (two islands of one speed swapping roles bunched all four)."""
    want = offset(fragment, h, fragments)
    behind = (step + h - want) % h   # steps the plain next boundary (step + h) lies past the fragment's phase
    k = behind if behind <= h // 2 else behind - h
    most = max(1, int(RESPREAD_SHARE * h))
    return max(-most, min(most, k))


def aim_after(push_step: int, eta_s: float, period_s: float, rate: float, lo: int, hi: int) -> Optional[int]:
    """The step of a fragment's next boundary after its push at `push_step`, aimed at the rhythm island's push of
    the fragment that the push's PUSH_REPLY named (due `eta_s` after the push arrived, every `period_s`): ``aim``
    from the push; None when nothing is known."""
    steps = aim(eta_s, period_s, rate, lo, hi)
    return None if steps is None else int(push_step) + steps


def reply_aims(aims: dict, pushes: dict, aimed: dict, rate: float, lo: int, hi: int, step: int) -> dict:
    """{fragment: the step of its next boundary} from the PUSH_REPLYs' rhythm (``aims``: {fragment: (base_version,
    eta_s, period_s)}) for the pushes at the syncer (``pushes``: {fragment: (base_version, push step)}) that none
    aimed yet (``aimed``: {fragment: (base_version, push step)}, updated), each [lo, hi] steps after its push (a
    pinned H: at least N, never more often than the user asked); boundaries not after ``step`` + 1 are left
    alone."""
    out = {}
    for f, (base_version, eta, period) in aims.items():
        push = pushes.get(f)
        if push is None or push[0] != base_version or aimed.get(f) == push:
            continue
        aimed[f] = push
        at = aim_after(push[1], eta, period, rate, lo, hi)
        if at is not None and at > step + 1:
            out[f] = at
    return out


def follow(opened: dict, cadence: "Cadence", step: int, lo: int, period_s: float) -> dict:
    """{fragment: step + 1} for the fragments whose round the rhythm island's push opened (``opened``: {fragment:
    seconds ago}, island/link/syncer.SyncerLink.opened) within half its period, when this island's next boundary
    of the fragment is at most H / 2 steps away and at least ``lo`` steps after its previous one: the boundary
    comes at once, so the push lands in that round instead of on a prediction made a period ago (the rhythm
    island's step times swing by a third on a loaded machine: an aim alone missed 1 round in 3)."""
    out = {}
    for f, age in opened.items():
        if not 0 <= f < cadence.fragments or age > period_s / 2:
            continue
        nxt, last = cadence.next[f], cadence.last[f]
        if step + 1 < nxt <= step + max(1, cadence.h // 2) and (last is None or step + 1 - last >= lo):
            out[f] = step + 1
    return out


def hold(due, opened: dict, held: dict, limit: int) -> list:
    """The fragments of ``due`` (due now, aimed at the rhythm island's push) whose boundary waits a step more: that
    push has not opened their round yet (not in ``opened``) and they have waited fewer than ``limit`` steps
    (``held``: {fragment: steps waited}, updated; a fragment that pushes is forgotten). The island trains on
    meanwhile; its push then follows the rhythm island's instead of opening a round that closes after its own
    short patience."""
    out = []
    for f in due:
        if f not in opened and held.get(f, 0) < limit:
            held[f] = held.get(f, 0) + 1
            out.append(f)
        else:
            held.pop(f, None)
    return out


def catch_up(late_s: float, step_s: Optional[float], h: int, tau: int = 0) -> int:
    """Steps to bring a fragment's next boundary forward by when its push came `late_s` seconds after its round
    merged: those seconds, plus tau steps (a round waits at most the patience of the islands that opened it, tau
    steps of theirs: landing that much earlier puts the push near the round's first one rather than at its
    close); at most H / 2 at a time; 0 when nothing is known."""
    if late_s <= 0 or not step_s:
        return 0
    return min(max(1, h // 2), int(late_s / step_s) + max(1, int(tau)))
