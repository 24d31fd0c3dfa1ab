"""An ordinary megatron-core training script (test-only): a small GPT on CPU over gloo, trained with a plain
forward-backward / optimizer.step() loop. It knows nothing about DiLoCo; the tests attach it to a syncer only
through PYTHONPATH and YETO_* variables, as a user would.

    torchrun --nproc-per-node 2 island_train.py --tp 2 --steps 16 --out DIR

Writes to DIR (global rank 0 writes the JSON, every rank its own part of the model):
  result.json        {"losses": [...], "eval_before": x, "eval_after": y, "stopped_at": n, "layout": ...}
  model.rank<r>.npz  the FP32 master weights this rank holds as TP rank 0 / DP rank 0, full along TP, keyed by
                     global name (layer numbers across pipeline stages), gathered with megatron's own groups
"""
import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def full_masters(ctx):
    """{global name: full float32 master} for parameters whose TP-rank-0 / DP-rank-0 copy lives on this rank."""
    from megatron.core import parallel_state as ps
    from tests.mcore import harness
    cfg, opt = ctx["cfg"], ctx["optimizer"]
    main_of = {}
    for o in harness.dist_optimizers(opt):
        if hasattr(o, "model_param_group_index_map"):        # DistributedOptimizer: sharded over DP
            for p in [p for b in o.buffers for p in b.params]:
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
    out = {}
    per_chunk = cfg.layers // (cfg.pp * (cfg.vpp or 1))
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for ci, chunk in enumerate(ctx["model"]):
        for name, p in harness.unwrap(chunk).named_parameters():
            m = main_of[p]
            g = ps.get_tensor_model_parallel_group()
            if getattr(p, "tensor_model_parallel", False) and g.size() > 1:
                parts = [torch.empty_like(m) for _ in range(g.size())]
                dist.all_gather(parts, m.contiguous(), group=g)
                m = torch.cat(parts, dim=p.partition_dim)
            bits = name.split(".")
            if bits[:2] == ["decoder", "layers"]:
                bits[2] = str((ci * cfg.pp + pp_rank) * per_chunk + int(bits[2]))
            if name == "output_layer.weight" and cfg.tied:
                continue
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                out[".".join(bits)] = m.numpy().copy()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--no-dist-opt", action="store_true")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from tests.mcore import cpu_patches, harness       # test-only CPU support for megatron-core
    cpu_patches.apply()
    dist.init_process_group("gloo")
    cfg = harness.RunCfg(tp=a.tp, pp=a.pp, bf16=not a.fp32, dist_opt=not a.no_dist_opt, lr=a.lr, seed=a.seed,
                         data_seed=a.data_seed)
    ctx = harness.build(cfg)
    eval_before = harness.eval_loss(ctx)
    losses = []
    for _ in range(a.steps):
        losses += harness.train_steps(ctx, 1)
    eval_after = harness.eval_loss(ctx)
    os.makedirs(a.out, exist_ok=True)
    np.savez(os.path.join(a.out, f"model.rank{dist.get_rank()}.npz"), **full_masters(ctx))
    if dist.get_rank() == 0:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(dict(losses=losses, eval_before=eval_before, eval_after=eval_after, steps=len(losses),
                           layout=dict(tp=a.tp, pp=a.pp, world=dist.get_world_size())), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
