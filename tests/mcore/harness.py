"""Test-only harness: a small real megatron-core GPTModel + DDP + optimizer for one parallel layout, on CPU/gloo.

Runs inside a pool worker (see pool.py), where torch.distributed is already initialised and the CPU patches
are applied:

    ctx = build(RunCfg(tp=2, bf16=True))           # model chunks, optimizer, config, data iterator
    losses = train_steps(ctx, 3)                   # 3 optimizer steps; returns the mean loss per step
    ...hook(ctx)...                                # e.g. read / write masters
    losses += train_steps(ctx, 2)                  # continues with the same data stream

Layouts: TP / PP (optionally virtual-pipeline) / EP / expert-TP / DP (the rest of the world); bf16 or fp32;
DistributedOptimizer or not (non-distributed bf16 -> Float16OptimizerWithFloat16Params, fp32 -> FP32Optimizer);
MoE (SequentialMLP, alltoall dispatcher); HybridDeviceOptimizer (cpu_offload). The data are deterministic and
identical for every layout (the global batch is the same, each DP rank takes its slice), so two layouts of the
same architecture train the same model.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass
class RunCfg:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None      # virtual-pipeline chunks per stage (layers % (pp*vpp) == 0)
    ep: int = 1
    etp: int = 1                   # expert tensor parallel size (MoE)
    experts: int = 0               # >0 -> MoE (SequentialMLP, top-2, alltoall)
    aux: float = 1e-2
    bf16: bool = False
    sp: bool = False               # sequence parallel (forced on for MoE with TP>1)
    recompute: bool = False
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    moe_ffn: int = 128
    vocab: int = 128               # real vocabulary size (tokens that occur in data)
    vocab_divisible_by: int = 64   # Megatron's --make-vocab-size-divisible-by (padded to a multiple of this x TP)
    tied: bool = True              # share embedding and output weights
    swiglu: bool = False           # gated linear unit: fc1 is split with partition_stride 2
    freeze: tuple = ()             # parameters whose name contains one of these are frozen (requires_grad=False)
    seq: int = 16
    mbs: int = 2
    micro: int = 2                 # microbatches per DP rank per step (>= pp for pipelines)
    global_batch: Optional[int] = None  # if set: sequences per step for the whole island; micro is derived,
                                        # so every layout sees the same global batch (same loss)
    lr: float = 1e-2
    clip_grad: float = 1.0
    dist_opt: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    cpu_offload: bool = False      # HybridDeviceOptimizer (needs the precision-aware optimizer)
    offload_fraction: float = 1.0
    seed: int = 1234               # model init seed
    data_seed: int = 0


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """What Megatron-LM's `_vocab_size_with_padding` does."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def _chunks(model):
    return model if isinstance(model, list) else [model]


