"""Hook for `megatron.core.optimizer.distrib_optimizer`: ``step`` of DistributedOptimizer (its step is inherited
from MixedPrecisionOptimizer in current releases; wrapped here where a release defines its own).
"""
import sys

from . import _optimizer_step

TARGET = "megatron.core.optimizer.distrib_optimizer"
CLASSES = ('DistributedOptimizer',)


def patch(module=None) -> list:
    """Wrap the optimizers' ``step`` (idempotent); returns what is wrapped."""
    module = module or sys.modules[TARGET]
    return _optimizer_step.patch_classes(module, CLASSES, __name__)


def unpatch() -> None:
    module = sys.modules.get(TARGET)
    if module is not None:
        _optimizer_step.unpatch_classes(module, CLASSES)


def patched() -> list:
    module = sys.modules.get(TARGET)
    return [] if module is None else _optimizer_step.patched_classes(module, CLASSES)
