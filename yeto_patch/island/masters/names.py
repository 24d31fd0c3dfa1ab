"""Global parameter names and full shapes of a Megatron model, identical on every parallel layout.

Every trainable parameter of the whole model gets one name and one full (un-sharded) shape:
- wrappers removed (DDP, Float16Module, anything with a `.module`);
- `decoder.layers.<k>` renumbered with the layer's global number (`TransformerLayer.layer_number - 1`, which
  includes the pipeline-stage offset and the virtual-pipeline chunk);
- expert parameters named `...mlp.experts.<global expert>.<rest>` whatever the expert implementation
  (SequentialMLP `local_experts.<j>.<rest>` or TEGroupedMLP `<rest><j>`), the global index taken from the
  experts container's `local_expert_indices` (older megatron-core) or the MoE layer's (newer); an expert
  parameter with no global index is an error;
- the full shape is the local shape times the tensor-parallel size (expert-tensor-parallel size for expert
  weights) along `partition_dim`;
- a tied output layer (`share_embeddings_and_output_weights` on the last pipeline stage) is a copy of
  `embedding.word_embeddings.weight`: one entry, both copies written;
- frozen parameters (`requires_grad=False`) and buffers are excluded;
- whatever the build: Transformer Engine's fused names are the local spec's (`builds.BUILD_NAMES`, e.g.
  `self_attention.linear_qkv.layer_norm_weight` -> `input_layernorm.weight`) and every MLP's `linear_fc1` /
  `linear_fc2` has the layout the module computes (`builds.fc_layout`: `[gate; up]` for SwiGLU), so islands
  built with and without Transformer Engine have the same manifest (`Manifest.mapped` says what was renamed).

Vocabulary padding: Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by x TP`, so
islands with different TP sizes disagree on the embedding / output rows unless the real vocabulary size is
known. With `real_vocab_size` the entries keep only the real rows (padding rows never see data and are left
untouched on write); without it the padded shape is used and `Manifest.check_matches` explains a mismatch.
`merge_padding=True` (what the engine uses) keeps every padded row (the output layer's padding rows do train:
their logits are in the softmax), `real_vocab_size` then only bounds `vocab_rows`: {global name: rows} gives an
entry the row count of the run's manifest instead, so an island whose padding differs still merges the common
rows: its own rows beyond are kept out of the entry (local), the run's rows beyond its own are virtual here
(read as zeros, never installed; see masters.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import List, Optional, Sequence, Tuple

import torch

from yeto_patch.island.masters import builds

VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")
TIED_NAME = "embedding.word_embeddings.weight"
MASTER_DTYPE = "float32"


class ManifestError(ValueError):
    """The model cannot be named consistently (or two manifests do not match)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    full_shape: Tuple[int, ...]
    dtype: str = MASTER_DTYPE   # what travels and what the masters hold

    @property
    def numel(self) -> int:
        n = 1
        for s in self.full_shape:
            n *= s
        return n


@dataclasses.dataclass
class LocalParam:
    """One local parameter of this rank and where it sits in its global entry."""
    entry: int                  # index into Manifest.entries
    name: str                   # global name
    local_name: str             # name inside its model chunk (wrappers removed)
    chunk: int                  # model chunk index (virtual pipeline)
    param: torch.nn.Parameter
    shard: int                  # tensor-parallel rank along partition_dim (0 if not split)
    nshards: int                # tensor-parallel size along partition_dim (1 if not split)
    partition_dim: int          # -1 if not split
    stride: int
    is_expert: bool
    tied_copy: bool             # the output-layer copy of a tied embedding
    padded_shape: Tuple[int, ...]   # full shape including vocabulary padding rows
    full_shape: Tuple[int, ...]     # manifest shape (real vocabulary rows when known)
    mapped_from: Optional[str] = None   # the build's in-layer name when it is not the canonical one

    @property
    def local_numel(self) -> int:
        return self.param.numel()


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def unwrap(module):
    """Remove DDP / Float16Module (anything exposing `.module`)."""
    seen = 0
    while hasattr(module, "module") and isinstance(getattr(module, "module"), torch.nn.Module):
        module = module.module
        seen += 1
        if seen > 16:
            break
    return module


