"""Islands of the run: a member's lease and counters, and its ledger entry in checkpoints.

Counters add up what islands report, so they saturate at int64 instead of growing without bound: whatever was
accepted, the ledger stays an int64 table a checkpoint can always hold, and a ledger read back from a checkpoint
(even one written before counters were bounded) is clamped the same way on ``--resume``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from ...wire.schema import INT64_MAX, bounded_int
from ...wire.values import Schedule

__all__ = ["Member", "ledger_entry", "member_from_ledger", "saturating_add"]

log = logging.getLogger("yeto.syncer")


def saturating_add(a: int, b: int) -> int:
    """``a + b`` clamped to ``[0, INT64_MAX]``."""
    return max(0, min(INT64_MAX, int(a) + int(b)))


@dataclass
class Member:
    island: str
    incarnation: str
    last_seen: float
    connected: int = 0
    finished: bool = False
    final_fragments: set = field(default_factory=set)
    last_step: int = 0
    pushes: int = 0
    steps: int = 0
    tokens: int = 0
    link_lost: Optional[float] = None   # when its last connection closed (None: connected, or restored)
    step: int = 0                       # its step as its heartbeats and pushes last said (bounded; for the pace)
    rate: float = 0.0                   # its compute rate, steps/s, as its heartbeats say (bounded; 0: unknown)
    step_at: Optional[float] = None     # when it said ``step``
    moved_at: Optional[float] = None    # when its step last grew (a connected island that stalls: not waited for)
    pinned: bool = False                # its heartbeats say it pinned H (YETO_DILOCO_SYNC_EVERY=N): it keeps a rhythm
    pushed_step: Optional[int] = None   # the boundary step of its latest push (largest step) ...
    pushed_at: Optional[float] = None   # ... and when that push arrived: its pushes' clock, lane delay included
    schedule: Optional[Schedule] = None   # its H and each fragment's next boundary step after ``step``, as its
    #                                       heartbeats last said them (bounded; None: not said)

    @property
    def sync_every(self) -> Optional[int]:
        return None if self.schedule is None else self.schedule.sync_every

    @property
    def next_boundaries(self) -> Optional[tuple]:
        return None if self.schedule is None else self.schedule.next_boundaries

    def alive(self, now: float, lease: float) -> bool:
        return now - self.last_seen <= lease

    def progress(self, step: Optional[int], rate: Optional[float], now: float, pinned: Optional[bool] = None,
                 schedule: Optional[Schedule] = None) -> None:
        """Its step (a bounded integer), compute rate (a bounded number) and whether it pinned H as a heartbeat or a
        push says them, and its schedule as a heartbeat says it with its step (bounded by wire/schema.read_island_beat);
        None: not said."""
        if schedule is not None and step is not None:
            self.schedule = schedule
        if pinned is not None:
            self.pinned = bool(pinned)
        if step is not None:
            if self.moved_at is None or step > self.step:
                self.moved_at = now
            self.step = step
            self.step_at = now
        if rate is not None:
            self.rate = float(rate)

    def pushed(self, local_step: int, rate: Optional[float], now: float, pinned: Optional[bool] = None) -> None:
        """A push made at its step ``local_step`` arrived now: the anchor its next pushes' arrivals are counted from
        (a push arrives a lane delay after its boundary: gathered, encoded and sent); its step, when that is newer
        than what it said (a push never moves its step back: its heartbeats may already have said a later one)."""
        if self.pushed_step is None or local_step >= self.pushed_step:
            self.pushed_step, self.pushed_at = int(local_step), now
        if self.step_at is None or local_step > self.step:
            self.progress(local_step, rate, now, pinned)
        else:
            self.progress(None, rate, now, pinned)

    def restarted(self) -> None:
        """A new process of this island (new incarnation): its old step and pace say nothing of it."""
        self.step, self.rate, self.step_at, self.moved_at = 0, 0.0, None, None
        self.pushed_step = self.pushed_at = None
        self.schedule = None

    def credit(self, steps: int, tokens: int) -> None:
        """A merged push of this island: its counters (saturating)."""
        self.pushes = saturating_add(self.pushes, 1)
        self.steps = saturating_add(self.steps, steps or 0)
        self.tokens = saturating_add(self.tokens, tokens or 0)


def ledger_entry(m: Member) -> dict:
    return {"incarnation": m.incarnation, "pushes": m.pushes, "steps": m.steps, "tokens": m.tokens,
            "last_step": m.last_step, "finished": m.finished, "final_fragments": sorted(m.final_fragments)}


def _count(island: str, e: dict, name: str) -> int:
    v = e.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            v = int(v)
        except (TypeError, ValueError, OverflowError):
            v = 0
    if not bounded_int(v):
        log.warning("checkpoint ledger: island %r has %s out of range (%d bits); clamped to [0, 2^63-1]",
                    island, name, v.bit_length())
        v = max(0, min(INT64_MAX, v))
    return v


def member_from_ledger(island: str, e: dict, now: float, fragments: int) -> Member:
    """A member of a resumed run from its checkpoint ledger entry (expected again for one lease)."""
    finals = set()
    for x in e.get("final_fragments", []):
        if bounded_int(x, fragments - 1):
            finals.add(int(x))
    return Member(island, str(e.get("incarnation", "")), last_seen=now, finished=bool(e.get("finished", False)),
                  final_fragments=finals, last_step=_count(island, e, "last_step"), pushes=_count(island, e, "pushes"),
                  steps=_count(island, e, "steps"), tokens=_count(island, e, "tokens"))
