"""The only place that names Megatron symbols to patch. One module per patched target, each with idempotent
``patch()`` / ``unpatch()`` / ``patched()`` (in the style of ddtrace's contrib patch modules):

=================================  ==========================================================================
hook module                        target
=================================  ==========================================================================
mcore_optimizer                    megatron.core.optimizer.optimizer: step of MixedPrecisionOptimizer,
                                   Float16OptimizerWithFloat16Params, FP32Optimizer, ChainedOptimizer
mcore_distrib_optimizer            megatron.core.optimizer.distrib_optimizer: DistributedOptimizer.step
                                   (where a release defines its own)
mcore_hybrid_optimizer             megatron.core.optimizer.cpu_offloading.hybrid_optimizer:
                                   HybridDeviceOptimizer.step
mcore_layer_wise_optimizer         megatron.core.optimizer.layer_wise_optimizer:
                                   LayerWiseDistributedOptimizer.step (where defined)
mlm_training                       megatron.training.training: train_step (Megatron-LM)
bridge_train                       megatron.bridge.training.train: train_step (Megatron-Bridge)
bridge_checkpointing               megatron.bridge.training.checkpointing: save_checkpoint, load_checkpoint
swift_megatron                     swift.megatron.trainers.base: BaseMegatronTrainer.train_step,
                                   save_checkpoint, _load_checkpoint (ms-swift ``megatron sft`` / ``pt``)
=================================  ==========================================================================

``install()`` registers a wrapt post-import hook per target: a target already imported is patched at once, the
others when they are imported. It imports neither torch nor Megatron. A failing patch never breaks the import
of a Megatron module (the error is logged). ``uninstall()`` removes the pending registrations and unpatches
everything (tests use it).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import threading

import wrapt

log = logging.getLogger("yeto_patch")

HOOK_MODULES = (
    "mcore_optimizer",
    "mcore_distrib_optimizer",
    "mcore_hybrid_optimizer",
    "mcore_layer_wise_optimizer",
    "mlm_training",
    "bridge_train",
    "bridge_checkpointing",
    "swift_megatron",
)

_lock = threading.RLock()
_callbacks = {}     # target module name -> our post-import callback (while registered)
_installed = False
_errors = {}        # target module name -> why patching it failed


def _hook(name):
    return importlib.import_module(f"{__name__}.{name}")


def _make_callback(hook_name):
    def on_import(module):
        with _lock:
            if not _installed:
                return
            _callbacks.pop(module.__name__, None)
        try:
            _hook(hook_name).patch(module)
        except Exception as err:  # never make `import megatron...` fail because of us
            log.error("yeto-patch: patching %s failed (%s: %s); DiLoCo boundaries will be missing for it",
                      module.__name__, type(err).__name__, err)
            _errors[module.__name__] = f"{type(err).__name__}: {err}"
    return on_import


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


def survey() -> list:
    """For `yeto-patch doctor`: (hook, target, status) for this environment. Imports the targets that exist."""
    rows = []
    for hook_name in HOOK_MODULES:
        mod = _hook(hook_name)
        target = mod.TARGET
        try:
            found = importlib.util.find_spec(target) is not None
        except Exception:
            found = False
        if not found:
            rows.append((hook_name, target, "absent (not installed here)"))
            continue
        try:
            module = importlib.import_module(target)
        except Exception as err:
            rows.append((hook_name, target, f"present but fails to import: {type(err).__name__}: {err}"))
            continue
        wraps = getattr(mod, "WRAPS", None)
        if wraps is not None:   # dotted names inside the target (functions, Class.method)
            own = [w for w in wraps if callable(_lookup(module, w))]
            rows.append((hook_name, target, ("would attach: " + ", ".join(own)) if own else
                         "present; none of " + ", ".join(wraps) + " found (another release?)"))
            continue
        names = getattr(mod, "CLASSES", ("train_step",))
        own = [n for n in names if (n == "train_step" and callable(getattr(module, n, None)))
               or ("step" in vars(getattr(module, n, object)))]
        if own:
            rows.append((hook_name, target, "would attach: " + ", ".join(
                n if n == "train_step" else f"{n}.step" for n in own)))
        else:
            rows.append((hook_name, target, "present; nothing of its own to wrap (inherited steps are covered)"))
    return rows


def _lookup(module, dotted):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


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
