"""Hook for `megatron.core.optimizer.optimizer`: ``step`` of the mixed-precision (incl.
Float16OptimizerWithFloat16Params), FP32 and chained optimizers.
"""
from . import _optimizer_step
from ._targets import Target

TARGET = "megatron.core.optimizer.optimizer"
TARGETS = (Target(TARGET, "MixedPrecisionOptimizer", "step"),
           Target(TARGET, "Float16OptimizerWithFloat16Params", "step", required=False),  # inherits it in 0.16-0.19
           Target(TARGET, "FP32Optimizer", "step"),
           Target(TARGET, "ChainedOptimizer", "step"))
SUPPORTED_VERSIONS = {"megatron-core": ">=0.16"}
CLASSES = tuple(t.owner for t in TARGETS)


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, CLASSES, __name__)
