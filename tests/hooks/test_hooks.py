"""Hook mechanics: idempotent wrap/unwrap, install/uninstall on real megatron modules, the re-entrancy rule, and
train_step's signature and return-tuple differences across Megatron releases."""
import functools
import sys
import types

import pytest
import wrapt

from yeto_patch import config, hooks
from yeto_patch.hooks import _runtime, _train_step, _wrap, bridge_train, mlm_training
from tests.shim.workers import Recorder, shim


# ------------------------------------------------------------------------------------------- _wrap
class Opt:
    def step(self):
        return (True, 1.0, 0)


def test_wrap_is_idempotent_and_undoable():
    original = vars(Opt)["step"]
    calls = []

    def w(wrapped, instance, args, kwargs):
        calls.append(instance)
        return wrapped(*args, **kwargs)

    assert _wrap.wrap(Opt, "step", w, "t") is True
    assert _wrap.wrap(Opt, "step", w, "t") is False          # second wrap: no second layer
    assert vars(Opt)["step"].__wrapped__ is original
    o = Opt()
    assert o.step() == (True, 1.0, 0) and calls == [o]
    assert _wrap.unwrap(Opt, "step") is True and vars(Opt)["step"] is original
    assert _wrap.unwrap(Opt, "step") is False
    assert Opt().step() == (True, 1.0, 0) and len(calls) == 1


def test_unwrap_under_a_foreign_wrapper_switches_ours_off():
    class O2:
        def step(self):
            return "stepped"
    calls = []
    _wrap.wrap(O2, "step", lambda w, i, a, k: calls.append(1) or w(*a, **k), "t")
    inner = O2.step  # what torch's profile hook does: wrap the class attribute again with functools.wraps

    @functools.wraps(inner)
    def profiled(*a, **k):
        return inner(*a, **k)
    O2.step = profiled
    assert _wrap.is_wrapped(O2, "step")
    assert _wrap.wrap(O2, "step", lambda *a: None, "t") is False   # found ours underneath: no new layer
    O2().step()
    assert calls == [1]
    assert _wrap.unwrap(O2, "step") is False and not _wrap.is_wrapped(O2, "step")
    assert O2().step() == "stepped" and calls == [1]                # ours calls straight through now
    _wrap.wrap(O2, "step", lambda w, i, a, k: calls.append(2) or w(*a, **k), "t")  # re-enables it
    O2().step()
    assert calls[-1] == 1 and len(calls) == 2


def test_inherited_methods_are_not_wrapped_on_subclasses():
    class Sub(Opt):
        pass
    assert _wrap.wrap(Sub, "step", lambda *a: None, "t") is False
    assert "step" not in vars(Sub)


# ------------------------------------------------------------------------------------------- real modules
@pytest.fixture
def clean_hooks():
    hooks.uninstall()
    yield
    hooks.uninstall()


def test_install_uninstall_on_megatron(clean_hooks):
    import megatron.core.optimizer.optimizer as O
    originals = {c: vars(getattr(O, c))["step"] for c in ("ChainedOptimizer", "MixedPrecisionOptimizer",
                                                           "FP32Optimizer")}
    for _ in range(2):
        hooks.install()
        hooks.install()
        assert hooks.installed()
        for c, orig in originals.items():
            cur = vars(getattr(O, c))["step"]
            assert isinstance(cur, wrapt.FunctionWrapper) and cur.__wrapped__ is orig, c  # exactly one layer
        assert set(hooks.patched()) >= {f"megatron.core.optimizer.optimizer.{c}.step" for c in originals}
        hooks.uninstall()
        hooks.uninstall()
        for c, orig in originals.items():
            assert vars(getattr(O, c))["step"] is orig, c
        assert hooks.patched() == []


def test_post_import_hook_patches_a_module_imported_later(clean_hooks, monkeypatch):
    # a stand-in module under the Bridge target name (Megatron-Bridge is not installed here)
    assert "megatron.bridge.training.train" not in sys.modules
    hooks.install()
    mod = types.ModuleType("megatron.bridge.training.train")

    def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state):
        return ({}, 0, False, False, 0, 1.0, 0)
    mod.train_step = train_step
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    wrapt.importer.notify_module_loaded(mod)   # what wrapt's import finder calls after executing the module
    assert isinstance(mod.train_step, wrapt.FunctionWrapper)
    assert "megatron.bridge.training.train.train_step" in hooks.patched()
    hooks.uninstall()
    assert mod.train_step is train_step


