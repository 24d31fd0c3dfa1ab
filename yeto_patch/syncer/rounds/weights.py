"""Merge weights nobody can inflate (``--weights steps`` and ``tokens``, the default).

A push's weight is computed from what the syncer can check, and bounded relative to the other islands':

* **steps**: what the push reports, at most the growth of the island's ``local_step`` since its previous merged
  push of that fragment by the same process (incarnation); islands count the steps since their previous push of
  the fragment, so honest pushes meet this exactly;
* **tokens per step**: fixed per island process by its first merged push that reports steps and tokens (tokens /
  steps; until then the push's own ratio); an island that reports no tokens (a loop without Megatron's
  train_step) takes the median of the islands that do, 1 when none does; a later push's own token count is not
  read;
* the weight (``steps`` x tokens per step, or ``steps``) is then capped at ``MAX_RATIO`` times the **reference**:
  the **low median**, over the other islands, of each one's median checked weight of its last ``KEPT`` merged
  pushes (any fragment). The low median of the others is an honest island's as long as the colluding ids are
  fewer than half of the others (docs/protocol.md, "Security"), so their claims cannot raise the reference that
  caps them (a median of an even count averaged an honest value with a sybil's). The record keeps the checked
  weights, not the capped ones: an honest island whose weight grows (its first push of few steps, H at the fleet's
  pace) is not held back for merges while a capped record catches up, and each syncer shard, which records only its
  own fragments, weighs exactly as one syncer does when no cap binds. An island process's first merged push of a
  fragment is not recorded: it covers only the steps to the fragment's first boundary, fewer than H when fragments
  take turns (two Megatron-LM islands, H 10 and 16, F 4: a's first push of 2 steps capped b's first of 8 at 4
  steps' weight, or not, as the fragments' first merges happened to come; a fixed roster's run then did not repeat
  bit for bit). Honest fleets stay below the cap: islands that push at the fleet's rhythm
  (``YETO_DILOCO_SYNC_EVERY=auto``) weigh in proportion to their speed, and the fastest of the benchmark fleet
  (speeds 1 to 0.35) weighs 1.4x the others' median; only a fleet of two islands more than 2x apart in speed has
  its faster island capped. With no other island on record yet (a run's first rounds), the push is held in its
  encoded form and weighed at merge time against the low median of the round's other pushes' claims
(``cap_in_round``).

Only merged pushes go on record, so the book is part of the committed state: checkpoints hold it (``state`` /
``load``) and a resumed syncer weighs the next pushes exactly as the uninterrupted run would.

So an authenticated island that claims 10^12 tokens (or steps) weighs at most ``MAX_RATIO`` times the others' low
median in every round, on time and carried together (rounds/round.py): with N islands its share of a round is at
most MAX_RATIO / (MAX_RATIO + N - 1). A push whose checked steps are 0 weighs 0: it is accepted (its island is
warned once, ``zero_steps``) but does not count towards a round's floor.
"""
from __future__ import annotations

import collections
import logging
from typing import Optional

from .pushes import ReceivedPush

__all__ = ["WeightBook", "MAX_RATIO", "KEPT", "low_median"]

log = logging.getLogger("yeto.syncer")

MAX_RATIO = 2.0   # a push weighs at most this x the other islands' median weight
KEPT = 8          # recent weights kept per island (the reference)


def low_median(xs: list) -> float:
    """The lower of the two middle values (the middle one of an odd count): fewer than half of ``xs`` cannot raise
    it above every other value."""
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


