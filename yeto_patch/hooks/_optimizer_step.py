"""The wrappers megatron-core optimizers get, and the patch/unpatch helpers the optimizer hook modules share.

- ``step``: the boundary runs after the OUTERMOST step returns (a ChainedOptimizer stepping wrapped inner
  optimizers fires once); before it, an optimizer-only training loop gets its engine started and the step's plan
  is made.
- ``_copy_main_params_to_model_params`` (the mixed-precision leaf optimizers): inside a counted step, after the
  leaf's inner update and before Megatron casts its FP32 masters into the model parameters (and, for the
  DistributedOptimizer, gathers them to the replicas), the engine installs the merged bases planned for this
  step into that leaf's masters; Megatron's own cast and gather then carry them to every parameter."""
from __future__ import annotations

from . import _wrap
from ._runtime import RUNTIME


def step_wrapper(wrapped, instance, args, kwargs):
    outer = RUNTIME.step_enter()
    counts = False
    try:
        counts = RUNTIME.before_outer_step(instance) if outer else False
        result = wrapped(*args, **kwargs)
    finally:
        RUNTIME.step_exit(counts)
    if counts:
        RUNTIME.after_outer_step(instance, result)
    return result


COPY = "_copy_main_params_to_model_params"


def copy_wrapper(wrapped, instance, args, kwargs):
    RUNTIME.before_param_copy(instance)
    return wrapped(*args, **kwargs)


WRAPPERS = {"step": step_wrapper, COPY: copy_wrapper}


def patch_targets(module, targets, tag) -> list:
    """Wrap each declared (class, method) of ``module`` that the class defines itself (inherited methods are
    covered where they are defined). Returns the qualified names wrapped now or before."""
    done = []
    for t in targets:
        cls = getattr(module, t.owner, None)
        if cls is None or t.attribute not in vars(cls):
            continue
        _wrap.wrap(cls, t.attribute, WRAPPERS[t.attribute], tag)
        if _wrap.is_wrapped(cls, t.attribute):
            done.append(f"{module.__name__}.{t.name}")
    return done


def hook_functions(target: str, targets, tag: str):
    """``(patch, unpatch, patched)`` of a hook module wrapping the declared optimizer methods (``step``,
    ``_copy_main_params_to_model_params``) of module ``target``."""
    import sys

    def patch(module=None) -> list:
        """Wrap the declared methods (idempotent); returns what is wrapped."""
        return patch_targets(module or sys.modules[target], targets, tag)

    def unpatch() -> None:
        module = sys.modules.get(target)
        for t in targets if module is not None else ():
            cls = getattr(module, t.owner, None)
            if cls is not None:
                _wrap.unwrap(cls, t.attribute)

    def patched() -> list:
        module = sys.modules.get(target)
        return [] if module is None else [
            f"{target}.{t.name}" for t in targets
            if getattr(module, t.owner, None) is not None and _wrap.is_wrapped(getattr(module, t.owner), t.attribute)]

    return patch, unpatch, patched
