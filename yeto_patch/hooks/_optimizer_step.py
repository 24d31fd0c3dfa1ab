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


def hook_functions(target: str, targets, tag: str):
    """``(patch, unpatch, patched)`` of a hook module wrapping the declared optimizer methods (``step``,
    ``_copy_main_params_to_model_params``) of module ``target`` (``_wrap.hook``)."""
    return _wrap.hook(target, [(t.owner, t.attribute, WRAPPERS[t.attribute]) for t in targets], tag)
