"""Every hook module declares its targets as data; patch() wraps exactly what it declares, a missing REQUIRED
target is an error that errors()/doctor show and the log says once, and survey() walks the declarations."""
import io
import logging
import sys
import types

import pytest
import wrapt

from yeto_patch import cli, hooks
from yeto_patch.hooks import _targets
from yeto_patch.hooks._targets import Target


def hook_modules():
    return [(name, hooks._hook(name)) for name in hooks.HOOK_MODULES]


def stand_in(module_name, targets, leave_out=()):
    """A module object under ``module_name`` defining every declared target except those named in leave_out."""
    mod = types.ModuleType(module_name)
    for t in targets:
        if t.name in leave_out:
            continue
        if t.owner is None:
            def fn(*args, **kwargs):
                return ({}, 0, False, False, 0, 1.0, 0)
            fn.__name__ = t.attribute
            setattr(mod, t.attribute, fn)
        else:
            cls = getattr(mod, t.owner, None) or type(t.owner, (), {})
            setattr(cls, t.attribute, lambda self, *a, **k: (True, 1.0, 0))
            setattr(mod, t.owner, cls)
    return mod


@pytest.fixture
def clean_hooks():
    hooks.uninstall()
    yield
    hooks.uninstall()


@pytest.mark.parametrize("name,hook", hook_modules())
def test_declaration_format(name, hook):
    assert isinstance(hook.TARGETS, tuple) and hook.TARGETS, name
    for t in hook.TARGETS:
        assert isinstance(t, Target) and t.module == hook.TARGET and t.attribute.isidentifier(), t
        assert t.owner is None or t.owner.isidentifier(), t
    assert len({t.qualname for t in hook.TARGETS}) == len(hook.TARGETS)
    assert hook.SUPPORTED_VERSIONS and all(_targets.version_ok("99.0", spec) is not None
                                           for spec in hook.SUPPORTED_VERSIONS.values()), name


@pytest.mark.parametrize("name,hook", hook_modules())
def test_patch_wraps_exactly_what_is_declared(name, hook, monkeypatch):
    mod = stand_in(hook.TARGET, hook.TARGETS)
    monkeypatch.setitem(sys.modules, hook.TARGET, mod)
    try:
        assert sorted(hook.patch(mod)) == sorted(t.qualname for t in hook.TARGETS)
        assert sorted(hook.patched()) == sorted(t.qualname for t in hook.TARGETS)
        assert {t.status() for t in hook.TARGETS} == {_targets.PATCHED}
    finally:
        hook.unpatch()
    assert hook.patched() == [] and {t.status() for t in hook.TARGETS} == {_targets.NOT_PATCHED}


def test_checkpoint_hooks_are_declared_required():
    names = {(t.name, t.required) for t in hooks._hook("mlm_training").TARGETS}
    assert {("train_step", True), ("save_checkpoint", True), ("load_checkpoint", True)} <= names
    declared = {t.qualname for _, t in hooks.declared()}
    assert "megatron.training.training.save_checkpoint" in declared
    assert "megatron.core.optimizer.optimizer.ChainedOptimizer.step" in declared


def test_a_missing_required_target_is_an_error_logged_once(clean_hooks, monkeypatch, caplog):
    mlm = hooks._hook("mlm_training")
    mod = stand_in(mlm.TARGET, mlm.TARGETS, leave_out={"save_checkpoint"})   # a release that renamed it
    monkeypatch.setitem(sys.modules, mlm.TARGET, mod)
    with caplog.at_level(logging.ERROR, logger="yeto_patch"):
        hooks.install()                          # already imported: patched at once
        wrapt.importer.notify_module_loaded(mod)   # a second notification does not log again
    try:
        errs = hooks.errors()
        assert "megatron.training.training.save_checkpoint" in errs, errs
        assert "megatron.training.training.load_checkpoint" not in errs
        said = [r for r in caplog.records if "save_checkpoint" in r.getMessage()]
        assert len(said) == 1 and "not defined" in said[0].getMessage()
        assert set(mlm.patched()) == {f"{mlm.TARGET}.train_step", f"{mlm.TARGET}.load_checkpoint"}
        rows = {t.name: status for hook, t, status in hooks.survey(import_targets=False) if hook == "mlm_training"}
        assert rows == {"train_step": "patched", "save_checkpoint": "missing: required, ERROR",
                        "load_checkpoint": "patched"}
        out = io.StringIO()
        assert cli._doctor_hooks(out, import_targets=False) is False
        text = out.getvalue()
        assert "save_checkpoint" in text and "missing: required, ERROR" in text
        assert "ERROR: megatron.training.training.save_checkpoint: required target" in text
    finally:
        hooks.uninstall()
    assert hooks.errors() == {}


def test_a_missing_optional_target_is_not_an_error(clean_hooks, monkeypatch):
    hook = hooks._hook("mcore_distrib_optimizer")
    mod = types.ModuleType(hook.TARGET)
    mod.DistributedOptimizer = type("DistributedOptimizer", (), {})   # inherits its step: nothing of its own
    monkeypatch.setitem(sys.modules, hook.TARGET, mod)
    hooks.install()
    try:
        assert hooks.errors() == {}
        rows = [status for h, t, status in hooks.survey(import_targets=False) if h == "mcore_distrib_optimizer"]
        assert rows == ["missing: optional (inherited or absent in this release)"] * len(hook.TARGETS)
    finally:
        hooks.uninstall()


def test_survey_lists_every_declared_target(monkeypatch):
    bridge = hooks._hook("bridge_train")
    monkeypatch.delitem(sys.modules, bridge.TARGET, raising=False)
    rows = hooks.survey(import_targets=False)
    assert [(h, t) for h, t, _ in rows] == hooks.declared()
    allowed = ("patched", "not patched", "missing", "not imported", "not installed")
    assert all(status.startswith(allowed) for _, _, status in rows), rows
    assert [s for h, _, s in rows if h == "bridge_train"][0] in ("not imported", "not installed")
    monkeypatch.setitem(sys.modules, bridge.TARGET, stand_in(bridge.TARGET, bridge.TARGETS))
    assert [s for h, _, s in hooks.survey(import_targets=False) if h == "bridge_train"] == ["not patched"]


@pytest.mark.parametrize("version,spec,ok", [
    ("0.19.2", ">=0.16", True), ("0.16.1", ">=0.16", True), ("0.15.3", ">=0.16", False),
    ("0.16.0rc1", ">=0.16", True), ("0.17.0", ">=0.16,<0.17", False), ("1.2", "*", True),
    ("0.19.2", "==0.19.2", True), ("abc", ">=0.1", None), ("0.1", "~=0.1", None)])
def test_version_specs(version, spec, ok):
    assert _targets.version_ok(version, spec) is ok
