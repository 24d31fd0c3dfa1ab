"""When an open round merges: one decision per fragment from its round, the roster and the arrival book.

A round with at least one answer merges (docs/protocol.md, "Rounds"):

1. at once when every island the round expects (syncer/roster.py) answered, at least the floor did and enough
   islands have joined the run;
2. with at least the quorum answered (elastic rounds: the floor, the minimum quorum counting only islands that are
   up): at the end of the grace, which is ``--grace`` seconds after the quorum answered, or, without
   ``--grace``, the adaptive window (syncer/grace.py), and at the latest ``--round-timeout`` after the first answer;
   an elastic run whose minimum quorum of islands has not joined yet waits for them until that timeout;
3. otherwise it waits for more answers, and past ``--round-timeout`` (then every minute) the log names who is
   missing, saying which of them are down.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from .grace import ArrivalBook
from .roster import Roster
from .settings import RoundSettings

__all__ = ["Decision", "decide", "WAIT_LOG_S"]

log = logging.getLogger("yeto.syncer")
WAIT_LOG_S = 60.0   # a round that waits below its quorum says so at most this often (after --round-timeout)


@dataclass
class Decision:
    at: Optional[float]                          # clock time the round merges by time alone (None: only events)
    waits_for: list = field(default_factory=list)  # missing islands it waits for
    floor: int = 1
    why: str = ""

    def due(self, now: float) -> bool:
        return self.at is not None and now >= self.at


def decide(rs: RoundSettings, roster: Roster, arrivals: ArrivalBook, f, now: float) -> Optional[Decision]:
    """(the coordinator's lock held) The decision for fragment ``f``'s open round; None when it has nothing to
    merge (closed, merging, or no answer yet)."""
    r = f.round
    answered = r.answered()
    if f.closed or r.closed or not answered:
        return None
    exp = roster.expected(f.index, now)
    floor = roster.floor(f.index, now)
    joined = roster.joined_enough()
    if exp <= answered and joined and len(answered) >= floor:
        return Decision(now, [], floor, "every island it expects answered")
    need = floor if rs.elastic else rs.k
    missing = (exp if rs.elastic else roster.counted(f.index)) - answered
    if len(answered) < need:
        return Decision(None, sorted(missing), need, "below its quorum")
    timeout_at = r.t_first + rs.timeout_s
    if not joined:   # (elastic: fewer than the minimum quorum of islands joined the run so far)
        return Decision(timeout_at, sorted(missing), need, "islands of the run have not joined yet")
    if r.t_quorum is None:
        r.t_quorum = now
    if rs.adaptive:
        patience = [c.push.patience for c in r.contribs.values() if c.folded]
        at, waits = arrivals.deadline(f.index, r.t_first, exp - answered, patience, rs.timeout_s)
        return Decision(min(at, timeout_at), waits, need, "the adaptive grace window")
    return Decision(min(r.t_quorum + rs.grace_s, timeout_at), sorted(exp - answered), need, "--grace")


def log_wait(rs: RoundSettings, roster: Roster, f, d: Decision, now: float) -> None:
    """Past --round-timeout below the quorum: say (then every WAIT_LOG_S) who the round waits for."""
    r = f.round
    if d.at is not None or now < r.t_first + rs.timeout_s or now < r.next_wait_log:
        return
    r.next_wait_log = now + WAIT_LOG_S
    answered = sorted(r.answered())
    log.warning("fragment %d round on v%d waits: %d of quorum %d answered (%s); missing %s", f.index, f.version,
                len(answered), d.floor, ", ".join(answered), ", ".join(roster.describe(d.waits_for, now)) or "none")