def _moe_types():
    types = []
    try:
        from megatron.core.transformer.moe.moe_layer import MoELayer
        types.append(MoELayer)
    except Exception:  # pragma: no cover - megatron without MoE
        pass
    return tuple(types)


def _layer_types():
    from megatron.core.transformer.transformer_layer import TransformerLayer
    return (TransformerLayer,)


def _expert_rest(rel: str, n_local: int) -> Tuple[int, str, bool]:
    """Split a parameter path inside an experts container into (local expert index, rest, grouped): grouped is
    True for TEGroupedMLP's numbered weights."""
    m = re.match(r"^local_experts\.(\d+)\.(.+)$", rel)          # SequentialMLP
    if m:
        return int(m.group(1)), m.group(2), False
    m = re.match(r"^(.+?\.(?:weight|bias))(\d+)$", rel)          # TEGroupedMLP: linear_fc1.weight<j>
    if m:
        return int(m.group(2)), m.group(1), True
    raise ManifestError(
        f"expert parameter 'experts.{rel}' holds all {n_local} local experts in one tensor (the legacy "
        f"GroupedMLP of --moe-use-legacy-grouped-gemm, or --moe-grouped-gemm without Transformer Engine on "
        f"megatron-core < 0.17); yeto-patch names every expert on its own so that islands of any expert-parallel "
        f"layout merge: launch without --moe-use-legacy-grouped-gemm (TEGroupedMLP with Transformer Engine, or "
        f"SequentialMLP without --moe-grouped-gemm)")


def _glu(modules: dict, pname: str) -> Optional[bool]:
    """Whether the MLP owning `pname` (its linear_fc1 / linear_fc2 sits in it) is a gated linear unit."""
    parts = pname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        cfg = getattr(modules.get(".".join(parts[:i])), "config", None)
        if cfg is not None and hasattr(cfg, "gated_linear_unit"):
            return bool(cfg.gated_linear_unit)
    return None


def _tp(is_expert: bool) -> Tuple[int, int]:
    from megatron.core import parallel_state as ps
    if is_expert:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _global_numbering(modules: dict, layer_types, moe_types) -> Tuple[dict, dict]:
    """(module path -> global layer number, 0-based; experts container path -> the global indices of its local
    experts, None when neither it nor its MoE layer says) of one model chunk."""
    layer_of, experts_of = {}, {}
    for path, mod in modules.items():
        if isinstance(mod, layer_types) and getattr(mod, "layer_number", None) is not None \
                and not getattr(mod, "is_mtp_layer", False):
            layer_of[path] = int(mod.layer_number) - 1
        if moe_types and isinstance(mod, moe_types) and hasattr(mod, "experts"):
            idx = getattr(mod.experts, "local_expert_indices", None)
            if idx is None:
                idx = getattr(mod, "local_expert_indices", None)
            epath = f"{path}.experts" if path else "experts"
            experts_of[epath] = None if idx is None else [int(i) for i in idx]
    return layer_of, experts_of


def _global_name(pname: str, layer_of: dict, experts_of: dict) -> Tuple[str, bool, bool]:
    """(the name of local parameter `pname` with global layer and expert numbers, is it an expert's, is it a
    grouped experts tensor)."""
    gname = pname
    for lpath in _prefixes(pname):
        if lpath in layer_of:
            head = lpath.rpartition(".")[0]
            gname = f"{head}.{layer_of[lpath]}" + pname[len(lpath):]
            break
    for epath, idx in experts_of.items():
        if pname.startswith(epath + "."):
            if idx is None:
                raise ManifestError(f"expert parameter '{pname}' has no global expert index: neither its experts "
                                    f"container nor its MoE layer carries local_expert_indices")
            j, rest, grouped = _expert_rest(pname[len(epath) + 1:], len(idx))
            if j >= len(idx):
                raise ManifestError(f"expert parameter '{pname}': local expert {j} >= {len(idx)} local experts")
            # rebuild the name from the globally numbered prefix
            gprefix = gname[: len(gname) - len(pname) + len(epath)] if gname != pname else epath
            return f"{gprefix}.{idx[j]}.{rest}", True, grouped
    return gname, False, False


