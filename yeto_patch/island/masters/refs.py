"""Where an island rank's FP32 masters live: one ``MasterRef`` per model parameter this rank holds a master for,
found in the DistributedOptimizer shards, Float16OptimizerWithFloat16Params main params, FP32Optimizer params or
HybridDeviceOptimizer host masters (any of them inside a ChainedOptimizer). Used by ``masters.MasterView``."""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

from yeto_patch.island.masters.collective import IslandError

__all__ = ["MasterRef", "leaf_optimizers", "find_masters", "flat_view", "same_storage"]


# ---------------------------------------------------------------------------------------------------------
# where the FP32 masters live
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MasterRef:
    """The FP32 master of local flat elements [start, end) of one model parameter, on this rank."""
    start: int
    end: int
    master: torch.Tensor                 # 1-D, length end-start (float32, possibly host)
    extra_fp32: List[torch.Tensor]       # other FP32 copies to keep equal (1-D, same length)
    extra_lowp: List[torch.Tensor]       # low-precision shard copies not sharing the model param's storage
    kind: str
    leaf: int = 0                        # id() of the leaf optimizer that holds this master
    cast_by_megatron: bool = False       # the leaf's _copy_main_params_to_model_params casts it into the param


def leaf_optimizers(optimizer) -> list:
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is None:
        return [optimizer]
    out = []
    for o in subs:
        out.extend(leaf_optimizers(o))
    return out


def flat_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except Exception:
        return False


def find_masters(optimizer) -> Dict[int, MasterRef]:
    """id(model param) -> MasterRef for every parameter this rank holds a master for."""
    out: Dict[int, MasterRef] = {}
    for o in leaf_optimizers(optimizer):
        before = set(out)
        _find_leaf_masters(o, out)
        for k in set(out) - before:
            ref = out[k]
            ref.leaf = id(o)
            ref.cast_by_megatron = ref.kind in ("DistributedOptimizer", "Float16Optimizer")
    return out


def _find_leaf_masters(o, out: Dict[int, MasterRef]) -> None:
    """The masters of one leaf optimizer `o`, added to `out` (id(model param) -> MasterRef)."""
    cls = type(o).__name__
    if hasattr(o, "model_param_group_index_map") and hasattr(o, "_get_model_param_range_map"):
        precision_aware = bool(getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                                       getattr(o.config, "use_precision_aware_optimizer", False)))
        inner = o.optimizer
        is_hdo = type(inner).__name__ == "HybridDeviceOptimizer"
        for p, (gi, go) in o.model_param_group_index_map.items():
            rng = o._get_model_param_range_map(p)["param"]
            start, end = int(rng.start), int(rng.end)
            opt_param = inner.param_groups[gi]["params"][go]
            if precision_aware:
                if not is_hdo:
                    raise IslandError(
                        "DistributedOptimizer with the precision-aware optimizer keeps its FP32 masters inside "
                        f"{type(inner).__name__}'s state; yeto-patch supports that layout only with "
                        "HybridDeviceOptimizer (--optimizer-cpu-offload)")
                master = inner.param_to_inner_param.get(opt_param, opt_param)
                extras = []
                for cand in (inner.param_to_fp32_param.get(opt_param),
                             inner.gpu_params_map_cpu_copy.get(opt_param),
                             inner.state.get(opt_param, {}).get("master_param")):
                    if torch.is_tensor(cand) and cand is not master and not same_storage(cand, master) \
                            and all(not same_storage(cand, x) for x in extras):
                        extras.append(flat_view(cand))
                lowp = [] if same_storage(opt_param, p) or opt_param is master else [flat_view(opt_param)]
                out[id(p)] = MasterRef(start, end, flat_view(master), extras, lowp, "HybridDeviceOptimizer")
            else:
                if opt_param.numel() != end - start:
                    raise IslandError(f"internal: DistributedOptimizer shard of {tuple(p.shape)} has "
                                      f"{opt_param.numel()} elements, range says {end - start}")
                out[id(p)] = MasterRef(start, end, flat_view(opt_param), [], [], "DistributedOptimizer")
    elif cls == "Float16OptimizerWithFloat16Params" or hasattr(o, "fp32_from_float16_groups"):
        for g16, g32 in zip(o.float16_groups, o.fp32_from_float16_groups):
            for p, m in zip(g16, g32):
                out[id(p)] = MasterRef(0, p.numel(), flat_view(m), [], [], "Float16Optimizer")
        for g in o.fp32_from_fp32_groups:
            for p in g:
                out[id(p)] = MasterRef(0, p.numel(), flat_view(p), [], [], "Float16Optimizer(fp32 param)")
    elif cls == "FP32Optimizer" or hasattr(o, "optimizer"):
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                if p.dtype != torch.float32:
                    raise IslandError(f"{cls}: parameter of dtype {p.dtype} has no FP32 master")
                out[id(p)] = MasterRef(0, p.numel(), flat_view(p), [], [], "FP32Optimizer")
    else:
        raise IslandError(f"unsupported optimizer {cls}: cannot find its FP32 masters")
