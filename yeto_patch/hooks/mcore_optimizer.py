"""Hook for `megatron.core.optimizer.optimizer`: ``step`` of the mixed-precision (incl.
Float16OptimizerWithFloat16Params), FP32 and chained optimizers, and the ``_copy_main_params_to_model_params`` of
Float16OptimizerWithFloat16Params (where merged bases are installed into its masters, see ``_optimizer_step``).
"""
from . import _optimizer_step
from ._targets import Target

TARGET = "megatron.core.optimizer.optimizer"
TARGETS = (Target(TARGET, "MixedPrecisionOptimizer", "step"),
           Target(TARGET, "Float16OptimizerWithFloat16Params", "step", required=False),  # inherits it in 0.16-0.19
           Target(TARGET, "FP32Optimizer", "step"),
           Target(TARGET, "ChainedOptimizer", "step"),
           # the install point of staged bases: after the inner update, before Megatron casts masters to params
           Target(TARGET, "Float16OptimizerWithFloat16Params", "_copy_main_params_to_model_params", required=False))
SUPPORTED_VERSIONS = {"megatron-core": ">=0.16"}


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, TARGETS, __name__)
