"""The only place that names Megatron symbols to patch. One module per patched Megatron module, each with
idempotent ``patch(module=None)`` / ``unpatch()`` / ``patched()`` (in the style of ddtrace's contrib patch modules)
and its targets declared as data (in the style of ddtrace's ``_supported_versions`` and OpenTelemetry's
``_instruments``):

=================================  ==========================================================================
hook module                        target module
=================================  ==========================================================================
mcore_optimizer                    megatron.core.optimizer.optimizer
mcore_distrib_optimizer            megatron.core.optimizer.distrib_optimizer
mcore_hybrid_optimizer             megatron.core.optimizer.cpu_offloading.hybrid_optimizer
mcore_layer_wise_optimizer         megatron.core.optimizer.layer_wise_optimizer
mlm_training                       megatron.training.training (Megatron-LM: train_step, save/load_checkpoint)
mlm_ft                             megatron.training.ft_integration (Megatron-LM's --enable-ft-package: setup,
                                   shutdown; the island's waits keep NVIDIA FT's sections alive)
bridge_train                       megatron.bridge.training.train (Megatron-Bridge: train_step)
bridge_checkpointing               megatron.bridge.training.checkpointing (Megatron-Bridge: save/load_checkpoint)
bridge_hf_weights                  megatron.bridge.models.conversion.model_bridge (Megatron-Bridge: Hugging Face
                                   weights loaded into the model, a fine-tune's pretrained start)
swift_megatron                     swift.megatron.trainers.base (ms-swift ``megatron sft`` / ``pt``: train_step,
                                   save_checkpoint, _load_checkpoint)
=================================  ==========================================================================

Declaring a hook module (add its name to ``HOOK_MODULES``)::

    from ._targets import Target

    TARGET = "megatron.bridge.training.train"          # importing this module triggers patch(module)
    TARGETS = (                                        # everything patch() wraps, one Target each
        Target(TARGET, None, "train_step"),            # (module, owner class or None for a function, attribute)
        Target(TARGET, "SomeClass", "step", required=False),   # optional: absent or inherited in some releases
    )
    SUPPORTED_VERSIONS = {"megatron-bridge": ">=0.2"}  # distribution -> ">=a.b[,<c.d]" or "*" (shown by doctor)

    def patch(module=None) -> list: ...                # wrap what is defined; return patched qualnames
    def unpatch() -> None: ...
    def patched() -> list: ...                         # "<module>.<owner>.<attribute>" / "<module>.<attribute>"

(``_wrap.hook`` builds the three functions, once for every hook module; ``_optimizer_step.hook_functions`` feeds it
the declared optimizer methods.)
A target is defined when its owner has the attribute in its own namespace. After ``patch()`` ran on an import,
every REQUIRED target that the module does not define is recorded in ``errors()`` and logged once (a release that
renamed ``save_checkpoint`` would otherwise silently break island restart). ``survey()`` walks the declarations
for ``yeto-patch doctor``: every target as patched / not patched / missing / not imported. A launcher's hook
module may declare ``WRITERS``: the TensorBoard / W&B writers it hands to the island's figures (``writers()``).
tests/hooks/test_declarations.py checks, for every hook module, that ``patch()`` wraps exactly what it declares.

A custom training loop tells yeto-patch about its own checkpoints with ``checkpoint_saved(directory, iteration)``
and ``checkpoint_loaded(directory, iteration, weights=None)`` (``checkpoints.py``; inert where yeto-patch is not
attached; ``weights=True`` with iteration 0: the loop loaded pretrained weights, a fine-tune).

``install()`` registers a wrapt post-import hook per target module: one already imported is patched at once, the
others when they are imported. It imports neither torch nor Megatron. A failing patch never breaks the import
of a Megatron module (the error is logged). ``uninstall()`` removes the pending registrations and unpatches
everything (tests use it).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading

import wrapt

from . import _targets
from .checkpoints import checkpoint_loaded, checkpoint_saved  # noqa: F401  (the custom loops' checkpoint API)

log = logging.getLogger("yeto_patch")

HOOK_MODULES = (
    "mcore_optimizer",
    "mcore_distrib_optimizer",
    "mcore_hybrid_optimizer",
    "mcore_layer_wise_optimizer",
    "mlm_training",
    "mlm_ft",
    "bridge_train",
    "bridge_checkpointing",
    "bridge_hf_weights",
    "swift_megatron",
)

_lock = threading.RLock()
_callbacks = {}     # target module name -> our post-import callback (while registered)
_installed = False
_errors = {}        # target module name (patch failed) or target qualname (missing) -> why


def _hook(name):
    return importlib.import_module(f"{__name__}.{name}")


def _make_callback(hook_name):
    def on_import(module):
        with _lock:
            if not _installed:
                return
            _callbacks.pop(module.__name__, None)
        try:
            hook = _hook(hook_name)
            hook.patch(module)
            _record_missing(hook, module)
        except Exception as err:  # never make `import megatron...` fail because of us
            log.error("yeto-patch: patching %s failed (%s: %s); DiLoCo boundaries will be missing for it",
                      module.__name__, type(err).__name__, err)
            _errors[module.__name__] = f"{type(err).__name__}: {err}"
    return on_import


def _record_missing(hook, module) -> None:
    """Record (and log once) every required target of ``hook`` that the imported ``module`` does not define."""
    for t in _targets.missing_required(getattr(hook, "TARGETS", ()), module):
        with _lock:
            if t.qualname in _errors:
                continue
            _errors[t.qualname] = (f"required target {t.qualname} is not defined in this release; "
                                   f"{hook.__name__.rsplit('.', 1)[-1]} cannot attach to it")
        log.error("yeto-patch: %s is not defined by this %s release (renamed or removed?): %s cannot be "
                  "patched, so DiLoCo misses what it does", t.name, t.module, t.qualname)


def install() -> None:
    """Register the post-import hooks (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        for hook_name in HOOK_MODULES:
            target = _hook(hook_name).TARGET
            cb = _make_callback(hook_name)
            _callbacks[target] = cb
    # outside the lock: wrapt fires the callback right away for a module already imported
    for target, cb in list(_callbacks.items()):
        wrapt.register_post_import_hook(cb, target)


def uninstall() -> None:
    """Remove pending post-import hooks and unpatch every target (idempotent)."""
    global _installed
    with _lock:
        _installed = False
        pending = dict(_callbacks)
        _callbacks.clear()
        _errors.clear()
    try:
        from wrapt import importer
        with importer._post_import_hooks_lock:
            for target, cb in pending.items():
                hooks = importer._post_import_hooks.get(target)
                if hooks and cb in hooks:
                    hooks.remove(cb)
                if hooks is not None and not hooks:
                    importer._post_import_hooks.pop(target, None)
    except Exception:  # wrapt internals moved: our callbacks are inert anyway once _installed is False
        pass
    for hook_name in HOOK_MODULES:
        _hook(hook_name).unpatch()


def installed() -> bool:
    return _installed


def patched() -> list:
    """Qualified names currently wrapped (for tests and doctor)."""
    out = []
    for hook_name in HOOK_MODULES:
        out += _hook(hook_name).patched()
    return out


def errors() -> dict:
    return dict(_errors)


def declared() -> list:
    """(hook module name, Target) for every declared target, in HOOK_MODULES order."""
    return [(name, t) for name in HOOK_MODULES for t in getattr(_hook(name), "TARGETS", ())]


def supported_versions() -> dict:
    """hook module name -> its SUPPORTED_VERSIONS (distribution -> version spec)."""
    return {name: dict(getattr(_hook(name), "SUPPORTED_VERSIONS", {})) for name in HOOK_MODULES}


def _findable(name) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:
        return False


def survey(import_targets: bool = True) -> list:
    """For `yeto-patch doctor`: one (hook, Target, status) row per declared target. Status is ``patched``,
    ``not patched`` (present; yeto-patch is not attached in this process), ``missing`` (the module does not
    define it), ``not imported`` or ``not installed``, with a reason after a colon where there is one.
    ``import_targets``: import the target modules that are installed first (as training would)."""
    rows = []
    for hook_name in HOOK_MODULES:
        hook = _hook(hook_name)
        module, why = hook.TARGET, None
        # find_spec of a dotted name imports its parent packages: without import_targets look at the top only
        if not _findable(module if import_targets else module.split(".")[0]):
            why = "not installed"
        elif import_targets and module not in sys.modules:
            try:
                importlib.import_module(module)
            except Exception as err:
                why = f"not imported: fails to import: {type(err).__name__}: {err}"
        for t in getattr(hook, "TARGETS", ()):
            status = t.status()
            if status == _targets.NOT_IMPORTED and why:
                status = why
            elif status == _targets.MISSING:
                status += ": required, ERROR" if t.required else ": optional (inherited or absent in this release)"
            rows.append((hook_name, t, status))
    return rows


def _lookup(module, dotted):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def writers() -> dict:
    """For `yeto-patch doctor`: launcher -> [(writer, Python package, where the launcher keeps it)] from each hook
    module's WRITERS (the writers the island's figures go to). Imports nothing of Megatron."""
    out: dict = {}
    for hook_name in HOOK_MODULES:
        mod = _hook(hook_name)
        for w in getattr(mod, "WRITERS", ()):
            rows = out.setdefault(getattr(mod, "LAUNCHER", None) or "any loop (megatron-core optimizers)", [])
            if tuple(w) not in rows:
                rows.append(tuple(w))
    return out


def launchers() -> list:
    """For `yeto-patch doctor`: (launcher, its package and version or None when not installed, hook modules that
    serve it), from each hook module's LAUNCHER / DISTRIBUTION. Imports nothing of Megatron."""
    import importlib.metadata as md
    seen = {}
    for hook_name in HOOK_MODULES:
        mod = _hook(hook_name)
        name = getattr(mod, "LAUNCHER", None) or "any loop (megatron-core optimizers)"
        dist = getattr(mod, "DISTRIBUTION", None) or "megatron-core"
        row = seen.setdefault(name, [name, dist, None, []])
        try:
            row[2] = md.version(dist)
        except md.PackageNotFoundError:
            pass
        row[3].append(hook_name)
    return [tuple(r) for r in seen.values()]