def local_params(model_chunks, real_vocab_size: Optional[int] = None, vocab_rows: Optional[dict] = None,
                 merge_padding: bool = False) -> List[Tuple[str, LocalParam]]:
    """This rank's trainable parameters with their global names (no communication). `entry` is left -1.
    See the module docstring for the vocabulary options."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    layer_types, moe_types = _layer_types(), _moe_types()
    out = []
    seen = {}
    for ci, chunk in enumerate(chunks):
        model = unwrap(chunk)
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        modules = dict(model.named_modules())
        layer_of, experts_of = _global_numbering(modules, layer_types, moe_types)
        for pname, p in model.named_parameters():
            if not p.requires_grad:
                continue
            gname, is_expert, grouped = _global_name(pname, layer_of, experts_of)
            gname, mapped_from = builds.canonical(gname)
            tied_copy = False
            if pname == "output_layer.weight" and tied:
                gname, tied_copy = TIED_NAME, True
            if gname in seen:
                raise ManifestError(f"two local parameters map to the global name '{gname}': "
                                    f"'{seen[gname]}' and '{pname}' (chunk {ci})")
            seen[gname] = pname
            # full shape
            tp_size, tp_rank = _tp(is_expert)
            lay = builds.fc_layout(pname, bool(getattr(p, "tensor_model_parallel", False)),
                                   int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1)),
                                   tp_size, _glu(modules, pname), grouped)
            split, pdim, stride = lay.split, lay.partition_dim, lay.stride
            shape = list(p.shape)
            if split:
                if shape[pdim] % stride:
                    raise ManifestError(f"'{pname}': local size {shape[pdim]} along dim {pdim} is not a "
                                        f"multiple of partition_stride {stride}")
                shape[pdim] *= tp_size
            padded = tuple(shape)
            full = padded
            if pname in VOCAB_NAMES:
                full = _vocab_shape(pname, gname, padded, pdim, stride, real_vocab_size, vocab_rows, merge_padding)
            out.append((gname, LocalParam(
                entry=-1, name=gname, local_name=pname, chunk=ci, param=p,
                shard=tp_rank if split else 0, nshards=tp_size if split else 1, partition_dim=pdim,
                stride=stride, is_expert=is_expert, tied_copy=tied_copy, padded_shape=padded,
                full_shape=full, mapped_from=mapped_from)))
    return out


def _vocab_shape(pname, gname, padded, pdim, stride, real, rows_of, merge_padding) -> Tuple[int, ...]:
    if real is not None and real > padded[0]:
        raise ManifestError(f"real vocabulary size {real} is larger than the model's {padded[0]} rows of '{pname}'")
    rows = (rows_of or {}).get(gname)
    if rows is None:
        rows = padded[0] if merge_padding or real is None else int(real)
    if rows == padded[0]:
        return padded
    if pdim not in (-1, 0) or stride != 1:
        raise ManifestError(f"'{pname}' is not split along the vocabulary dimension")
    if real is not None and rows < real:
        raise ManifestError(f"the run's manifest has {rows} rows of '{gname}', fewer than the real vocabulary "
                            f"size {real} of this island")
    if not 0 < int(rows) <= 1 << 31:
        raise ManifestError(f"'{gname}': {rows} rows is out of range")
    return (int(rows),) + tuple(padded[1:])


def _prefixes(pname: str):
    parts = pname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        yield ".".join(parts[:i])


@dataclasses.dataclass
class Manifest:
    """Global ordered entries (identical on every rank and layout) plus this rank's local view."""
    entries: List[Entry]
    local: List[LocalParam]
    real_vocab_size: Optional[int] = None
    vocab_padded_rows: dict = dataclasses.field(default_factory=dict)   # name -> padded rows on this layout
    mapped: dict = dataclasses.field(default_factory=dict)   # (build's in-layer name, canonical) -> tensors

    def __post_init__(self):
        self.index = {e.name: i for i, e in enumerate(self.entries)}

    def __len__(self):
        return len(self.entries)

    @property
    def names(self) -> List[str]:
        return [e.name for e in self.entries]

    def wire_manifest(self) -> List[Tuple[str, Tuple[int, ...], str]]:
        """(name, full_shape, dtype) triples, e.g. for wire.auth.manifest_digest."""
        return [(e.name, tuple(e.full_shape), e.dtype) for e in self.entries]

    def digest(self) -> str:
        data = json.dumps([[n, list(s), d] for n, s, d in self.wire_manifest()], separators=(",", ":"))
        return hashlib.sha256(data.encode()).hexdigest()

    def total_numel(self, indices: Optional[Sequence[int]] = None) -> int:
        idx = range(len(self.entries)) if indices is None else indices
        return sum(self.entries[i].numel for i in idx)

    def check_matches(self, other: Sequence) -> None:
        """Raise ManifestError naming the first difference with `other` (Entries or (name, shape, dtype))."""
        theirs = [(e.name, tuple(e.full_shape), e.dtype) if isinstance(e, Entry) else (e[0], tuple(e[1]), e[2])
                  for e in other]
        mine = self.wire_manifest()
        if mine == theirs:
            return
        tn = {n: (s, d) for n, s, d in theirs}
        mn = {n: (s, d) for n, s, d in mine}
        for name in VOCAB_NAMES[:1] + ("output_layer.weight",):
            if name in tn and name in mn and tn[name][0] != mn[name][0] and tn[name][0][1:] == mn[name][0][1:]:
                raise ManifestError(vocab_mismatch_message(name, mn[name][0][0], tn[name][0][0],
                                                           self.real_vocab_size))
        missing = [n for n in mn if n not in tn]
        extra = [n for n in tn if n not in mn]
        if missing or extra:
            raise ManifestError(f"parameter manifests differ: {len(missing)} names only here "
                                f"(e.g. {missing[:3]}), {len(extra)} only there (e.g. {extra[:3]})")
        for n, (s, d) in mn.items():
            if tn[n] != (s, d):
                raise ManifestError(f"parameter '{n}' is {list(s)} {d} here but {list(tn[n][0])} {tn[n][1]} there")
        raise ManifestError("parameter manifests list the same parameters in a different order")


