"""One canonical name and layout for every weight, whatever the megatron-core build of an island.

megatron-core ships several layer specs (``megatron/core/models/gpt/gpt_layer_specs.py``): the local spec
(megatron-core modules only: what runs without a GPU) and the Transformer Engine spec (GPU sites). They hold the
same weights under different parameter names and, for one kind of tensor, in a different layout across the
tensor-parallel ranks. An island names every weight the LOCAL spec's way, so an island built with Transformer
Engine and one built without it have the same manifest and merge:

- ``BUILD_NAMES``: parameter names inside a transformer layer that Transformer Engine's fused modules use,
  with the local spec's name (the same pairs megatron-core itself rewrites when it loads a TE checkpoint into
  a local model, ``post_training/modelopt/gpt/state_dict_hooks.py``, and the keys
  ``TransformerLayerSubmodules.sharded_state_dict_keys_map`` gives them in checkpoints);
- experts: SequentialMLP's ``experts.local_experts.<j>.<rest>`` and TEGroupedMLP's ``experts.<rest><j>`` are both
  named ``experts.<global expert>.<rest>`` (``names.py``);
- gated linear units (SwiGLU): each tensor-parallel rank's ``linear_fc1`` holds its part of the gate then its
  part of the up projection, so the full tensor is ``[gate; up]`` with stride 2 across the ranks. The local
  spec's linears say so (``partition_stride=2``); TEGroupedMLP's numbered expert weights say stride 1
  (megatron-core 0.19) or carry no tensor-parallel attributes at all (0.16), and Kitchen linears say stride 1.
  ``fc_layout`` gives every ``linear_fc1`` / ``linear_fc2`` its layout from what the module computes, not from
  those attributes.

What cannot be reconciled stops the island at start-up on every rank, naming the tensors and the option that
would align it (``names.ManifestError`` from ``names.local_params``, or the syncer's manifest refusal explained
by ``explain_refusal``).
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional, Tuple


class BuildName(NamedTuple):
    build: str        # parameter name inside a transformer layer in that build
    canonical: str    # the local spec's name: what the manifest says
    where: str        # which build / module names it so


_TE_QKV = "Transformer Engine spec: the input layer norm fused into linear_qkv (TELayerNormColumnParallelLinear)"
_TE_FC1 = ("Transformer Engine spec, dense MLP: the pre-MLP layer norm fused into linear_fc1 "
           "(TELayerNormColumnParallelLinear)")
_TE_MLA = "Transformer Engine spec, MLA with --qk-layernorm: the q/kv layer norms fused into the up-projections"
_TE_MLA_DOWN = "Transformer Engine spec, MLA with --mla-down-proj-fusion: the input layer norm fused"
_TE_FUSER = "Transformer Engine op fuser (--use-te-op-fuser), releases that build TEFusedMLP as te.ops.Sequential"
_TE_MAMBA = "Transformer Engine spec, Mamba layers: the norm fused into mixer.in_proj"

BUILD_NAMES: Tuple[BuildName, ...] = (
    BuildName("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight", _TE_QKV),
    BuildName("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias", _TE_QKV),
    BuildName("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight", _TE_FC1),
    BuildName("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias", _TE_FC1),
    BuildName("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight", _TE_MLA),
    BuildName("self_attention.linear_q_up_proj.layer_norm_bias", "self_attention.q_layernorm.bias", _TE_MLA),
    BuildName("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight", _TE_MLA),
    BuildName("self_attention.linear_kv_up_proj.layer_norm_bias", "self_attention.kv_layernorm.bias", _TE_MLA),
    BuildName("self_attention.linear_qkv_down_proj.layer_norm_weight", "input_layernorm.weight", _TE_MLA_DOWN),
    BuildName("self_attention.linear_qkv_down_proj.layer_norm_bias", "input_layernorm.bias", _TE_MLA_DOWN),
    BuildName("mlp.0.weight", "pre_mlp_layernorm.weight", _TE_FUSER),
    BuildName("mlp.0.bias", "pre_mlp_layernorm.bias", _TE_FUSER),
    BuildName("mlp.1.basic_ops.0.weight", "mlp.linear_fc1.weight", _TE_FUSER),
    BuildName("mlp.1.basic_ops.1.bias", "mlp.linear_fc1.bias", _TE_FUSER),
    BuildName("mlp.3.basic_ops.0.weight", "mlp.linear_fc2.weight", _TE_FUSER),
    BuildName("mlp.3.basic_ops.1.bias", "mlp.linear_fc2.bias", _TE_FUSER),
    BuildName("mixer.in_proj.layer_norm_weight", "norm.weight", _TE_MAMBA),
)
_BY_BUILD = {b.build: b.canonical for b in BUILD_NAMES}
_LAYER = re.compile(r"^(?P<head>(?:.+\.)?layers\.\d+\.)(?P<rest>.+)$")


def canonical_suffix(build: str) -> str:
    """The local spec's in-layer name for a build's in-layer name (itself when it is not mapped)."""
    return _BY_BUILD.get(build, build)


def canonical(global_name: str) -> Tuple[str, Optional[str]]:
    """(the canonical global name, the build's in-layer name it was mapped from or None)."""
    m = _LAYER.match(global_name)
    if m is None:
        return global_name, None
    head, rest = m.group("head"), m.group("rest")
    if rest.startswith("transformer_layer."):   # a multi-token-prediction layer wraps a transformer layer
        head, rest = head + "transformer_layer.", rest[len("transformer_layer."):]
    to = _BY_BUILD.get(rest)
    return (head + to, rest) if to is not None else (global_name, None)


# -------------------------------------------------------------------------------------------- layouts
_FC = re.compile(r"(?:^|\.)(linear_fc[12])\.(weight|bias)(\d*)$")


class Layout(NamedTuple):
    split: bool          # split over the tensor-parallel ranks
    partition_dim: int   # -1 when not split
    stride: int


def fc_layout(pname: str, attr_split: bool, attr_dim: int, attr_stride: int, tp_size: int,
              glu: Optional[bool], grouped: bool) -> Layout:
    """The layout of parameter `pname` across `tp_size` tensor-parallel ranks. For an MLP's ``linear_fc1``
    (column-parallel: split along dim 0; stride 2 for a gated linear unit) and ``linear_fc2`` (row-parallel:
    weight split along dim 1, bias whole) it is what the module computes; `grouped` (a TEGroupedMLP's numbered
    expert weights, whose attributes differ by release) derives the split itself. Anything else keeps its
    attributes (`attr_*`)."""
    m = _FC.search(pname)
    if m is None or tp_size <= 1 or (not grouped and not attr_split):
        return Layout(attr_split and tp_size > 1, attr_dim if attr_split and tp_size > 1 else -1,
                      attr_stride if attr_split and tp_size > 1 else 1)
    fc, kind = m.group(1), m.group(2)
    if fc == "linear_fc1":
        return Layout(True, 0, attr_stride if glu is None else 2 if glu else 1)
    if kind == "weight":
        return Layout(True, 1, 1)
    return Layout(False, -1, 1)


# -------------------------------------------------------------------------------------------- refusals
# (pattern in a tensor name, what differs, the option that aligns it); the first match explains a tensor
_HINTS = (
    (r"linear_q(kv)?_down_proj|linear_kv_down_proj", "MLA's fused q/kv down-projection",
     "--mla-down-proj-fusion (mla_down_proj_fusion)"),
    (r"\.(q|k|kv)_layernorm\.", "query/key layer norms", "--qk-layernorm (qk_layernorm)"),
    (r"layernorm\.bias$|\.norm\.bias$", "layer-norm biases (LayerNorm has one, RMSNorm none)",
     "--normalization (normalization)"),
    (r"linear_qkv\.bias$", "the QKV bias", "--add-qkv-bias / --disable-bias-linear (add_qkv_bias)"),
    (r"linear_(proj|fc1|fc2)\.bias$", "linear-layer biases", "--disable-bias-linear (add_bias_linear)"),
    (r"^output_layer\.weight$", "a separate output layer",
     "--untie-embeddings-and-output-weights (share_embeddings_and_output_weights)"),
    (r"position_embeddings", "learned position embeddings", "--position-embedding-type (position_embedding_type)"),
    (r"shared_experts", "shared experts", "--moe-shared-expert-intermediate-size"),
    (r"\.mlp\.(experts|router)\.", "mixture-of-experts layers",
     "--num-experts / --moe-layer-freq (num_moe_experts, moe_layer_freq)"),
    (r"linear_fc1\.", "the MLP's first projection (size or gated linear unit)",
     "--ffn-hidden-size / --swiglu (ffn_hidden_size, gated_linear_unit)"),
    (r"linear_qkv\.|linear_proj\.", "the attention projections",
     "--num-attention-heads / --group-query-attention --num-query-groups / --kv-channels"),
    (r"decoder\.layers\.\d+\.", "the number of layers", "--num-layers (num_layers)"),
    (r"word_embeddings|output_layer", "the vocabulary or hidden size", "--hidden-size / the tokenizer's vocabulary"),
)
_REFUSAL = re.compile(r"expected '(?P<a>[\w.]+)'(?: shape (?P<sa>\[[\d, ]*\]))?.*?"
                      r"got '(?P<b>[\w.]+)'(?: shape (?P<sb>\[[\d, ]*\]))?")
_EXTRA = re.compile(r"(?:unexpected extra entry|expected) '(?P<a>[\w.]+)'")


def _hint(name: str) -> Optional[Tuple[str, str]]:
    for pattern, what, option in _HINTS:
        if re.search(pattern, name):
            return what, option
    return None


def explain_refusal(message: str) -> str:
    """A sentence naming the tensors a syncer's manifest refusal (its first difference) is about and the option
    that would align the islands ('' when the text names no tensor)."""
    m = _REFUSAL.search(message or "")
    names = [m.group("a"), m.group("b")] if m else []
    if not names:
        e = _EXTRA.search(message or "")
        names = [e.group("a")] if e else []
    if not names:
        return ""
    if len(names) == 2 and names[0] == names[1]:
        hint = _hint(names[0])
        what = f"'{names[0]}' has another shape here ({m.group('sb')}) than in the run ({m.group('sa')})"
    else:
        hint = next((h for h in (_hint(n) for n in names) if h is not None), None)
        what = "the run has " + " where this island has ".join(f"'{n}'" for n in names) if len(names) == 2 \
            else f"'{names[0]}' is in one manifest only"
    tail = (f"; they differ in {hint[0]}: launch every island with the same {hint[1]}" if hint else
            "; launch every island with the same model configuration")
    return (f" [{what}{tail}. Transformer Engine and local-spec builds merge (their names are mapped, see "
            f"docs/launchers.md); model options must agree.]")