class WeightBook:
    """Per island: its tokens per step (per incarnation), its pushes' local steps, its recent raw weights. The
    coordinator calls it under its lock."""

    def __init__(self, mode: str):
        self.mode = mode
        self.tps: dict[str, tuple[str, float]] = {}            # island -> (incarnation, tokens per step)
        self.last_step: dict[tuple, tuple[str, int]] = {}      # (island, fragment) -> (incarnation, local_step)
        self.recent: dict[str, collections.deque] = {}         # island -> its recent checked weights
        self.told_zero: set = set()                             # (island, incarnation) warned of pushes of no steps

    # ------------------------------------------------------------------------------------------ checks
    def steps(self, p: ReceivedPush) -> int:
        """The push's steps, at most its local step's growth since this process's previous push of the fragment."""
        steps = int(p.steps)
        if not p.local_step:   # (an island that does not count its steps: only the cap bounds it)
            return steps
        prev = self.last_step.get((p.island, p.fragment))
        if prev is not None and prev[0] == p.incarnation:
            steps = min(steps, max(0, int(p.local_step) - prev[1]))
        return min(steps, int(p.local_step))

    def tokens_per_step(self, p: ReceivedPush) -> float:
        have = self.tps.get(p.island)
        if have is not None and have[0] == p.incarnation:
            return have[1]
        if p.steps > 0 and p.tokens > 0:
            return float(p.tokens) / float(p.steps)
        known = [v for i, (_, v) in self.tps.items() if i != p.island]
        return _median(known) if known else 1.0

    def claimed(self, p: ReceivedPush) -> float:
        """The push's weight from its checked fields, before the cap."""
        if self.mode == "equal":
            return 1.0
        steps = self.steps(p)
        return float(steps) if self.mode == "steps" else float(steps) * self.tokens_per_step(p)

    # ------------------------------------------------------------------------------------------ cap
    def reference(self, island: str) -> Optional[float]:
        """The low median, over the other islands on record, of each one's median recent checked weight (None:
        nobody)."""
        per = [_median(ws) for i, ws in self.recent.items() if i != island and ws]
        return low_median(per) if per else None

    def cap(self, island: str, others: list) -> Optional[float]:
        """The most ``island`` may weigh in one merge (on time and carried together): MAX_RATIO x the reference, or
        before anyone is on record x the low median of ``others`` (the merge's other weights); None: no bound."""
        if self.mode == "equal":
            return MAX_RATIO   # (every push weighs 1)
        ref = self.reference(island)
        if ref is None and others:
            ref = low_median(others)
        return None if ref is None else MAX_RATIO * ref

    def weight(self, p: ReceivedPush) -> tuple[float, float, bool]:
        """(weight, claimed weight, held): ``held`` when nobody else is on record yet: weigh it at merge time."""
        raw = self.claimed(p)
        if raw <= 0 and self.mode != "equal":
            self._zero_steps(p)
        if self.mode == "equal":
            return raw, raw, False
        ref = self.reference(p.island)
        if ref is None:
            return raw, raw, True
        return min(raw, MAX_RATIO * ref), raw, False

    def _zero_steps(self, p: ReceivedPush) -> None:
        """Say once per island process that its pushes carry no new steps (they weigh nothing)."""
        key = (p.island, p.incarnation)
        if key not in self.told_zero and len(self.told_zero) < 4096:
            self.told_zero.add(key)
            log.warning("island %s pushed fragment %s with no new steps (steps=%s, local_step=%s): its pushes weigh "
                        "nothing until they count steps (a loop without Megatron's train_step must report them; "
                        "said once per island process)", p.island, p.fragment, p.steps, p.local_step)

    def merged(self, p: ReceivedPush, raw: float) -> None:
        """A push was merged: its local step, its tokens per step (the island process's first) and its checked
        weight ``raw`` (before the cap) go on record; the weight not for the process's first merged push of the
        fragment (see the module docstring: it covers the steps to the fragment's first boundary only)."""
        prev = self.last_step.get((p.island, p.fragment))
        first = prev is None or prev[0] != p.incarnation
        self.last_step[(p.island, p.fragment)] = (p.incarnation, int(p.local_step))
        have = self.tps.get(p.island)
        if (have is None or have[0] != p.incarnation) and p.steps > 0 and p.tokens > 0:
            self.tps[p.island] = (p.incarnation, float(p.tokens) / float(p.steps))
        if self.mode != "equal" and not first:
            self.recent.setdefault(p.island, collections.deque(maxlen=KEPT)).append(raw)

    # ------------------------------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        return {"tps": {i: [inc, v] for i, (inc, v) in self.tps.items()},
                "last_step": [[i, f, inc, s] for (i, f), (inc, s) in self.last_step.items()],
                "recent": {i: list(ws) for i, ws in self.recent.items()}}

    def load(self, st) -> None:
        """The book of a checkpoint (entries that are not well-formed, bounded numbers are skipped)."""
        if not isinstance(st, dict):
            return
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 2.0 ** 90  # noqa: E731
        for i, e in (st.get("tps") or {}).items():
            if isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and num(e[1]):
                self.tps[str(i)] = (e[0], float(e[1]))
        for e in st.get("last_step") or []:
            if isinstance(e, list) and len(e) == 4 and isinstance(e[2], str) and isinstance(e[1], int) \
                    and isinstance(e[3], int) and 0 <= e[3] < 2 ** 63:
                self.last_step[(str(e[0]), e[1])] = (e[2], e[3])
        for i, ws in (st.get("recent") or {}).items():
            if isinstance(ws, list):
                self.recent[str(i)] = collections.deque((float(w) for w in ws if num(w)), maxlen=KEPT)

    @staticmethod
    def cap_in_round(raw: float, others: list) -> float:
        """A held push's weight at merge time: at most MAX_RATIO x the low median of the round's other claims."""
        return min(raw, MAX_RATIO * low_median(others)) if others else raw


def _median(ws) -> float:
    s = sorted(ws)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
