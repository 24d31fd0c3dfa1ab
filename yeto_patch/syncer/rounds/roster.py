"""Who a round of the syncer waits for: the islands of the run (joined, alive, up, finished) and the rules that
turn them into the set a round expects and the fewest answers it may merge with.

Three kinds of rounds (``RoundSettings``):

* **fixed roster** (``--quorum`` = ``--islands``): every island that joined and has not finished counts, down or
  not: the others wait for one that crashed until it is back (bit-reproducible runs);
* **explicit quorum** K below ``--islands``: at least K answers, waiting for the members alive by lease;
* **elastic** (no ``--quorum``, the default): a round waits only for islands that are **up** (connected, or
  within one heartbeat period of losing their link, and alive by lease) and merges once the minimum quorum
  (``default_min_quorum``, or all of them when fewer are up) answered; an island that is down (process dead,
  link gone, lease expired) is never waited for.

Thread-safety: the :class:`~.rounds.Coordinator` calls every method under its lock.
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional

from ..model.limits import stateless_members
from . import lockstep
from .members import Member
from .pushes import PushRefused
from .settings import RoundSettings

__all__ = ["Roster", "PACE_SPREAD"]

PACE_SPREAD = 4.0   # the pace is at most this x the median rate of the islands that are up
STRETCH_SPREAD = 3.0   # a pinned H's rhythm: islands at most this much slower than the fastest (schedule.MAX_STRETCH)
KEEPER_MARGIN = 0.15   # the rhythm island stays the rhythm until another is this much slower (rates are noisy)


class Roster:
    def __init__(self, rs: RoundSettings, clock: Callable[[], float], heartbeat_s: Optional[float] = None):
        self.rs = rs
        self.clock = clock
        self.heartbeat_s = heartbeat_s   # (None: lease / 4, as the server's default)
        self.members: dict[str, Member] = {}
        self.first_join: Optional[float] = None   # when the first island joined (the roster's wait runs from it)
        self.keeper: Optional[str] = None         # the island the fleet keeps its rhythm with (``rhythm``)

    # ------------------------------------------------------------------------------------------ changes
    def join(self, island: str, incarnation: str) -> Member:
        now = self.clock()
        m = self.members.get(island)
        alive = [i for i, mm in self.members.items() if mm.alive(now, self.rs.lease_s) and i != island]
        if m is None and len(alive) >= self.rs.islands:
            raise PushRefused("too-many-islands", f"this run expects {self.rs.islands} island(s) and already has "
                                                  f"{sorted(alive)}; refusing island {island!r}")
        if self.first_join is None:
            self.first_join = now
        if m is None:
            m = self.members[island] = Member(island, incarnation, now)
        else:
            if m.incarnation != incarnation:   # a restarted island: a new process takes part again
                m.finished = False
                m.final_fragments = set()
            m.incarnation = incarnation
            m.last_seen = now
        m.connected += 1
        m.link_lost = None
        return m

    def touch(self, island: str) -> None:
        m = self.members.get(island)
        if m is not None:
            m.last_seen = self.clock()

    def disconnected(self, island: str, bye: bool) -> None:
        m = self.members.get(island)
        if m is None:
            return
        m.connected = max(0, m.connected - 1)
        if not m.connected:
            m.link_lost = self.clock()
            if bye:
                m.last_seen = -float("inf")  # leaves the expected set now

    def finish(self, island: str, last_step: int) -> None:
        m = self.members.get(island)
        if m is not None:
            m.finished = True
            m.last_step = max(m.last_step, int(last_step))

    def prune(self, busy: set) -> None:
        """Forget ledger entries that carry no state (see limits.stateless_members)."""
        for i in stateless_members(self.members, busy, self.clock(), self.rs.lease_s):
            del self.members[i]

    # ------------------------------------------------------------------------------------------ views
    def alive(self, now: Optional[float] = None) -> list[str]:
        now = self.clock() if now is None else now
        return sorted(i for i, m in self.members.items() if m.alive(now, self.rs.lease_s))

    def is_up(self, m: Member, now: float) -> bool:
        """Alive by lease and connected, or its link lost less than a heartbeat period ago (a reconnect after a
        cut link takes a second); a member restored from a checkpoint counts as up for its first lease."""
        if not m.alive(now, self.rs.lease_s):
            return False
        hb = self.heartbeat_s if self.heartbeat_s is not None else self.rs.lease_s / 4
        return m.connected > 0 or m.link_lost is None or now - m.link_lost <= hb

    def _active(self, m: Member, fragment: int) -> bool:
        return not m.finished and fragment not in m.final_fragments

    def expected(self, fragment: int, now: float) -> set:
        """The islands a round of ``fragment`` waits for now (elastic: those up; else alive by lease)."""
        if self.rs.elastic:
            return {i for i, m in self.members.items() if self._active(m, fragment) and self.is_up(m, now)}
        return {i for i, m in self.members.items()
                if m.alive(now, self.rs.lease_s) and self._active(m, fragment)}

    def counted(self, fragment: int) -> set:
        """The islands that have joined and not finished ``fragment``, up or not (the fixed roster's)."""
        return {i for i, m in self.members.items() if self._active(m, fragment)}

    def floor(self, fragment: int, now: float) -> int:
        """The fewest answers a round of ``fragment`` may merge with. Fixed roster and explicit quorum: the quorum,
        or fewer once islands have finished (an island that crashed, lost its link or said BYE still counts, so a
        fixed roster waits for it). Elastic: the minimum quorum, or fewer when fewer islands are up (a round never
        waits for an island that is down); 1 while the islands keep a rhythm (``rhythm``) and no minimum quorum was
        given: their pushes land together by their aim, and a floor would only block the first in the transients
        (benchmarks/rounds_model.py: 0.85-0.96 of merges held every island with it, 0.1-0.3 with a floor of 2)."""
        pool = self.expected(fragment, now) if self.rs.elastic else self.counted(fragment)
        if self.rs.elastic and self.rs.min_quorum is None and self.rhythm(now) is not None:
            return 1
        return max(1, min(self.rs.k, len(pool)))

    def joined_enough(self) -> bool:
        """Whether at least the quorum of islands has joined this run so far. Until then "every member
        answered" does not close a round, so islands launched a little later than the first are not left behind.
        Islands that joined and then left still count."""
        return len(self.members) >= min(self.rs.k, self.rs.islands)

    def complete(self, now: float) -> bool:
        """Whether the run's roster is complete: every island of ``--islands`` joined, or ``roster_wait_s`` (the
        syncer's ``--init-wait``) passed since the first one joined without them."""
        return len(self.members) >= self.rs.islands or (
            self.first_join is not None and now - self.first_join >= self.rs.roster_wait_s)

    def all_finished(self) -> bool:
        """Whether FINALs end the run: every island alive by lease said FINAL, and the roster is complete (an island
        that finished before the others ever joined, alone or with a few, must not cut the run without them; an
        island that is down is not waited for)."""
        now = self.clock()
        alive = [m for m in self.members.values() if m.alive(now, self.rs.lease_s)]
        return bool(alive) and all(m.finished for m in alive) and self.joined_enough() and self.complete(now)

    def unfinished(self, now: float) -> list[str]:
        """Islands alive by lease that have not said FINAL."""
        return [i for i, m in self.members.items() if not m.finished and m.alive(now, self.rs.lease_s)]

    def pace(self, now: float) -> float:
        """The fleet's pace (steps/s): the fastest compute rate among the islands that are up, at most PACE_SPREAD x
        their median (one island's claim cannot make the others push every step); 0 when none says its rate."""
        rates = [m.rate for m in self.members.values() if m.rate > 0 and self.is_up(m, now)]
        if not rates:
            return 0.0
        return min(max(rates), PACE_SPREAD * statistics.median(rates))

    def rhythm(self, now: float) -> Optional[Member]:
        """The island whose rhythm the others keep (island/boundary/schedule.stretch, aim and follow): the slowest
        of the islands that are up and training (the previous one while it is at most KEEPER_MARGIN faster than it),
        when there are at least two, every one of them pinned H (``YETO_DILOCO_SYNC_EVERY=N``: ``auto`` islands
        follow the fleet's pace instead) and says its rate, and none is more than STRETCH_SPREAD slower than the
        fastest; else None (each island keeps its H; a fleet further apart shares rounds with ``auto``; 3x, not the
        weight cap's 2x: two Megatron-LM islands' speeds swung past 2x under load, and
        benchmarks/rounds_model.py's six islands 1 to 0.35 share 0.72 of merges at 3x, 0.05 at 2x); never with
        ``--quorum`` (a round that waits for its quorum whatever the timing needs no rhythm, and aimed boundaries
        can put two islands' fragments in different orders: each would wait at its tau bound for a round that
        waits for the other's next push, for ever). A claim of a slow rate thus stretches the others' H at most
        3x."""
        if not self.rs.elastic:
            return None
        up = [m for m in self.members.values() if not m.finished and self.is_up(m, now)]
        if len(up) < 2 or not all(m.pinned and m.rate > 0 for m in up):
            return None
        slow = min(up, key=lambda m: (m.rate, m.island))
        kept = next((m for m in up if m.island == self.keeper), None)
        if kept is not None and kept.rate <= slow.rate * (1.0 + KEEPER_MARGIN):
            slow = kept   # two islands of about one speed would swap roles with every noisy rate: each would aim at
            # the other's pushes in turn, and neither would keep a rhythm (Megatron-LM TP2 and PP2 at 9.0 and 8.9
            # steps/s shared 0.55 of their merges while both trained)
        self.keeper = slow.island
        return slow if slow.rate * STRETCH_SPREAD >= max(m.rate for m in up) else None

    def lockstep(self, now: float) -> list:
        """With ``--quorum`` (rounds keyed by push count: every island trains at the slowest round's pace), the
        lockstep.Hint of each island up and training that pinned an H its speed leaves waiting for the slowest
        island's rounds (none in elastic rounds, which stretch a pinned H by timing: ``rhythm``)."""
        if self.rs.elastic:
            return []
        up = [lockstep.Pace(m.island, m.sync_every, m.rate) for m in self.members.values()
              if not m.finished and self.is_up(m, now) and m.pinned and m.rate > 0 and m.sync_every]
        return lockstep.suggest(up)

    def describe(self, islands, now: float) -> list[str]:
        """``islands`` for a log line: each id, with "(down Ns)" for one that is not up."""
        out = []
        for i in sorted(islands):
            m = self.members.get(i)
            if m is None or self.is_up(m, now):
                out.append(i)
            else:
                since = m.link_lost if m.link_lost is not None else m.last_seen
                out.append(f"{i} (down {max(0.0, now - since):.0f}s)" if since > -float("inf") else f"{i} (left)")
        return out
