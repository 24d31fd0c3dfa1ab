"""Hook for `megatron.core.optimizer.optimizer`: ``step`` of the mixed-precision (incl.
Float16OptimizerWithFloat16Params), FP32 and chained optimizers.
"""
from . import _optimizer_step

TARGET = "megatron.core.optimizer.optimizer"
CLASSES = ('MixedPrecisionOptimizer', 'Float16OptimizerWithFloat16Params', 'FP32Optimizer', 'ChainedOptimizer')


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, CLASSES, __name__)
