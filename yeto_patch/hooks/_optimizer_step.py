"""The wrapper every megatron-core optimizer ``step`` gets, and the patch/unpatch helpers the optimizer hook
modules share. The boundary runs after the OUTERMOST step returns (a ChainedOptimizer stepping wrapped inner
optimizers fires once); before it, an optimizer-only training loop gets its engine started."""
from __future__ import annotations

from . import _wrap
from ._runtime import RUNTIME


def step_wrapper(wrapped, instance, args, kwargs):
    outer = RUNTIME.step_enter()
    try:
        counts = RUNTIME.before_outer_step(instance) if outer else False
        result = wrapped(*args, **kwargs)
    finally:
        RUNTIME.step_exit()
    if counts:
        RUNTIME.after_outer_step(instance, result)
    return result


def patch_classes(module, class_names, tag) -> list:
    """Wrap ``step`` on each named class of ``module`` that defines its own (inherited steps are covered where
    they are defined). Returns the qualified names wrapped now or before."""
    done = []
    for cname in class_names:
        cls = getattr(module, cname, None)
        if cls is None or "step" not in vars(cls):
            continue
        _wrap.wrap(cls, "step", step_wrapper, tag)
        if _wrap.is_wrapped(cls, "step"):
            done.append(f"{module.__name__}.{cname}.step")
    return done


def unpatch_classes(module, class_names) -> None:
    for cname in class_names:
        cls = getattr(module, cname, None)
        if cls is not None:
            _wrap.unwrap(cls, "step")


def patched_classes(module, class_names) -> list:
    return [f"{module.__name__}.{c}.step" for c in class_names
            if getattr(module, c, None) is not None and _wrap.is_wrapped(getattr(module, c), "step")]


def hook_functions(target: str, class_names, tag: str):
    """``(patch, unpatch, patched)`` of a hook module wrapping ``step`` of ``class_names`` in module ``target``."""
    import sys

    def patch(module=None) -> list:
        """Wrap the optimizers' ``step`` (idempotent); returns what is wrapped."""
        return patch_classes(module or sys.modules[target], class_names, tag)

    def unpatch() -> None:
        module = sys.modules.get(target)
        if module is not None:
            unpatch_classes(module, class_names)

    def patched() -> list:
        module = sys.modules.get(target)
        return [] if module is None else patched_classes(module, class_names)

    return patch, unpatch, patched
