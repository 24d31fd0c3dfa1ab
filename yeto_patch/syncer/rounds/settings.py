"""What the coordinator is built with: the merge settings (what changes merge results; kept in checkpoints) and the
round settings (who a round waits for and how long)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..model.outer import OuterOptimizer

__all__ = ["MergeSettings", "RoundSettings", "WEIGHTINGS", "default_min_quorum"]

WEIGHTINGS = ("equal", "steps", "tokens")


MIN_QUORUM = 2   # the elastic rounds' minimum quorum (fleets of 3 islands or more)


def default_min_quorum(islands: int) -> int:
    """The minimum quorum of elastic rounds (no ``--quorum``): 2 islands (1 for a fleet of one or two), or all that
    are up when fewer are. A round never waits for an island that is down; a larger quorum made the islands that
    answered first wait for slower ones, a smaller one split rounds into single pushes (docs/operations.md,
    "Rounds under failures")."""
    return 1 if int(islands) <= 2 else MIN_QUORUM


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
    pushes. ``grace_s`` None: the pace window (syncer/rounds/window.py); a number: that fixed grace."""
    islands: int = 1
    quorum: Optional[int] = None
    grace_s: Optional[float] = None
    timeout_s: float = 600.0
    lease_s: float = 60.0
    total_rounds: Optional[int] = None
    min_quorum: Optional[int] = None   # elastic rounds' minimum quorum (None: default_min_quorum; models compare)
    roster_wait_s: float = 300.0       # FINALs end a run whose roster is incomplete only this long after the first join

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
