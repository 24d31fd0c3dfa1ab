"""Hook for `megatron.core.optimizer.cpu_offloading.hybrid_optimizer`: ``step`` of HybridDeviceOptimizer (host-
offloaded masters; normally stepped inside a DistributedOptimizer, so it only fires when it is the outermost
optimizer).
"""
from . import _optimizer_step

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
CLASSES = ('HybridDeviceOptimizer',)


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, CLASSES, __name__)
