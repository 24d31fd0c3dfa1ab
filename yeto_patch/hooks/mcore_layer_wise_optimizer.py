"""Hook for `megatron.core.optimizer.layer_wise_optimizer`: ``step`` of LayerWiseDistributedOptimizer (a
ChainedOptimizer subclass that defines its own step in some releases).
"""
from . import _optimizer_step

TARGET = "megatron.core.optimizer.layer_wise_optimizer"
CLASSES = ('LayerWiseDistributedOptimizer',)


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, CLASSES, __name__)
