"""Hook for `megatron.core.optimizer.layer_wise_optimizer`: ``step`` of LayerWiseDistributedOptimizer (a
ChainedOptimizer subclass that defines its own step in some releases).
"""
from . import _optimizer_step
from ._targets import Target

TARGET = "megatron.core.optimizer.layer_wise_optimizer"
TARGETS = (Target(TARGET, "LayerWiseDistributedOptimizer", "step", required=False),)  # own step in 0.16, not 0.19
SUPPORTED_VERSIONS = {"megatron-core": ">=0.16"}


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, TARGETS, __name__)
