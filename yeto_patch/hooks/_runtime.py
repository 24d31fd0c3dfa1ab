"""What the hook wrappers call: one ``Runtime`` per process between Megatron's calls and the boundary engine.

- Counts optimizer-step nesting per thread, so the boundary runs once per OUTERMOST optimizer step (a
  ChainedOptimizer's step, which may reach wrapped inner steps, fires once).
- Validates the configuration when the process first trains (first ``train_step`` or first outermost optimizer
  step) and raises ``ConfigError`` there on every rank; until then nothing is read, imported or connected.
- Creates the engine lazily (``yeto_patch.island.engine.Engine``) and keeps the first failure sticky: once the
  engine failed to start, every later step raises the same error rather than training on without DiLoCo.
- Hands the island's boundary figures to the launcher's own TensorBoard / W&B writers (``figures``: an
  ``island.figures.Relay``): the hook of a launcher passes ``writers`` (a function returning the writers it
  opened on this rank); the rank holding them writes rank 0's figures at its training steps.
- Tests replace the engine with ``set_engine_factory``.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

log = logging.getLogger("yeto_patch")

_factory: Optional[Callable[..., Any]] = None


def _default_factory(settings, **facts):
    from yeto_patch.island.engine import Engine  # torch/megatron-aware; imported only when training starts
    return Engine(settings, **facts)


def set_engine_factory(factory: Optional[Callable[..., Any]]) -> None:
    """Use ``factory(settings, optimizer=, model=)`` instead of the island engine (None restores it); resets
    the runtime. What it makes must implement ``yeto_patch.island.api.IslandEngine`` (checked when made)."""
    global _factory
    _factory = factory
    RUNTIME.reset()


@dataclass(frozen=True)
class Loaded:
    """What the launcher loaded before training: the checkpoint's directory and iteration (0: a fine-tune's or
    release checkpoint), and whether the model's weights came from it."""
    directory: str
    iteration: int
    weights: bool


class _Depth(threading.local):
    n = 0
    counting = False   # inside an outermost optimizer step that drives the engine


