"""Lock-step rounds: the H each island should pin so that a fixed roster keeps every island at its own pace.

With ``--quorum`` (the fixed roster, or an explicit quorum) every round of a fragment waits for its islands'
pushes, and each island waits at its tau bound for the round its push is in: the k-th pushes of a fragment share
round k, whatever the timing, so the run repeats bit for bit. Islands of different speeds that pinned one H then
train at the slowest one's pace (a TP2 island at 85 ms per step and a PP2 island at 52 alone: the PP2 island waits
39% of its time). Pinned in proportion to their speeds, every island's round takes about the same wall time: each
trains at its own pace and the rounds are still keyed by push count (H 10 on the TP2 island and 20 on the PP2 one,
which share two cores and slow each other: the PP2 island at 107 ms per step, 106 under the elastic defaults;
docs/operations.md, "Reproducible rounds across speeds"; docs/convergence.md, "Lock-step rounds").

The syncer says that H once per island, a minute into its waiting, from the compute rates and H the islands'
heartbeats say (a rough figure: the rates swing under load, and islands that share a machine slow each other):
``suggest`` is the rule (pure), ``Advice`` what has been said (one per coordinator; the elastic defaults stretch a
pinned H by timing instead, schedule.stretch, and need no advice).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import NamedTuple

__all__ = ["Pace", "Hint", "suggest", "Advice", "WAIT_SHARE", "MAX_SAID", "SETTLE_S"]

WAIT_SHARE = 0.1   # advise an island that waits at least this share of its time for the slowest one's rounds
MAX_SAID = 64      # islands advised at most (a bounded record, whatever the roster)
SETTLE_S = 60.0    # ... once it has waited so for this long
SEEN = 256         # suggestions kept per island over its streak (their median is said)


class Pace(NamedTuple):
    """An island's pinned H and compute rate, as its heartbeats said them."""
    island: str
    sync_every: int
    rate: float


@dataclass(frozen=True)
class Hint:
    island: str
    sync_every: int      # the H it pinned
    rate: float          # its compute rate (steps/s)
    suggested: int       # the H that makes its round take the slowest round's wall time
    wait_share: float    # the share of its time it waits for the slowest round now
    slowest: str         # the island whose rounds take longest
    slowest_every: int
    slowest_rate: float


def suggest(islands: list) -> list:
    """``islands``: the Pace of each island up and training that said both (H >= 1, rate > 0). The slowest round is
    the largest ``H / rate``; each island whose round is at least WAIT_SHARE shorter gets a Hint with
    ``round(slowest period x rate)`` (at least its H: a pinned H is never lowered). Fewer than two islands: none."""
    if len(islands) < 2:
        return []
    slow = max(islands, key=lambda x: (x.sync_every / x.rate, x.island))
    period = slow.sync_every / slow.rate
    out = []
    for x in islands:
        wait = 1.0 - (x.sync_every / x.rate) / period
        if x.island == slow.island or wait < WAIT_SHARE:
            continue
        out.append(Hint(x.island, x.sync_every, x.rate, max(x.sync_every, int(round(period * x.rate))), wait,
                        slow.island, slow.sync_every, slow.rate))
    return out


@dataclass
class Streak:
    """An island's current stretch of waiting: when it began, its latest hint, the H suggested over it."""
    since: float
    last: float
    seen: collections.deque = field(default_factory=lambda: collections.deque(maxlen=SEEN))

    def median(self) -> int:
        seen = sorted(self.seen)
        return seen[len(seen) // 2]


class Advice:
    """What the syncer said about lock-step H: each island hears it once, after it has been waiting for the slowest
    island's rounds for SETTLE_S (a gap of at most SETTLE_S / 4 without a hint keeps the streak), with the median of
    the H suggested meanwhile. Rates swing by a third and more on a loaded machine and in a run's first steps: two
    Megatron-LM islands on two cores, advised at once, were told H 19 for one and H 12 for the other within two
    seconds."""
    __slots__ = ("settle_s", "_said", "_streaks")

    def __init__(self, settle_s: float = SETTLE_S):
        self.settle_s = float(settle_s)
        self._said: set[str] = set()                # islands advised
        self._streaks: dict[str, Streak] = {}       # island -> its streak of hints, not advised yet

    def __len__(self) -> int:
        return len(self._said)

    def new(self, hints: list, now: float) -> list:
        """The hints to say now (each island once, for at most MAX_SAID islands): ``hints`` is this moment's
        ``suggest``; a hint comes out with the median of its island's suggestions once its streak is SETTLE_S old."""
        for island in [i for i, st in self._streaks.items() if now - st.last > self.settle_s / 4]:
            del self._streaks[island]   # (its streak broke: it kept the others' pace for a while)
        out = []
        for h in hints:
            if h.island in self._said:
                continue
            st = self._streaks.get(h.island)
            if st is None:
                if len(self._said) + len(self._streaks) >= MAX_SAID:
                    continue
                st = self._streaks[h.island] = Streak(now, now)
            st.last = now
            st.seen.append(h.suggested)
            if now - st.since >= self.settle_s:
                del self._streaks[h.island]
                self._said.add(h.island)
                out.append(replace(h, suggested=st.median()))
        return out