def run_vocab_rows(refusal: str, mine: Sequence) -> Optional[dict]:
    """{name: rows} when a syncer's manifest refusal (its first-difference text) says the run's manifest differs
    from `mine` only in the row count of a vocabulary entry; None otherwise."""
    m = re.search(r"entry (\d+): expected '([\w.]+)' shape \[([\d, ]*)\] (\w+), got '([\w.]+)' shape "
                  r"\[([\d, ]*)\] (\w+)", refusal or "")
    if m is None:
        return None
    i, name = int(m.group(1)), m.group(2)
    theirs = tuple(int(x) for x in m.group(3).split(",") if x.strip())
    if name not in VOCAB_NAMES or m.group(5) != name or i >= len(mine) or mine[i][0] != name:
        return None
    ours = tuple(mine[i][1])
    if len(theirs) != len(ours) or theirs[1:] != ours[1:] or theirs[0] == ours[0] or not 0 < theirs[0] <= 1 << 31:
        return None
    return {name: theirs[0]}


def vocab_rows_message(manifest: "Manifest", name: str, rows: int) -> str:
    """What an island whose padded vocabulary differs from the run's says at start-up (every rank): `manifest`
    is the one the syncer refused (this island's padded rows)."""
    mine = manifest.entries[manifest.index[name]].full_shape[0]
    real = manifest.real_vocab_size
    common = min(rows, mine)
    local = (f"this island's padding rows {common}..{mine - 1} stay local" if mine > rows else
             f"the run's rows {mine}..{rows - 1} are not held here (this island pushes zero changes for them and "
             f"does not install them)")
    return (f"'{name}': the run's manifest (fixed by the first island that joined) has {rows} rows, this island "
            f"pads the vocabulary to {mine}; rows 0..{common - 1} are merged"
            + ("" if real is None else f" (the real vocabulary is {real} rows)") + f", {local}. Megatron pads "
            f"the vocabulary to a multiple of --make-vocab-size-divisible-by x tensor-parallel size: launch every "
            f"island with a --make-vocab-size-divisible-by that gives the same padded size on every layout to merge "
            f"every row and end with identical tensors.")


