"""Islands of the run: a member's lease and counters, and its ledger entry in checkpoints."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Member", "ledger_entry", "member_from_ledger"]


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

    def alive(self, now: float, lease: float) -> bool:
        return now - self.last_seen <= lease

    def credit(self, steps: int, tokens: int) -> None:
        """A merged push of this island: its counters."""
        self.pushes += 1
        self.steps += int(steps or 0)
        self.tokens += int(tokens or 0)


def ledger_entry(m: Member) -> dict:
    return {"incarnation": m.incarnation, "pushes": m.pushes, "steps": m.steps, "tokens": m.tokens,
            "last_step": m.last_step, "finished": m.finished, "final_fragments": sorted(m.final_fragments)}


def member_from_ledger(island: str, e: dict, now: float, fragments: int) -> Member:
    """A member of a resumed run from its checkpoint ledger entry (expected again for one lease)."""
    return Member(island, e.get("incarnation", ""), last_seen=now, finished=bool(e.get("finished", False)),
                  final_fragments={int(x) for x in e.get("final_fragments", [])},
                  last_step=int(e.get("last_step", 0)), pushes=int(e.get("pushes", 0)),
                  steps=int(e.get("steps", 0)), tokens=int(e.get("tokens", 0)))
