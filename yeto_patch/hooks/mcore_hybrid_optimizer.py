"""Hook for `megatron.core.optimizer.cpu_offloading.hybrid_optimizer`: ``step`` of HybridDeviceOptimizer (host-
offloaded masters; normally stepped inside a DistributedOptimizer, so it only fires when it is the outermost
optimizer).
"""
import sys

from . import _optimizer_step

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
CLASSES = ('HybridDeviceOptimizer',)


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
