"""The launcher hooks' mechanics against objects shaped like the real ones (the real launchers are in
tests/launchers): ms-swift's BaseMegatronTrainer (facts from self.state / self.args, the final cut shortens its
loop, checkpoints carry the sync state) and Megatron-Bridge's train_step (9 arguments, 8 results; the final cut
uses Bridge's exit interval) and checkpointing functions."""
import sys
import types

import pytest
import wrapt

from yeto_patch.hooks import _runtime, bridge_checkpointing, bridge_hf_weights, bridge_train, swift_megatron
from tests.shim.workers import Recorder, shim


class FinishingRecorder(Recorder):
    finish_at = None

    def on_train_step_start(self, **facts):
        super().on_train_step_start(**facts)
        self.facts = facts
        self.finished = facts.get("iteration") == self.finish_at


def _fake_swift(monkeypatch):
    """A module `swift.megatron.trainers.base` with ms-swift 4.6's loop in miniature."""
    mod = types.ModuleType(swift_megatron.TARGET)

    class BaseMegatronTrainer:
        def __init__(self, train_iters, load=None):
            self.args = types.SimpleNamespace(train_iters=train_iters, global_batch_size=4, seq_length=64,
                                              mcore_model=load, finetune=load is None)
            self.state = types.SimpleNamespace(iteration=0, last_model_checkpoint=None)
            self.config = types.SimpleNamespace(vocab_size=512)
            self.wrapped_models, self.optimizer = ["chunk"], "opt"
            self._load_checkpoint()

        def _load_checkpoint(self):
            if self.args.mcore_model:
                self.state.iteration = 3

        def train_step(self, train_data_iterator):
            return {"loss": 1.0}, 0.5, True

        def save_checkpoint(self):
            self.state.last_model_checkpoint = f"/out/checkpoint-{self.state.iteration}"

        def train(self):   # BaseMegatronTrainer.train / run_train_step / DefaultFlowCallback, reduced
            while self.state.iteration < self.args.train_iters:
                self.train_step(None)
                self.state.iteration += 1
            self.save_checkpoint()
    mod.BaseMegatronTrainer = BaseMegatronTrainer
    for name in ("swift", "swift.megatron", "swift.megatron.trainers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, swift_megatron.TARGET, mod)
    return BaseMegatronTrainer


def test_swift_trainer_facts_final_cut_and_checkpoints(monkeypatch):
    T = _fake_swift(monkeypatch)
    FinishingRecorder.finish_at = 3
    with shim(factory=FinishingRecorder) as hooks:
        swift_megatron.patch()
        assert set(hooks.patched()) >= {f"{swift_megatron.TARGET}.BaseMegatronTrainer.{m}"
                                        for m in swift_megatron.METHODS}
        t = T(train_iters=10)
        t.train()
        rec = Recorder.instances[0]
        assert rec.facts == dict(iteration=3, train_iters=10, tokens=256, vocab_size=512)
        assert rec.model == ["chunk"] and rec.optimizer == "opt"
        assert t.args.train_iters == 4 and t.state.iteration == 4      # the loop ended after the cut's step
        assert t.state.last_model_checkpoint == "/out/checkpoint-4"
        swift_megatron.unpatch()
        assert not swift_megatron.patched()


def test_swift_checkpoint_save_and_resume_reach_the_engine(monkeypatch):
    T = _fake_swift(monkeypatch)
    FinishingRecorder.finish_at = None
    with shim(factory=FinishingRecorder):
        swift_megatron.patch()
        t = T(train_iters=5, load="/out/checkpoint-3")          # --mcore_model ... --finetune false
        assert _runtime.RUNTIME.loaded == _runtime.Loaded("/out/checkpoint-3", 3, True)
        t.train()
        rec = Recorder.instances[0]
        assert rec.resume == ("/out/checkpoint-3", 3)
        assert rec.saved == [("/out/checkpoint-5", 5)]
        assert [c for c in rec.calls if c[0] == "train_step_start"] == [("train_step_start", 3),
                                                                        ("train_step_start", 4)]
        swift_megatron.unpatch()


def test_swift_weights_make_a_pretrained_start_unless_its_sync_state_says_otherwise(monkeypatch):
    """ms-swift trains loaded weights: the Hugging Face model's (loaded before _load_checkpoint) or --mcore_model's
    with --finetune (the default): a pretrained start, at iteration 0."""
    T = _fake_swift(monkeypatch)
    FinishingRecorder.finish_at = None
    with shim(factory=FinishingRecorder):
        swift_megatron.patch()
        t = T(train_iters=2)
        t.args.model_dir = "/models/qwen"
        t._load_checkpoint()
        assert _runtime.RUNTIME.loaded == _runtime.Loaded("/models/qwen", 0, True)
        t.train()
        rec = Recorder.instances[-1]
        assert rec.resume == ("/models/qwen", 0) and rec.weights is True
        swift_megatron.unpatch()


def _fake_bridge_checkpointing(monkeypatch, present):
    """megatron.bridge.training.checkpointing's two checks, over a set of directories that hold a checkpoint."""
    mod = types.ModuleType("megatron.bridge.training.checkpointing")
    mod.checkpoint_exists = lambda d: d in present
    mod.is_hf_checkpoint_dir = lambda d: False
    for name in ("megatron.bridge", "megatron.bridge.training"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)


@pytest.mark.parametrize("present,expected", [
    ((), None),                                                       # nothing to load: fresh weights
    (("/pre",), _runtime.Loaded("/pre", 0, True)),                    # checkpoint.pretrained_checkpoint: a fine-tune
], ids=["fresh", "pretrained"])
def test_bridge_load_of_a_pretrained_checkpoint_is_a_pretrained_start(monkeypatch, present, expected):
    _fake_bridge_checkpointing(monkeypatch, set(present))

    def load_checkpoint(state, model, optimizer, opt_param_scheduler, strict=True, **kw):
        return 0, 0.0
    gs = _gs(0)
    gs.cfg.checkpoint.load, gs.cfg.checkpoint.pretrained_checkpoint = None, "/pre"
    FinishingRecorder.finish_at = None
    with shim(factory=FinishingRecorder):
        load = wrapt.FunctionWrapper(load_checkpoint, bridge_checkpointing.load_checkpoint_wrapper)
        load(state=gs, model=[], optimizer=None, opt_param_scheduler=None)
        assert _runtime.RUNTIME.loaded == expected


def test_bridge_hugging_face_weights_are_a_pretrained_start_that_a_resume_replaces(monkeypatch):
    """A provider made with to_megatron_provider(load_weights=True) loads the Hugging Face weights before the
    model is wrapped; a load_checkpoint that then finds nothing leaves that, a resume of the run's own checkpoint
    replaces it (its sync state says how the run began)."""
    _fake_bridge_checkpointing(monkeypatch, {"/ck"})

    class MegatronModelBridge:   # megatron.bridge.models.conversion.model_bridge's, reduced
        def load_weights_hf_to_megatron(self, hf_pretrained, megatron_model, allowed_mismatched_params=None):
            return list(megatron_model)

    def load_checkpoint(state, model, optimizer, opt_param_scheduler, strict=True, **kw):
        return (6, 0.0) if state.cfg.checkpoint.load == "/ck" else (0, 0.0)
    mod = types.ModuleType(bridge_hf_weights.TARGET)
    mod.MegatronModelBridge = MegatronModelBridge
    monkeypatch.setitem(sys.modules, bridge_hf_weights.TARGET, mod)
    with shim(factory=FinishingRecorder):
        assert bridge_hf_weights.patch(mod) == [f"{bridge_hf_weights.TARGET}.MegatronModelBridge."
                                                 "load_weights_hf_to_megatron"]
        try:
            hf = types.SimpleNamespace(model_name_or_path="/hf/qwen")
            assert MegatronModelBridge().load_weights_hf_to_megatron(hf, ["m"]) == ["m"]
            assert _runtime.RUNTIME.loaded == _runtime.Loaded("/hf/qwen", 0, True)
            load = wrapt.FunctionWrapper(load_checkpoint, bridge_checkpointing.load_checkpoint_wrapper)
            gs = _gs(0)
            gs.cfg.checkpoint.load = "/empty"
            load(state=gs, model=[], optimizer=None, opt_param_scheduler=None)      # nothing there: unchanged
            assert _runtime.RUNTIME.loaded == _runtime.Loaded("/hf/qwen", 0, True)
            load(state=_gs(6), model=[], optimizer=None, opt_param_scheduler=None)  # a resume of its own
            assert _runtime.RUNTIME.loaded == _runtime.Loaded("/ck", 6, True)
        finally:
            bridge_hf_weights.unpatch()


def _bridge_train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state, pg_collection,
                       forward_backward_func, p2p_communicator):   # Megatron-Bridge 0.6.2's signature
    return ({}, 0, False, False, 0, 1.0, 0, None)


