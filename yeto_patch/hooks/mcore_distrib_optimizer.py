"""Hook for `megatron.core.optimizer.distrib_optimizer`: ``step`` of DistributedOptimizer (its step is inherited
from MixedPrecisionOptimizer in current releases; wrapped here where a release defines its own).
"""
from . import _optimizer_step
from ._targets import Target

TARGET = "megatron.core.optimizer.distrib_optimizer"
TARGETS = (Target(TARGET, "DistributedOptimizer", "step", required=False),)  # inherited in 0.16-0.19
SUPPORTED_VERSIONS = {"megatron-core": ">=0.16"}
CLASSES = tuple(t.owner for t in TARGETS)


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, CLASSES, __name__)