def test_a_failing_patch_never_breaks_the_import(clean_hooks, monkeypatch):
    monkeypatch.setattr(bridge_train, "patch", lambda module=None: 1 / 0)
    hooks.install()
    mod = types.ModuleType("megatron.bridge.training.train")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    wrapt.importer.notify_module_loaded(mod)   # must not raise
    assert "ZeroDivisionError" in hooks.errors()["megatron.bridge.training.train"]


# ------------------------------------------------------------------------------------------- re-entrancy
class Inner:
    def step(self):
        return (True, 0.5, 0)


class Chain:
    def __init__(self):
        self.inner = [Inner(), Inner()]

    def step(self):
        ok = all(i.step()[0] for i in self.inner)   # a chained step reaching wrapped inner steps
        return (ok, 0.5, 0)


def test_outermost_step_fires_once():
    from yeto_patch.hooks._optimizer_step import step_wrapper
    with shim():
        for cls in (Inner, Chain):
            _wrap.wrap(cls, "step", step_wrapper, "t")
        try:
            c = Chain()
            c.step()
            c.step()
            Inner().step()         # another optimizer stepping on its own: ignored, not counted
        finally:
            _wrap.unwrap(Chain, "step")
            _wrap.unwrap(Inner, "step")
        calls = Recorder.instances[0].calls
    assert calls == [("before_step", "Chain"), ("step", True, None)] * 2
    assert _runtime.RUNTIME._depth.n == 0


def test_step_exceptions_keep_the_depth_balanced():
    from yeto_patch.hooks._optimizer_step import step_wrapper

    class Boom:
        def step(self):
            raise RuntimeError("inner failure")
    with shim():
        _wrap.wrap(Boom, "step", step_wrapper, "t")
        try:
            with pytest.raises(RuntimeError, match="inner failure"):
                Boom().step()
            assert _runtime.RUNTIME._depth.n == 0
        finally:
            _wrap.unwrap(Boom, "step")


def test_config_error_is_raised_at_the_first_step_and_sticks():
    from yeto_patch.hooks._optimizer_step import step_wrapper
    with shim(env={"YETO_DILOCO_SYNCER": "127.0.0.1:1", "YETO_DILOCO_INSECURE": "1",
                   "YETO_DILOCO_PUSH_DTYPE": "int5"}):
        _wrap.wrap(Inner, "step", step_wrapper, "t")
        try:
            for _ in range(2):
                with pytest.raises(config.ConfigError, match="^YETO_DILOCO_PUSH_DTYPE='int5'"):
                    Inner().step()
        finally:
            _wrap.unwrap(Inner, "step")
    assert Recorder.instances == []


# ------------------------------------------------------------------------------------------- train_step
class FinishingRecorder(Recorder):
    finish_at = None

    def on_train_step_start(self, **facts):
        super().on_train_step_start(**facts)
        self.facts = facts
        self.finished = facts.get("iteration") == self.finish_at