def _gs(step):
    return types.SimpleNamespace(
        train_state=types.SimpleNamespace(step=step),
        cfg=types.SimpleNamespace(train=types.SimpleNamespace(train_iters=20, global_batch_size=8, exit_interval=None),
                                  model=types.SimpleNamespace(seq_length=128),
                                  checkpoint=types.SimpleNamespace(save="/ck", load="/ck")),
        tokenizer=types.SimpleNamespace(vocab_size=32000))


def test_bridge_facts_and_final_cut_through_the_exit_interval():
    gs = _gs(6)
    FinishingRecorder.finish_at = 6
    with shim(factory=FinishingRecorder):
        out = wrapt.FunctionWrapper(_bridge_train_step, bridge_train.train_step_wrapper)(
            "f", "d", ["m"], "opt", "sched", gs, "pg", "fb", "p2p")
        rec = Recorder.instances[0]
    assert rec.facts == dict(iteration=6, train_iters=20, tokens=1024, vocab_size=32000)
    assert rec.model == ["m"] and rec.optimizer == "opt"
    assert gs.cfg.train.exit_interval == 7              # Bridge saves at step 7 (its label) and leaves the loop
    assert out == _bridge_train_step(*range(9))          # the flags are left alone


def test_bridge_final_cut_at_its_last_iteration_changes_nothing():
    gs = _gs(19)
    FinishingRecorder.finish_at = 19
    with shim(factory=FinishingRecorder):
        wrapt.FunctionWrapper(_bridge_train_step, bridge_train.train_step_wrapper)(
            "f", "d", ["m"], "opt", "sched", gs, "pg", "fb", "p2p")
    assert gs.cfg.train.exit_interval is None


