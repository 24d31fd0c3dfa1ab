"""When an open round merges: one decision per fragment from its round, the roster and the arrival book.

A round with at least one answer merges (docs/protocol.md, "Rounds"):

1. at once when every island the round expects (syncer/rounds/roster.py) answered, at least the floor did and enough
   islands have joined the run;
2. with at least the quorum answered (elastic rounds: the floor, the minimum quorum counting only islands that are
   up): at the end of the grace, which is ``--grace`` seconds after the quorum answered, or, without
   ``--grace``, the adaptive window (syncer/rounds/window.py), and at the latest ``--round-timeout`` after the first answer;
   an elastic run whose minimum quorum of islands has not joined yet waits for them until that timeout;
3. otherwise it waits for more answers, and past ``--round-timeout`` (then every minute) the log names who is
   missing, saying which of them are down.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Optional

from .window import ArrivalBook
from .roster import Roster
from .settings import RoundSettings

__all__ = ["Decision", "decide", "due_now", "next_deadline", "round_status", "pace", "WAIT_LOG_S"]

log = logging.getLogger("yeto.syncer")
WAIT_LOG_S = 60.0   # a round that waits below its quorum says so at most this often (after --round-timeout)
PACE_SPREAD = 4.0   # the pace is at most this x the median rate of the islands that are up
MAX_STATUS_ROUNDS = 64    # rounds listed in one HEARTBEAT
MAX_STATUS_IDS = 16       # island ids listed in one HEARTBEAT


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


# ------------------------------------------------------------------- what the coordinator asks (under its lock)
def due_now(rs: RoundSettings, roster: Roster, arrivals: ArrivalBook, frags, now: float) -> list:
    """Indices of the fragments whose open round merges now; rounds waiting below their quorum are logged."""
    out = []
    for f in frags:
        d = decide(rs, roster, arrivals, f, now)
        if d is None:
            continue
        if d.due(now):
            out.append(f.index)
        else:
            log_wait(rs, roster, f, d, now)
    return out


def next_deadline(rs: RoundSettings, roster: Roster, arrivals: ArrivalBook, frags, now: float) -> Optional[float]:
    ts = [d.at for d in (decide(rs, roster, arrivals, f, now) for f in frags) if d is not None and d.at is not None]
    return min(ts) if ts else None


def round_status(rs: RoundSettings, roster: Roster, arrivals: ArrivalBook, frags, island: str, now: float) -> dict:
    """What ``island`` may be waiting for (docs/protocol.md, "Membership"): the open rounds it answered
    ``[fragment, version, answered, quorum]`` (at most MAX_STATUS_ROUNDS), the islands they wait for (at most
    MAX_STATUS_IDS, "(down Ns)" marking those that are not up), after its FINAL the islands still training, and
    the fleet's pace."""
    rounds, missing = [], set()
    for f in frags:
        if island not in f.round.answered():
            continue
        d = decide(rs, roster, arrivals, f, now)
        if d is None:
            continue
        if len(rounds) < MAX_STATUS_ROUNDS:
            rounds.append([f.index, f.version, len(f.round.answered()), d.floor])
        missing.update(d.waits_for)
    out = {"rounds": rounds, "missing": roster.describe(sorted(missing)[:MAX_STATUS_IDS], now)}
    m = roster.members.get(island)
    if m is not None and m.finished:
        out["unfinished"] = roster.describe(sorted(i for i, x in roster.members.items() if not x.finished and
                                                   x.alive(now, rs.lease_s))[:MAX_STATUS_IDS], now)
    p = pace(roster, now)
    if p:
        out["pace"] = p
    return out


def pace(roster: Roster, now: float) -> float:
    """The fleet's pace (steps/s): the fastest compute rate among the islands that are up, at most PACE_SPREAD x
    their median (one island's claim cannot make the others push every step); 0 when none says its rate."""
    rates = [m.rate for m in roster.members.values() if m.rate > 0 and roster.is_up(m, now)]
    if not rates:
        return 0.0
    return min(max(rates), PACE_SPREAD * statistics.median(rates))
