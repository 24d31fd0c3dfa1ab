"""Hook for `megatron.core.optimizer.cpu_offloading.hybrid_optimizer`: ``step`` of HybridDeviceOptimizer (host-
offloaded masters; normally stepped inside a DistributedOptimizer, so it only fires when it is the outermost
optimizer).
"""
from . import _optimizer_step
from ._targets import Target

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
TARGETS = (Target(TARGET, "HybridDeviceOptimizer", "step"),)
SUPPORTED_VERSIONS = {"megatron-core": ">=0.16"}


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, TARGETS, __name__)