def _mlm_train_step_019(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                        forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
    return ({"lm loss": 1.0}, 0, False, False, 0, 1.0, 0, 0)


def _mlm_train_step_017(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                        forward_backward_func):
    return ({"lm loss": 1.0}, 0, False, False, 0, 1.0, 0)


def _mlm_train_step_old(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    return ({"lm loss": 1.0}, 0, 1.0, 0)


def _call(fn, wrapper, *args, **kwargs):
    return wrapt.FunctionWrapper(fn, wrapper)(*args, **kwargs)


@pytest.mark.parametrize("fn,n", [(_mlm_train_step_019, 8), (_mlm_train_step_017, 7)])
def test_mlm_final_cut_reports_checkpoint_and_exit(fn, n, monkeypatch):
    iterations = iter([3, 4])   # 0.17 passes no iteration: Megatron's args.curr_iteration says it
    orig = mlm_training._facts

    def facts(bound):
        f = orig(bound)
        f.update(iteration=bound.get("iteration") or next(iterations), train_iters=10)
        return f
    monkeypatch.setattr(mlm_training, "_facts", facts)
    FinishingRecorder.finish_at = 4
    with shim(factory=FinishingRecorder):
        args = ("fwd", "data", ["model"], "opt", "sched", "cfg", "fb")
        kw = dict(iteration=3) if n == 8 else {}
        out = _call(fn, mlm_training.train_step_wrapper, *args, **kw)
        assert out[2:5] == (False, False, 0)             # not finished: unchanged
        kw = dict(iteration=4) if n == 8 else {}
        out = _call(fn, mlm_training.train_step_wrapper, *args, **kw)
        assert len(out) == n and out[2:5] == (True, True, 0) and out[0] == {"lm loss": 1.0}
        rec = Recorder.instances[0]
        assert rec.model == ["model"] and rec.optimizer == "opt" and rec.facts["train_iters"] == 10


def _mlm_load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    return 0, 0   # a --finetune load and "no checkpoint found" both return iteration 0


@pytest.mark.parametrize("where,expected", [
    (None, None),                          # --load names an empty directory: the model keeps its fresh weights
    ("load", True),                        # --load DIR --finetune: pretrained weights at iteration 0
    ("pretrained_checkpoint", True),       # --pretrained-checkpoint, which Megatron-LM falls back to
], ids=["empty", "finetune", "pretrained-checkpoint"])
def test_mlm_load_tells_a_pretrained_start_from_a_fresh_one(tmp_path, monkeypatch, where, expected):
    """Megatron-LM's load_checkpoint returns iteration 0 both when it loaded a checkpoint for a fine-tune and when
    it found none; whether a checkpoint (its tracker file, as Megatron-LM checks) was there tells them apart."""
    dirs = {name: tmp_path / name for name in ("load", "pretrained_checkpoint")}
    for d in dirs.values():
        d.mkdir()
    if where is not None:
        (dirs[where] / "latest_checkpointed_iteration.txt").write_text("release")
    args = types.SimpleNamespace(load=str(dirs["load"]), pretrained_checkpoint=str(dirs["pretrained_checkpoint"]),
                                 finetune=True)
    monkeypatch.setattr(mlm_training, "_args", lambda: args)
    with shim(factory=FinishingRecorder):
        assert _call(_mlm_load_checkpoint, mlm_training.load_checkpoint_wrapper, ["m"], None, None) == (0, 0)
        got = _runtime.RUNTIME.loaded
        assert (got.weights if got is not None else None) == expected
        assert got is None or (got.directory, got.iteration) == (str(dirs["load"]), 0)


def test_final_cut_at_megatrons_last_iteration_leaves_the_loop_alone(monkeypatch):
    monkeypatch.setattr(mlm_training, "_facts", lambda bound: dict(
        model=None, optimizer=None, tokens=None, vocab_size=None, iteration=bound["iteration"], train_iters=10))
    FinishingRecorder.finish_at = 9
    with shim(factory=FinishingRecorder):
        out = _call(_mlm_train_step_019, mlm_training.train_step_wrapper, *("f", "d", [], "o", "s", "c", "fb"),
                    iteration=9)
    assert out[2:5] == (False, False, 0)  # Megatron ends and saves at train_iters by itself


@pytest.mark.parametrize("fn", [_mlm_train_step_old, _mlm_train_step_017])
def test_early_final_cut_uses_megatrons_exit_interval(fn, monkeypatch):
    args = types.SimpleNamespace(exit_interval=None)
    monkeypatch.setattr(mlm_training, "_facts", lambda bound: dict(
        model=None, optimizer=None, tokens=None, vocab_size=None, iteration=4, train_iters=10))
    fake_gv = types.ModuleType("megatron.training.global_vars")
    fake_gv.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", fake_gv)
    FinishingRecorder.finish_at = 4
    with shim(factory=FinishingRecorder):
        out = _call(fn, mlm_training.train_step_wrapper, *("f", "d", [], "o", "s", "c", "fb")[:len(
            __import__("inspect").signature(fn).parameters)])
    assert args.exit_interval == 5                # Megatron saves at iteration 5 and leaves the loop
    assert out == fn(*range(len(__import__("inspect").signature(fn).parameters)))   # result untouched


def test_bind_tolerates_unbindable_calls():
    def f(a, b):
        return a
    assert _train_step.bind(f, (1,), {"zzz": 2}) == {"zzz": 2}
    assert _train_step.bind(f, (1, 2), {}) == {"a": 1, "b": 2}


def test_update_successful_forms():
    assert _runtime.update_successful((False, None, None)) is False
    assert _runtime.update_successful((True, 1.0, 0)) is True
    assert _runtime.update_successful(None) is True          # torch optimizer returning its closure loss
    assert _runtime.update_successful(False) is False
