"""Hook for `megatron.core.optimizer.distrib_optimizer`: ``step`` of DistributedOptimizer (its step is inherited
from MixedPrecisionOptimizer in current releases; wrapped here where a release defines its own).
"""
from . import _optimizer_step

TARGET = "megatron.core.optimizer.distrib_optimizer"
CLASSES = ('DistributedOptimizer',)


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, CLASSES, __name__)
