"""What the coordinator is configured with and what it is fed: merge and round settings, a push, a refusal.

Also the bounds on every number an island reports in a push (docs/protocol.md, "Pushes"): a peer is untrusted,
so a counter is an integer in a documented range, never an arbitrary-precision integer that could make a
ledger sum, a weight or a checkpoint unusable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .outer import OuterOptimizer

__all__ = ["MergeSettings", "RoundSettings", "PushRefused", "Push", "WEIGHTINGS", "INT64_MAX", "MAX_PUSH_STEPS",
           "MAX_PUSH_TOKENS", "bounded_int", "shown"]

WEIGHTINGS = ("equal", "steps", "tokens")
INT64_MAX = (1 << 63) - 1
#: Largest ``steps`` one push may report (local optimizer steps since its anchor).
MAX_PUSH_STEPS = 1 << 31
#: Largest ``tokens`` one push may report: every weight is then an exact float64, and any round's total weight
#: (a few pushes per island) stays far below float32's range, so weights can never become infinite.
MAX_PUSH_TOKENS = 1 << 53


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
    weights: str = "equal"
    max_base_lag: int = 1
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
    islands: int = 1
    quorum: Optional[int] = None  # default: islands
    grace_s: float = 5.0
    timeout_s: float = 600.0
    lease_s: float = 60.0
    total_rounds: Optional[int] = None

    @property
    def k(self) -> int:
        return self.quorum if self.quorum is not None else self.islands


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
