"""Test-only: the full model of a megatron-core job as float32 numpy arrays under layout-independent names,
gathered with megatron's own accessors and groups (independent of yeto-patch's island code)."""
import torch
import torch.distributed as dist


def _leaf_optimizers(opt):
    subs = getattr(opt, "chained_optimizers", None)
    return [opt] if subs is None else [o for s in subs for o in _leaf_optimizers(s)]


def _masters(optimizer):
    main_of = {}
    for o in _leaf_optimizers(optimizer):
        if hasattr(o, "model_param_group_index_map"):        # DistributedOptimizer: sharded over DP
            for p in [p for b in o.buffers for p in b.params]:   # the same order on every DP rank
                full = torch.zeros(p.numel(), dtype=torch.float32)
                if p in o.model_param_group_index_map:
                    rng = o._get_model_param_range_map(p)["param"]
                    full[rng.start:rng.end] = o._get_main_param_and_optimizer_states(p)["param"].detach().float()
                dist.all_reduce(full, group=o.data_parallel_group)
                main_of[p] = full.view(p.shape)
        elif hasattr(o, "fp32_from_float16_groups"):
            for g16, g32 in zip(o.float16_groups, o.fp32_from_float16_groups):
                for p, m in zip(g16, g32):
                    main_of[p] = m.detach().clone()
            for g in o.fp32_from_fp32_groups:
                for p in g:
                    main_of[p] = p.detach().clone()
        else:
            for g in o.optimizer.param_groups:
                for p in g["params"]:
                    main_of[p] = p.detach().clone()
    return main_of


def full_model(model_chunks, optimizer, num_layers, tied=True, tied_copy=False):
    """{"master/<name>": fp32 master, "param/<name>": model param as fp32} for the parameters whose TP-rank-0 /
    DP-rank-0 copy (expert-TP / expert-DP rank 0 for experts, named by global expert index:
    "decoder.layers.<l>.mlp.experts.<e>.<rest>") lives on this rank (collective over the job: call on every
    rank). tied_copy: also the last pipeline stage's copy of a tied output layer, as "output_layer.weight(tied)"
    (only when it is a separate tensor there, i.e. with pipeline parallelism)."""
    from megatron.core import parallel_state as ps
    main_of = _masters(optimizer)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    per_chunk = num_layers // (pp * len(model_chunks))
    out = {}
    for ci, chunk in enumerate(model_chunks):
        while hasattr(chunk, "module"):
            chunk = chunk.module
        for name, p in chunk.named_parameters():
            bits = name.split(".")
            expert = "local_experts" in bits     # SequentialMLP: gathered over the expert groups
            g = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            pieces = {"master": main_of[p], "param": p.detach().float()}
            for kind, t in pieces.items():
                if getattr(p, "tensor_model_parallel", False) and g.size() > 1:
                    parts = [torch.empty_like(t) for _ in range(g.size())]
                    dist.all_gather(parts, t.contiguous(), group=g)
                    t = _tp_full(parts, p)
                pieces[kind] = t
            if bits[:2] == ["decoder", "layers"]:
                bits[2] = str((ci * pp + pp_rank) * per_chunk + int(bits[2]))
            if expert:   # megatron's expert layout: EP rank r holds experts r * n_local .. (r + 1) * n_local - 1
                i = bits.index("local_experts")
                n_local = len(_owner(chunk, name.split(".")[:i + 1]))
                bits[i:i + 2] = [str(ps.get_expert_model_parallel_rank() * n_local + int(bits[i + 1]))]
            if name == "output_layer.weight" and tied:
                if not tied_copy or ps.get_pipeline_model_parallel_world_size() == 1:
                    continue
                bits = ["output_layer", "weight(tied)"]
            first = ((ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank()) if expert else
                     (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()))
            if first == (0, 0):
                gname = ".".join(bits)
                out["master/" + gname] = pieces["master"].numpy().copy()
                out["param/" + gname] = pieces["param"].numpy().copy()
    return out


def _owner(chunk, path):
    m = chunk
    for part in path:
        m = getattr(m, part) if not part.isdigit() else m[int(part)]
    return m


def _tp_full(parts, p):
    """The full tensor from the tensor-parallel ranks' parts: concatenated along partition_dim, interleaved by
    partition_stride (SwiGLU's fc1 holds [gate_r; up_r] on rank r: the full tensor is [gate; up])."""
    stride = int(getattr(p, "partition_stride", 1))
    if stride == 1:
        return torch.cat(parts, dim=p.partition_dim)
    chunks = [c for j in range(stride) for c in (x.chunk(stride, dim=p.partition_dim)[j] for x in parts)]
    return torch.cat(chunks, dim=p.partition_dim)
