"""Functions the shim tests run on every rank of a tests.mcore pool (real megatron-core objects on CPU)."""
from __future__ import annotations

import contextlib
import os

_ENV = {"YETO_DILOCO_SYNCER": "127.0.0.1:9", "YETO_DILOCO_INSECURE": "1"}


class Recorder:
    """Stands in for the boundary engine (the whole yeto_patch.island.api.IslandEngine contract): records what the
    hooks call, in order."""
    instances: list = []

    def __init__(self, settings, optimizer=None, model=None):
        self.settings, self.optimizer, self.model = settings, optimizer, model
        self.calls = []
        self.started = self.finished = False
        self.boundary_log = None
        self.saved, self.resume, self.weights = [], None, False
        Recorder.instances.append(self)

    def set_resume(self, directory, iteration, weights=False):
        self.resume, self.weights = (directory, iteration), weights

    def save_sync_state(self, directory, iteration):
        self.saved.append((directory, iteration))

    def on_train_step_start(self, **facts):
        self.calls.append(("train_step_start", facts.get("iteration")))

    def before_optimizer_step(self, optimizer):
        self.calls.append(("before_step", type(optimizer).__name__))

    def on_optimizer_step(self, update_successful, tokens):
        self.calls.append(("step", bool(update_successful), tokens))

    def before_param_copy(self, optimizer):
        self.calls.append(("param_copy", type(optimizer).__name__))

    def close(self):
        pass


@contextlib.contextmanager
def shim(env=None, factory=Recorder):
    """Hooks installed with `env` set and the engine replaced by `factory`; all undone afterwards."""
    from yeto_patch import config, hooks
    from yeto_patch.hooks import _runtime
    env = dict(_ENV if env is None else env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config.reset()
    Recorder.instances = []
    _runtime.set_engine_factory(factory)
    hooks.install()
    try:
        yield hooks
    finally:
        hooks.uninstall()
        _runtime.set_engine_factory(None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        config.reset()


def count_boundaries(cfg_kwargs: dict, steps: int) -> dict:
    """Train `steps` steps of a real layout under the hooks; report what the engine saw and what is wrapped."""
    from tests.mcore import harness
    with shim() as hooks:
        ctx = harness.build(harness.RunCfg(**cfg_kwargs))
        chain = [type(o).__name__ for o in harness.dist_optimizers(ctx["optimizer"])]
        losses = harness.train_steps(ctx, steps)
        for leaf in harness.dist_optimizers(ctx["optimizer"]):   # a cast outside any step: no install point
            if hasattr(leaf, "_copy_main_params_to_model_params"):
                leaf._copy_main_params_to_model_params()
        patched = hooks.patched()
        calls = list(Recorder.instances[0].calls) if Recorder.instances else []
        engines = len(Recorder.instances)
        same_opt = bool(Recorder.instances) and Recorder.instances[0].optimizer is ctx["optimizer"]
    return dict(calls=calls, engines=engines, outer=type(ctx["optimizer"]).__name__, chain=chain,
                patched=patched, losses=losses, same_optimizer=same_opt)


def bad_value_at_start(env: dict) -> str:
    """Build a real layout with a bad YETO_* value set, then take the first optimizer step: must raise."""
    from tests.mcore import harness
    from yeto_patch.hooks import _runtime
    with shim(env=env, factory=_runtime._default_factory):
        ctx = harness.build(harness.RunCfg(tp=2, bf16=True))
        try:
            harness.train_steps(ctx, 1)
        except Exception as err:  # the error every rank must see
            return f"{type(err).__name__}: {err}"
    return "no error"


def bad_value_on_one_rank(env: dict, bad: dict, bad_rank: int) -> str:
    """Only `bad_rank` has the bad values: every rank must still stop at its first step with that rank's error."""
    import torch.distributed as dist
    from tests.mcore import harness
    from yeto_patch.hooks import _runtime
    mine = {**env, **bad} if dist.get_rank() == bad_rank else env
    with shim(env=mine, factory=_runtime._default_factory):
        ctx = harness.build(harness.RunCfg(tp=2, bf16=True))
        try:
            harness.train_steps(ctx, 1)
        except Exception as err:
            return f"{type(err).__name__}: {err}"
    return "no error"
