"""The custom loops' checkpoint API (yeto_patch.hooks.checkpoint_saved / checkpoint_loaded): inert where yeto-patch
is not attached, handed to the engine made at the first optimizer step, and a resumed engine counts on from the
loaded iteration. (The whole restart through it, with real processes: tests/demo/test_island_kill.py.)"""
import logging
import os

import pytest

from yeto_patch import config, hooks
from yeto_patch.hooks import _runtime
from tests.shim.workers import Recorder, shim


@pytest.fixture(autouse=True)
def fresh_runtime():
    """A fresh runtime; the yeto_patch logger as it was (an engine made here sets it up, and a later test file
    reads its records through propagation)."""
    logger = logging.getLogger("yeto_patch")
    saved = logger.propagate, logger.level, list(logger.handlers), _runtime._logging_done
    _runtime.RUNTIME.reset()
    yield
    _runtime.RUNTIME.reset()
    logger.propagate, level, handlers, _runtime._logging_done = saved
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_inert_without_configuration(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("YETO_"):
            monkeypatch.delenv(k)
    config.reset()
    hooks.checkpoint_loaded(str(tmp_path), 40)          # before any step, nothing attached
    hooks.checkpoint_saved(str(tmp_path), 50)
    hooks.checkpoint_loaded(None, None)                  # a fresh start
    assert _runtime.RUNTIME.engine is None
    assert os.listdir(tmp_path) == []                   # no sync state written by a loop without yeto-patch


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="integer"):
        hooks.checkpoint_saved(str(tmp_path), "7")
    with pytest.raises(TypeError, match="bool"):
        hooks.checkpoint_loaded(str(tmp_path), True)
    with pytest.raises(ValueError, match=">= 0"):
        hooks.checkpoint_loaded(str(tmp_path), -1)
    with pytest.raises(TypeError, match="path"):
        hooks.checkpoint_saved(7, 7)
    with pytest.raises(ValueError, match="directory"):
        hooks.checkpoint_saved(None, 7)
    assert _runtime.RUNTIME.loaded is None


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_loaded_before_the_first_step_reaches_the_engine_made_later(tmp_path):
    import numpy as np
    with shim():
        hooks.checkpoint_loaded(tmp_path, np.int64(40))          # (a path object, a numpy integer)
        assert Recorder.instances == []
        _runtime.RUNTIME.before_outer_step(object())             # the first optimizer step makes the engine
        (eng,) = Recorder.instances
        assert eng.resume == (str(tmp_path), 40)
        hooks.checkpoint_saved(str(tmp_path), 45)
        assert eng.saved == [(str(tmp_path), 45)]
        eng.started = True
        seen = _Lines()          # (the yeto_patch logger does not propagate once set up)
        logging.getLogger("yeto_patch").addHandler(seen)
        try:
            hooks.checkpoint_loaded(str(tmp_path), 45)           # too late: logged and ignored
        finally:
            logging.getLogger("yeto_patch").removeHandler(seen)
        assert eng.resume == (str(tmp_path), 40)
        assert any("after the island started" in x for x in seen.lines), seen.lines


def test_a_resumed_engine_counts_on_from_the_loaded_iteration(monkeypatch):
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:9")
    monkeypatch.setenv("YETO_DILOCO_INSECURE", "1")
    config.reset()
    from yeto_patch.island import engine as E
    try:
        e = E.Engine(config.get())
        assert e.step == 0
        e.set_resume(None, None)                 # nothing loaded: a fresh start counts from 0
        assert e.step == 0 and e._resume is None
        e.set_resume("/ckpt", 40)                # a custom loop tells no iteration at its steps: it comes from here
        assert e.step == 40
    finally:
        config.reset()


@pytest.mark.parametrize("loaded,state,expected", [
    ((None, None, False), None, False),                  # fresh weights
    (("/pre", 0, True), None, True),                     # a fine-tune's pretrained weights
    (("/ckpt", 40, False), None, True),                  # a Megatron checkpoint saved without yeto-patch
    (("/ckpt", 40, False), {"pretrained": False}, False),   # a restart of a run from fresh weights
    (("/ckpt", 40, False), {"pretrained": True}, True),     # a restart of a fine-tune
    (("/ckpt", 40, False), {}, False),                   # a sync state saved before the field existed
], ids=["fresh", "finetune", "foreign-checkpoint", "restart", "restart-of-finetune", "old-state"])
def test_the_engine_knows_whether_its_run_started_from_pretrained_weights(monkeypatch, loaded, state, expected):
    """What every push says (the syncer's outer lr auto goes by it): a restart keeps what its sync state saved;
    otherwise weights loaded before training are a pretrained start."""
    import types
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:9")
    monkeypatch.setenv("YETO_DILOCO_INSECURE", "1")
    config.reset()
    from yeto_patch.island import engine as E
    told = []
    try:
        e = E.Engine(config.get())
        e.set_resume(loaded[0], loaded[1], weights=loaded[2])
        e.parts = types.SimpleNamespace(link=types.SimpleNamespace(started_from=told.append))
        e._started_from(state)
        assert e.pretrained is expected and told == [expected]
    finally:
        config.reset()