class Runtime:
    def __init__(self):
        self._depth = _Depth()
        self._lock = threading.RLock()
        self.reset()

    def reset(self):
        with self._lock:
            self._generation = getattr(self, "_generation", -1) + 1
            self._figures = None   # island.figures.Relay, made when the process first trains
            engine = getattr(self, "engine", None)
            self.engine = None
            self.error: Optional[BaseException] = None
            self.optimizer = None
            self.pending_tokens: Optional[int] = None
            self.in_train_step = False
            self._warned_foreign = False
            self.loaded: Optional[Loaded] = None   # the checkpoint Megatron loaded before training
            self.timeout_s = 30.0                 # YETO_DILOCO_TIMEOUT once read (bounds the last figures' drain)
        if engine is not None:
            try:
                engine.close()
            except Exception:  # pragma: no cover - best effort on reset
                log.exception("yeto-patch: closing the engine on reset failed")

    @property
    def figures(self):
        """The relay of the island's figures to the launcher's writers (``island.figures.Relay``)."""
        if self._figures is None:
            from yeto_patch.island.figures import Relay   # (imports torch: only once the process trains)
            self._figures = Relay(self._generation)
        return self._figures

    # ---------------------------------------------------------------------------------------- engine
    def _engine(self, optimizer=None, model=None):
        with self._lock:
            if self.error is not None:
                raise self.error
            if self.engine is None:
                try:
                    from yeto_patch import config
                    settings, bad = None, None
                    try:
                        settings = config.get()
                    except config.ConfigError as e:
                        bad = e
                    _agree_across_ranks(bad, settings)
                    self.timeout_s = float(settings.timeout)
                    if settings.disable:
                        return None
                    _setup_logging(settings.log_level)
                    self.engine = _checked((_factory or _default_factory)(settings, optimizer=optimizer,
                                                                           model=model))
                    self.optimizer = optimizer
                    if self.loaded is not None:
                        self._tell_engine()
                except BaseException as err:
                    self.error = err
                    raise
            return self.engine

    # ---------------------------------------------------------------------------------------- train_step
    def train_step_start(self, *, model, optimizer, iteration=None, train_iters=None, tokens=None,
                         vocab_size=None, writers=None):
        """`writers`: a function returning the TensorBoard / W&B writers the launcher opened on this rank (None
        entries for those it did not open), or None when the launcher has none."""
        if self.engine is None and self.error is None:
            self.figures.enabled = _figures_on()
        self.figures.see_writers(writers)   # before the island starts: its rank 0 then knows who writes
        engine = self._engine(optimizer=optimizer, model=model)
        if engine is None:
            return
        self.in_train_step = True
        self.pending_tokens = tokens
        engine.on_train_step_start(iteration=iteration, train_iters=train_iters, tokens=tokens,
                                   vocab_size=vocab_size)
        self.figures.attach(engine.boundary_log)   # (rank 0's; None elsewhere)
        self.figures.drain()

    def train_step_end(self) -> bool:
        """True when the run reached its final cut (the wrapper then tells Megatron to save and exit)."""
        self.in_train_step = False
        self.pending_tokens = None
        engine = self.engine
        finished = bool(engine is not None and engine.finished)
        if finished:   # rank 0's last figures, before the launcher saves, stops and closes its writers
            self.figures.drain(final=True, wait_s=min(30.0, self.timeout_s))
        return finished

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint_loaded(self, directory, iteration, weights: Optional[bool] = None) -> None:
        """Megatron loaded `iteration` from `directory` (before training): the engine restores its sync state.
        `weights`: the model's weights came from it (default: when `iteration` > 0); with iteration 0 that is a
        fine-tune's pretrained start."""
        weights = bool(iteration) or bool(weights)   # a resume always loads its weights
        if not (directory and weights):
            return   # a load that found nothing changes nothing (Bridge's provider may have loaded weights before)
        with self._lock:
            self.loaded = Loaded(str(directory), int(iteration or 0), weights)
            if self.engine is not None and not self.engine.started:
                self._tell_engine()

    def _tell_engine(self) -> None:
        """(under the lock, with something loaded) The engine learns what the launcher loaded before training."""
        got = self.loaded
        self.engine.set_resume(got.directory, got.iteration, weights=got.weights)

    def checkpoint_saved(self, directory, iteration) -> None:
        """Megatron saved `iteration` into `directory`: the engine writes its sync state beside it."""
        engine = self.engine
        if engine is not None:
            engine.save_sync_state(directory, iteration)

    # ---------------------------------------------------------------------------------------- optimizer
    def step_enter(self) -> bool:
        """Enter an optimizer step; True when it is the outermost one on this thread."""
        self._depth.n += 1
        return self._depth.n == 1

    def step_exit(self, counted: bool = False) -> None:
        self._depth.n -= 1
        if counted:
            self._depth.counting = False

    def before_param_copy(self, optimizer) -> None:
        """Inside a counted optimizer step, before a leaf optimizer casts its FP32 masters into the model params:
        the engine installs the bases planned for this step into that leaf's masters (it never raises here: a
        failure is raised on every rank after the step)."""
        engine = self.engine
        if engine is not None and getattr(self._depth, "counting", False):
            engine.before_param_copy(optimizer)

    def before_outer_step(self, optimizer) -> bool:
        """Before the outermost optimizer step: start the engine if no train_step did (optimizer-only loops).
        Returns whether this optimizer's steps count (False for a second, unrelated optimizer)."""
        engine = self._engine(optimizer=optimizer, model=None)
        if engine is None:
            return False
        if self.optimizer is None:
            self.optimizer = optimizer
        if self.optimizer is not optimizer:
            if not self._warned_foreign:
                self._warned_foreign = True
                log.warning("yeto-patch: a second optimizer (%s) stepped; only the first one (%s) drives DiLoCo "
                            "boundaries", type(optimizer).__name__, type(self.optimizer).__name__)
            return False
        engine.before_optimizer_step(optimizer)
        self._depth.counting = True
        return True

    def after_outer_step(self, optimizer, result) -> None:
        ok = update_successful(result)
        tokens = self.pending_tokens if ok else 0
        self.engine.on_optimizer_step(update_successful=ok, tokens=tokens)


def _checked(engine):
    """The engine, if it implements the contract the hooks drive (a stand-in lacking a member fails here)."""
    from yeto_patch.island import api
    lacking = api.missing(engine)
    if lacking:
        raise TypeError(f"yeto-patch: the engine {type(engine).__name__} does not implement "
                        f"yeto_patch.island.api.IslandEngine (missing {lacking})")
    return engine


def _agree_across_ranks(bad, settings) -> None:
    """Raise the first rank's configuration error on every rank of the job (through the launcher's store),
    so a wrong value on one node stops every rank at start-up instead of leaving the others waiting."""
    from yeto_patch import config
    from yeto_patch.island.start_agreement import agree
    msg = agree(None if bad is None else str(bad), timeout_s=settings.timeout if settings else 120.0)
    if msg is not None:
        raise config.ConfigError(msg) from bad


def _figures_on() -> bool:
    """YETO_DILOCO_FIGURES (a bad configuration is reported when the engine starts, not here)."""
    try:
        from yeto_patch import config
        s = config.get()
        return bool(s.figures and not s.disable)
    except Exception:  # noqa: BLE001
        return False


def update_successful(result) -> bool:
    """megatron-core's step returns (update_successful, grad_norm, num_zeros); a torch optimizer returns a loss."""
    if isinstance(result, bool):
        return result
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], bool):
        return result[0]
    return True


_logging_done = False


def _setup_logging(level: str) -> None:
    global _logging_done
    if _logging_done:
        return
    _logging_done = True
    log.setLevel(getattr(logging, level))
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s yeto-patch %(levelname)s %(message)s"))
        log.addHandler(h)
        log.propagate = False


RUNTIME = Runtime()
