"""Hook for `megatron.core.optimizer.distrib_optimizer`: ``step`` of DistributedOptimizer (its step is inherited
from MixedPrecisionOptimizer in current releases; wrapped here where a release defines its own) and its
``_copy_main_params_to_model_params`` (where merged bases are installed into its masters, see ``_optimizer_step``).
"""
from . import _optimizer_step
from ._targets import Target

TARGET = "megatron.core.optimizer.distrib_optimizer"
TARGETS = (Target(TARGET, "DistributedOptimizer", "step", required=False),  # inherited in 0.16-0.19
           # the install point of staged bases: after the inner update, before the cast to params and their gather
           Target(TARGET, "DistributedOptimizer", "_copy_main_params_to_model_params", required=False))
SUPPORTED_VERSIONS = {"megatron-core": ">=0.16"}


patch, unpatch, patched = _optimizer_step.hook_functions(TARGET, TARGETS, __name__)
