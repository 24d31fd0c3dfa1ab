"""The adaptive grace window: how long a round waits for the rest once its quorum answered (no ``--grace``).

The syncer keeps, per island, the offsets (seconds) of its recent pushes from the first push of their round (pushes
that arrived after their round merged included), and per fragment the periods between its rounds' first pushes.
When the quorum of a round has answered and islands that are up are still missing, the round waits for a missing
island only if it **usually arrives within the window**:

* ``predicted(i)``: the ``QUANTILE`` of island i's last ``HISTORY`` offsets (None before ``MIN_SAMPLES``: a
  newcomer, or a restarted island's first pushes);
* the window's **bound**: the smallest ``patience`` among the round's answered pushes (the seconds after sending
  until that island blocks for its answer: tau steps of its step time; a push of tau = 0 says none) and
  ``PERIOD_SHARE`` of the fragment's median round period, whichever are known; ``FIRST_BOUND_S`` when neither is;
  never more than ``--round-timeout``. Waiting longer would stall the islands that answered first, so a round
  never holds the fastest islands at their tau bound;
* the round waits until ``t_first + min(bound, predicted(i) * MARGIN + SLACK_S)`` for each missing island whose
  prediction is within the bound (a newcomer: until the bound); islands predicted beyond the bound ("always late") are not
  waited for: their pushes are carried into the next round (``--max-base-lag``, ``--late-factor``);
* an island that is down is never in the expected set (syncer/rounds/roster.py), so it is never waited for; one that is
  up but had not pushed when its round merged gets an infinite offset (``missed``), so an island that stalls while
  staying connected stops being waited for after a few rounds.

Everything is a pure function of the recorded times and the clock the coordinator passes (tests use a fake one).
"""
from __future__ import annotations

import collections
import statistics
from typing import Iterable, Optional

__all__ = ["ArrivalBook", "HISTORY", "MIN_SAMPLES", "QUANTILE", "MARGIN", "SLACK_S", "PERIOD_SHARE",
           "FIRST_BOUND_S"]

HISTORY = 16          # offsets kept per island, periods per fragment
MIN_SAMPLES = 3       # offsets before an island's arrivals are predicted
QUANTILE = 0.8        # an island "usually" arrives by this quantile of its offsets
MARGIN = 1.25         # x the prediction ...
SLACK_S = 0.05        # ... plus this: the wait for an island predicted within the bound
PERIOD_SHARE = 0.25   # the bound: at most this share of the fragment's median round period
FIRST_BOUND_S = 30.0  # the bound while no period and no patience is known (a run's first rounds)
KEPT_ROUNDS = 16      # first-push times kept per fragment (to place late pushes)


def _quantile(xs: list, q: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


class ArrivalBook:
    """Arrival offsets per island and round periods per fragment (owned by the coordinator, under its lock)."""

    def __init__(self):
        self.offsets: dict[str, collections.deque] = {}
        self.periods: dict[int, collections.deque] = {}
        self.firsts: dict[int, collections.OrderedDict] = {}   # fragment -> {version: its round's first push}

    # --------------------------------------------------------------------------------------------- record
    def round_opened(self, fragment: int, version: int, t_first: float) -> None:
        """The first answer of the round on ``version`` arrived at ``t_first``."""
        firsts = self.firsts.setdefault(fragment, collections.OrderedDict())
        prev = next(reversed(firsts.values()), None) if firsts else None
        if prev is not None and t_first > prev:
            self.periods.setdefault(fragment, collections.deque(maxlen=HISTORY)).append(t_first - prev)
        firsts[version] = t_first
        while len(firsts) > KEPT_ROUNDS:
            firsts.popitem(last=False)

    def arrived(self, island: str, fragment: int, base_version: int, t: float) -> None:
        """A push of ``island`` relative to ``base_version`` was accepted at ``t`` (answer or carried)."""
        t0 = self.firsts.get(fragment, {}).get(base_version)
        if t0 is not None:
            self.offsets.setdefault(island, collections.deque(maxlen=HISTORY)).append(max(0.0, t - t0))

    def missed(self, island: str) -> None:
        """``island`` was up but had not pushed when its round merged (a stalled or very late island): an offset
        later than any window, so an island that stops pushing while it stays connected is no longer waited for
        once most of its recent rounds went without it (its late pushes, if any, add their real offsets)."""
        self.offsets.setdefault(island, collections.deque(maxlen=HISTORY)).append(float("inf"))

    def forget(self, island: str) -> None:
        """A restarted island (new incarnation): its old arrivals say nothing about its new phase."""
        self.offsets.pop(island, None)

    # --------------------------------------------------------------------------------------------- read
    def predicted(self, island: str) -> Optional[float]:
        xs = self.offsets.get(island)
        if not xs or len(xs) < MIN_SAMPLES:
            return None
        return _quantile(list(xs), QUANTILE)

    def period(self, fragment: int) -> Optional[float]:
        ps = self.periods.get(fragment)
        return statistics.median(ps) if ps else None

    def bound(self, fragment: int, patience: Iterable[Optional[float]], timeout_s: float) -> float:
        """The most a round of ``fragment`` waits after its first push for islands that usually make it."""
        known = [p for p in patience if p is not None and p > 0]
        period = self.period(fragment)
        caps = ([min(known)] if known else []) + ([PERIOD_SHARE * period] if period else [])
        return min(timeout_s, min(caps) if caps else FIRST_BOUND_S)

    def deadline(self, fragment: int, t_first: float, missing: Iterable[str], patience: Iterable[Optional[float]],
                 timeout_s: float) -> tuple[float, list]:
        """(the clock time the round merges at the latest, the missing islands it waits for). With nobody worth
        waiting for the deadline is ``t_first`` (merge now)."""
        bound = self.bound(fragment, patience, timeout_s)
        wait, waited = 0.0, []
        for i in sorted(missing):
            p = self.predicted(i)
            if p is None:
                w = bound
            elif p > bound:
                continue   # usually later than the window: not waited for (its push is carried)
            else:
                w = min(bound, p * MARGIN + SLACK_S)
            waited.append(i)
            wait = max(wait, w)
        return t_first + wait, waited