def test_bridge_checkpoints_carry_the_sync_state():
    def save_checkpoint(state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                        checkpointing_context=None, non_persistent_ckpt=False, **kw):
        return None

    def load_checkpoint(state, model, optimizer, opt_param_scheduler, strict=True, **kw):
        return 6, 0.0
    FinishingRecorder.finish_at = None
    with shim(factory=FinishingRecorder):
        load = wrapt.FunctionWrapper(load_checkpoint, bridge_checkpointing.load_checkpoint_wrapper)
        save = wrapt.FunctionWrapper(save_checkpoint, bridge_checkpointing.save_checkpoint_wrapper)
        assert load(state=_gs(6), model=[], optimizer=None, opt_param_scheduler=None) == (6, 0.0)
        assert _runtime.RUNTIME.loaded == _runtime.Loaded("/ck", 6, True)
        wrapt.FunctionWrapper(_bridge_train_step, bridge_train.train_step_wrapper)(
            "f", "d", ["m"], "opt", "sched", _gs(6), "pg", "fb", "p2p")
        rec = Recorder.instances[0]
        assert rec.resume == ("/ck", 6)
        save(state=_gs(8), model=[], optimizer=None, opt_param_scheduler=None,
             num_floating_point_operations_so_far=0)
        save(state=_gs(9), model=[], optimizer=None, opt_param_scheduler=None,
             num_floating_point_operations_so_far=0, non_persistent_ckpt=True)
        assert rec.saved == [("/ck", 8)]


def test_each_launcher_hands_its_own_writers_to_the_figures(monkeypatch):
    """The writers the island's yeto/* figures go to: Bridge's GlobalState loggers, ms-swift's TensorBoard / W&B
    callbacks' writers, Megatron-LM's global writers (None where the launcher opened none)."""
    tb, wb = object(), object()
    gs = _gs(1)
    gs.tensorboard_logger, gs.wandb_logger = tb, None
    assert bridge_train._facts({"global_state": gs})["writers"]() == [tb, None]

    class TensorboardCallback:
        writer = tb

    class WandbCallback:
        writer = wb

    class PrintCallback:
        writer = "not a writer of ours"
    trainer = types.SimpleNamespace(callbacks=[PrintCallback(), TensorboardCallback(), WandbCallback()])
    assert swift_megatron.facts(trainer)["writers"]() == [tb, wb]
    assert swift_megatron.facts(types.SimpleNamespace())["writers"]() == []
    try:
        from megatron.training import global_vars
    except ImportError:   # megatron-core < 0.17 ships no megatron.training
        return
    from yeto_patch.hooks import mlm_training
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", tb)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", None)
    assert mlm_training.writers() == [tb, None]