def vocab_mismatch_message(name: str, mine: int, theirs: int, real: Optional[int]) -> str:
    return (f"'{name}' has {mine} rows here and {theirs} rows on the other side. Megatron pads the vocabulary "
            f"to a multiple of --make-vocab-size-divisible-by x tensor-parallel size, so islands with different "
            f"TP sizes disagree on the padded rows. Either give yeto-patch the real vocabulary size (the padding "
            f"rows never see data and are not merged) or launch every island with a --make-vocab-size-divisible-by "
            f"value that yields the same padded size on every layout"
            + ("" if real is None else f" (real vocabulary size given here: {real})") + ".")


def build_manifest(model_chunks, *, real_vocab_size: Optional[int] = None, vocab_rows: Optional[dict] = None,
                   merge_padding: bool = False, comm=None) -> Manifest:
    """Collective over the island: every rank contributes its local names; all get the same Manifest."""
    from yeto_patch.island.masters.collective import IslandComm
    comm = comm or IslandComm()
    err, local = None, []
    try:
        local = local_params(model_chunks, real_vocab_size, vocab_rows, merge_padding)
    except Exception as e:  # noqa: BLE001 - raised on every rank
        err = e
    comm.agree(err, "build_manifest: naming local parameters")
    mine = [[n, list(lp.full_shape), lp.mapped_from] for n, lp in local]
    gathered = comm.all_gather_json(mine, "build_manifest: gather names")
    shapes, mapped = {}, {}
    err = None
    for r, items in enumerate(gathered):
        for n, s, was in items:
            s = tuple(s)
            if was is not None and n not in shapes:
                key = (was, builds.canonical_suffix(was))
                mapped[key] = mapped.get(key, 0) + 1
            if n in shapes and shapes[n][0] != s:
                err = ManifestError(f"'{n}' has full shape {list(shapes[n][0])} on rank {shapes[n][1]} but "
                                    f"{list(s)} on rank {r}")
                break
            shapes.setdefault(n, (s, r))
    comm.agree(err, "build_manifest: check shapes")
    names = sorted(shapes, key=_natural_key)
    entries = [Entry(n, shapes[n][0]) for n in names]
    index = {n: i for i, n in enumerate(names)}
    lps = []
    padded_rows = {}
    for n, lp in local:
        lp.entry = index[n]
        lps.append(lp)
        if lp.local_name in VOCAB_NAMES:
            padded_rows[n] = lp.padded_shape[0]
    man = Manifest(entries=entries, local=lps, real_vocab_size=real_vocab_size, vocab_padded_rows=padded_rows,
                   mapped=mapped)
    if mapped and comm.rank == 0:
        _log_mapped(mapped)
    return man


_said_mapped = set()


def _log_mapped(mapped: dict) -> None:
    """Once per process: which build names this island's manifest renamed (rank 0)."""
    import logging
    new = {k: v for k, v in mapped.items() if k not in _said_mapped}
    if new:
        _said_mapped.update(new)
        logging.getLogger("yeto_patch").info(
            "yeto-patch: this island's build names some weights otherwise than megatron-core's local spec; the "
            "manifest uses the local spec's names: %s", "; ".join(f"'{a}' -> '{b}' ({n} tensors)"
                                                             for (a, b), n in sorted(new.items())))
