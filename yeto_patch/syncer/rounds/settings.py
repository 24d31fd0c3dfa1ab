"""What the coordinator is configured with and what it is fed: merge and round settings, a push, a refusal.

Also the bounds on every number an island reports in a push (docs/protocol.md, "Pushes"): a peer is untrusted,
so a counter is an integer in a documented range, never an arbitrary-precision integer that could make a
ledger sum, a weight or a checkpoint unusable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..model.outer import OuterOptimizer

__all__ = ["MergeSettings", "RoundSettings", "PushRefused", "Push", "WEIGHTINGS", "INT64_MAX", "MAX_PUSH_STEPS",
           "MAX_PUSH_TOKENS", "MAX_PATIENCE_S", "bounded_int", "shown", "default_min_quorum"]

WEIGHTINGS = ("equal", "steps", "tokens")
INT64_MAX = (1 << 63) - 1
#: Largest ``steps`` one push may report (local optimizer steps since its anchor).
MAX_PUSH_STEPS = 1 << 31
#: Largest ``tokens`` one push may report: every weight is then an exact float64, and any round's total weight
#: (a few pushes per island) stays far below float32's range, so weights can never become infinite.
MAX_PUSH_TOKENS = 1 << 53
#: Largest ``patience`` (seconds until the island blocks waiting for the push's answer) a push may report; larger
#: or malformed values are read as "unknown".
MAX_PATIENCE_S = 1e6


MIN_QUORUM = 2   # the elastic rounds' minimum quorum (fleets of 3 islands or more)


def default_min_quorum(islands: int) -> int:
    """The minimum quorum of elastic rounds (no ``--quorum``): 2 islands (1 for a fleet of one or two), or all that
    are up when fewer are. A round never waits for an island that is down; a larger quorum made the islands that
    answered first wait for slower ones, a smaller one split rounds into single pushes (docs/operations.md,
    "Rounds under failures")."""
    return 1 if int(islands) <= 2 else MIN_QUORUM


def bounded_int(v, hi: int = INT64_MAX, lo: int = 0) -> bool:
    """Whether ``v`` is an integer (not a bool) in ``[lo, hi]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def shown(v, limit: int = 40) -> str:
    """A peer's value for a message: its repr, cut to ``limit`` characters (an integer of thousands of digits
    or a long string must not end up in replies and logs whole)."""
    if isinstance(v, int) and v.bit_length() > 128:
        return f"<an integer of {v.bit_length()} bits>"
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


@dataclass(frozen=True)
class MergeSettings:
    """Everything that changes merge results (stored in checkpoints; a resume must match)."""
    outer: str = "nesterov"
    lr: Union[float, str, None] = None   # a number, "auto" (outer.lr_for_steps) or None (the kind's default)
    momentum: Optional[float] = None
    delay: int = 1
    weights: str = "tokens"
    max_base_lag: int = 4
    late_factor: float = 0.5
    exact: bool = False

    def optimizer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer, self.lr, self.momentum, self.delay)

    def resolved(self) -> dict:
        o = self.optimizer()
        return {**o.config(), "weights": self.weights, "max_base_lag": self.max_base_lag,
                "late_factor": self.late_factor, "exact": self.exact}


@dataclass(frozen=True)
class RoundSettings:
    """``quorum`` None: elastic rounds (the default): a round merges with the islands that are up once the minimum
    quorum (``default_min_quorum``, or fewer when fewer are up) answered; ``quorum`` equal to ``islands``: the fixed
    roster (every island that joined and has not finished is waited for, down or not); between: at least that many
    pushes. ``grace_s`` None: the adaptive grace window (syncer/rounds/window.py); a number: that fixed grace."""
    islands: int = 1
    quorum: Optional[int] = None
    grace_s: Optional[float] = None
    timeout_s: float = 600.0
    lease_s: float = 60.0
    total_rounds: Optional[int] = None
    min_quorum: Optional[int] = None   # elastic rounds' minimum quorum (None: default_min_quorum; models compare)

    @property
    def elastic(self) -> bool:
        """No ``--quorum``: the minimum quorum counts only the islands that are up."""
        return self.quorum is None

    @property
    def fixed_roster(self) -> bool:
        return self.quorum is not None and self.quorum >= self.islands

    @property
    def k(self) -> int:
        """The (minimum) quorum: ``--quorum``, or the elastic default."""
        if self.quorum is not None:
            return self.quorum
        return self.min_quorum if self.min_quorum is not None else default_min_quorum(self.islands)

    @property
    def adaptive(self) -> bool:
        return self.grace_s is None


class PushRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Push:
    island: str
    fragment: int
    base_version: int
    codec: str
    block: int
    body: object  # bytes-like, encoded
    local_step: int = 0
    steps: int = 0
    tokens: int = 0
    final: bool = False
    incarnation: str = ""
    blend: bool = False   # the island blends merged bases in (tau > 0): the outer lr "auto" rule depends on it
    nbytes: int = 0
    patience: Optional[float] = None   # seconds from sending until the island blocks for the answer (None: unknown)
