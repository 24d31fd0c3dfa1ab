"""What the hooks call on an island's engine: the one contract between ``yeto_patch.hooks`` and the island.

``hooks/_runtime.py`` drives any object that implements it (``engine.Engine``, or a test's stand-in given to
``hooks._runtime.set_engine_factory``, which checks it at creation: a stand-in lacking a member fails there, not
halfway through a run)."""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable


@runtime_checkable
class IslandEngine(Protocol):
    started: bool     # joined the syncer (the first training step did it)
    finished: bool    # the final model is installed: the training loop stops
    boundary_log: Optional[object]   # island rank 0's boundary log once started (its records feed the figures)

    def set_resume(self, directory: Optional[str], iteration: Optional[int], weights: bool = False) -> None:
        """Megatron loaded `iteration` from `directory` before training (None, None: nothing loaded); `weights`:
        the model's weights came from it (with no sync state of this run beside it: a pretrained start)."""

    def on_train_step_start(self, iteration=None, train_iters=None, tokens=None, vocab_size=None) -> None:
        """Every train_step, before it runs (the first one starts the island)."""

    def before_optimizer_step(self, optimizer=None) -> None:
        """Before the outermost optimizer step's update (the step's plan is made here)."""

    def before_param_copy(self, optimizer) -> None:
        """Inside a counted step, before the leaf `optimizer` casts its FP32 masters into the params; never
        raises (a failure is raised after the step)."""

    def on_optimizer_step(self, update_successful: bool = True, tokens: Optional[int] = None) -> None:
        """Once per outermost optimizer step, after it (a skipped update counts with zero tokens)."""

    def save_sync_state(self, directory: str, iteration: int) -> None:
        """Megatron saved `iteration` into `directory`: the island's sync state goes beside it."""

    def close(self) -> None:
        """Stop talking to the syncer; idempotent."""


def members() -> list:
    """The contract's attributes and methods, by name."""
    return list(IslandEngine.__annotations__) + sorted(
        k for k, v in vars(IslandEngine).items() if callable(v) and not k.startswith("_"))


def missing(engine) -> list:
    """Members of the contract `engine` lacks (empty: it implements it)."""
    return [m for m in members() if not hasattr(engine, m)]