def build(cfg: RunCfg) -> dict:
    """Initialise model parallelism for `cfg` and build the model chunks, DDP wrappers and optimizer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
                                 virtual_pipeline_model_parallel_size=cfg.vpp,
                                 expert_model_parallel_size=cfg.ep,
                                 expert_tensor_parallel_size=cfg.etp if cfg.experts else None)
    model_parallel_cuda_manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    moe_kw = {}
    if cfg.experts:
        moe_kw = dict(num_moe_experts=cfg.experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                      moe_aux_loss_coeff=cfg.aux, moe_ffn_hidden_size=cfg.moe_ffn, moe_grouped_gemm=False,
                      moe_router_load_balancing_type="aux_loss",
                      # bias in MoE needs ETP==1, and SequentialMLP+bias+TP1 hits an in-place-on-view autograd
                      # error (mlp.py) -> no linear biases for the MoE variant
                      add_bias_linear=False, expert_tensor_parallel_size=cfg.etp)
    tcfg = TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads, ffn_hidden_size=cfg.ffn,
        use_cpu_initialization=True, bf16=cfg.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        expert_model_parallel_size=cfg.ep, sequence_parallel=cfg.sp or bool(cfg.experts and cfg.tp > 1),
        hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        **(dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu) if cfg.swiglu else {}),
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
           if cfg.recompute else {}),
        **moe_kw)
    spec = get_gpt_layer_local_spec(num_experts=cfg.experts or None, moe_grouped_gemm=False)
    vocab_padded = padded_vocab_size(cfg.vocab, cfg.vocab_divisible_by, cfg.tp)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
                                            overlap_param_gather=cfg.overlap_param_gather,
                                            use_distributed_optimizer=cfg.dist_opt)
    chunks = []
    n_chunks = cfg.vpp or 1
    for vp in range(n_chunks):
        vp_kw = dict(vp_stage=vp) if cfg.vpp else {}
        model = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=vocab_padded,
                         max_sequence_length=cfg.seq,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp if cfg.vpp else None),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp if cfg.vpp else None),
                         share_embeddings_and_output_weights=cfg.tied, position_embedding_type="rope", **vp_kw)
        for name, p in model.named_parameters():
            if any(f in name for f in cfg.freeze):
                p.requires_grad = False
        if cfg.bf16:
            model = Float16Module(tcfg, model)
        model = DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=model,
                                        disable_bucketing=(vp > 0))
        chunks.append(model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=0.0, bf16=cfg.bf16, params_dtype=dtype,
                              use_distributed_optimizer=cfg.dist_opt, clip_grad=cfg.clip_grad,
                              overlap_param_gather=cfg.overlap_param_gather,
                              **(dict(optimizer_cpu_offload=True, optimizer_offload_fraction=cfg.offload_fraction,
                                      use_precision_aware_optimizer=True, decoupled_weight_decay=True,
                                      pin_cpu_grads=False, pin_cpu_params=False) if cfg.cpu_offload else {}))
    optimizer = get_megatron_optimizer(opt_cfg, chunks)
    # what megatron/training/training.py does:
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = optimizer.scale_loss
    if cfg.overlap_grad_reduce:
        tcfg.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if cfg.overlap_param_gather:
        tcfg.param_sync_func = ([c.start_param_sync for c in chunks] if len(chunks) > 1
                                else chunks[0].start_param_sync)
    if cfg.global_batch:
        dp = ps.get_data_parallel_world_size()
        if cfg.global_batch % (dp * cfg.mbs):
            raise ValueError(f"global_batch {cfg.global_batch} is not a multiple of dp {dp} x mbs {cfg.mbs}")
        cfg = dataclasses.replace(cfg, micro=cfg.global_batch // (dp * cfg.mbs))
    ctx = dict(cfg=cfg, tcfg=tcfg, model=chunks, optimizer=optimizer, ps=ps, vocab_padded=vocab_padded,
               step=0)
    ctx["data"] = DataStream(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    return ctx


class DataStream:
    """Deterministic, learnable token stream; global batch b of step s is the same for every layout."""

    def __init__(self, cfg: RunCfg, dp_rank: int, dp_size: int):
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size

    def step_batches(self, step: int):
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.data_seed * 1_000_003 + step % 4)
        n = self.dp_size * cfg.micro * cfg.mbs
        start = torch.randint(0, cfg.vocab, (n, 1), generator=g)
        mult = torch.randint(1, 4, (n, 1), generator=g)
        seqs = [start]
        for _ in range(cfg.seq):  # next token = (tok * m + 1) % vocab: learnable
            seqs.append((seqs[-1] * mult + 1) % cfg.vocab)
        toks = torch.cat(seqs, 1).view(self.dp_size, cfg.micro, cfg.mbs, cfg.seq + 1)[self.dp_rank]
        return [dict(tokens=t[:, :-1].contiguous(), labels=t[:, 1:].contiguous()) for t in toks]


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1))
    ntok = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), ntok.view(1).float()])
    return loss, ntok, {"lm loss": report}


def train_steps(ctx: dict, steps: int, forward_only: bool = False, batch_step: Optional[int] = None) -> list:
    """Run `steps` optimizer steps (or forward-only evaluations of the current step's batch).
    `batch_step` pins the data to that step's batch (e.g. to see the loss of one batch fall).

    Returns the global mean loss per step on every rank (broadcast from the last pipeline stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    cfg, ps, chunks, optimizer = ctx["cfg"], ctx["ps"], ctx["model"], ctx["optimizer"]
    pos = torch.arange(cfg.seq).unsqueeze(0).expand(cfg.mbs, cfg.seq)

    def forward_step(it, model):
        b = next(it)
        out = model(b["tokens"], pos, None, labels=b["labels"])
        return out, functools.partial(_loss_func, torch.ones(cfg.mbs, cfg.seq))

    fb = get_forward_backward_func()
    losses = []
    for _ in range(steps):
        batches = ctx["data"].step_batches(ctx["step"] if batch_step is None else batch_step)
        its = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        if not forward_only:
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
        res = fb(forward_step_func=forward_step, data_iterator=its, model=chunks, num_microbatches=cfg.micro,
                 seq_length=cfg.seq, micro_batch_size=cfg.mbs, forward_only=forward_only)
        if not forward_only:
            ok, _gnorm, _nz = optimizer.step()
            assert ok, "optimizer step skipped"
            ctx["step"] += 1
        rep = torch.zeros(2)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            rep = torch.stack([r["lm loss"] for r in res]).sum(0).float()
            dist.all_reduce(rep, group=ps.get_data_parallel_group())
        # every rank learns the loss: last stage ranks hold it, the others hold zeros
        dist.all_reduce(rep, group=ps.get_pipeline_model_parallel_group(), op=dist.ReduceOp.SUM)
        losses.append((rep[0] / rep[1]).item())
    return losses


def eval_loss(ctx: dict) -> float:
    """Forward-only loss of a fixed evaluation batch (step 0's), without touching the optimizer."""
    saved = ctx["step"]
    ctx["step"] = 0
    try:
        return train_steps(ctx, 1, forward_only=True)[0]
    finally:
        ctx["step"] = saved


def unwrap(module):
    """The GPTModel under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def dist_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def rank_info() -> dict:
    from megatron.core import parallel_state as ps
    return dict(rank=dist.get_rank(), tp=ps.get_tensor_model_parallel_rank(),
                pp=ps.get_pipeline_model_parallel_rank(), dp=ps.get_data_parallel_rank())


def megatron_core_version() -> tuple:
    """Installed megatron-core version without importing it (usable in the test process)."""
    from importlib.metadata import version
    return tuple(int(x) for x in version("megatron-core").split(".")[:2])


def hdo_supported() -> bool:
    """HybridDeviceOptimizer needs the precision-aware optimizer, which megatron-core 0.16.1 only allows with
    Transformer Engine installed (OptimizerConfig asks TE for its version); 0.17+ runs it on plain torch."""
    return megatron_core_version() >= (0, 17)
