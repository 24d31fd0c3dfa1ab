"""TEST-ONLY: give a real local-spec megatron-core model the parameter names (and tensor-parallel attributes) the
Transformer Engine spec gives the same weights, without Transformer Engine (it cannot be installed on CPU).

What the TE spec of megatron-core (``get_gpt_layer_with_transformer_engine_submodules``) builds differently:
- dense layers: ``input_layernorm`` is an IdentityOp and the norm lives in ``self_attention.linear_qkv``
  (TELayerNormColumnParallelLinear: ``layer_norm_weight`` / ``layer_norm_bias``); the same for
  ``pre_mlp_layernorm`` and ``mlp.linear_fc1``. MoE layers keep ``pre_mlp_layernorm`` (a TENorm);
- experts (``--moe-grouped-gemm``): TEGroupedMLP holds ``experts.linear_fc1.weight<j>`` / ``bias<j>`` and
  ``experts.linear_fc2.weight<j>`` for its local experts j, marked by megatron-core 0.19
  (``_set_expert_parameter_attributes``) as tensor-parallel along dim 0 / dim 1 with partition_stride 1, and by
  0.16 not at all (TE's parallel_mode is cleared before TE registers them).

The Parameter objects stay the same (the optimizer and its FP32 masters are untouched), only where they are
registered changes; the old attribute stays reachable for the local modules' forward (kept in the module's
``__dict__``), so the twin still trains and evaluates exactly like the model it was made from.
"""
from __future__ import annotations

import torch


def _move(src: torch.nn.Module, name: str, dst: torch.nn.Module, new_name: str):
    if src._parameters.get(name) is None:
        return None
    p = src._parameters.pop(name)
    src.__dict__[name] = p          # the local module's forward still finds it
    dst.register_parameter(new_name, p)
    return p


def _unwrap(m):
    while hasattr(m, "module") and isinstance(m.module, torch.nn.Module):
        m = m.module
    return m


def make_twin(model_chunks, release: str = "0.19") -> list:
    """Rename in place; returns [(local name, TE name)] of what moved (for the test's own check)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer
    moved = []
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for path, layer in list(model.named_modules()):
            if not isinstance(layer, TransformerLayer):
                continue
            qkv = layer.self_attention.linear_qkv
            for k in ("weight", "bias"):
                if _move(layer.input_layernorm, k, qkv, f"layer_norm_{k}") is not None:
                    moved.append((f"{path}.input_layernorm.{k}", f"{path}.self_attention.linear_qkv.layer_norm_{k}"))
            if isinstance(layer.mlp, MoELayer):
                moved += _grouped_experts(path, layer.mlp, release)
            else:
                fc1 = layer.mlp.linear_fc1
                for k in ("weight", "bias"):
                    if _move(layer.pre_mlp_layernorm, k, fc1, f"layer_norm_{k}") is not None:
                        moved.append((f"{path}.pre_mlp_layernorm.{k}", f"{path}.mlp.linear_fc1.layer_norm_{k}"))
    return moved


def _grouped_experts(path, moe, release):
    experts = moe.experts
    groups = {"linear_fc1": torch.nn.Module(), "linear_fc2": torch.nn.Module()}
    moved = []
    for j, expert in enumerate(experts.local_experts):
        for fc, holder in groups.items():
            for k in ("weight", "bias"):
                p = _move(getattr(expert, fc), k, holder, f"{k}{j}")
                if p is None:
                    continue
                moved.append((f"{path}.mlp.experts.local_experts.{j}.{fc}.{k}", f"{path}.mlp.experts.{fc}.{k}{j}"))
                split = fc == "linear_fc1" or k == "weight"
                if release == "0.19":
                    p.tensor_model_parallel = split
                    if split:
                        p.partition_dim, p.partition_stride = (0 if fc == "linear_fc1" else 1), 1
                else:
                    p.tensor_model_parallel = False
                    for a in ("partition_dim", "partition_stride"):
                        if hasattr(p, a):
                            delattr(p, a)
    for fc, holder in groups.items():
        experts.add_module(fc, holder)
    return moved
