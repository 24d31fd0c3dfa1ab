"""An ordinary megatron-core training script (test-only): a small GPT on CPU over gloo, trained with a plain
forward-backward / optimizer.step() loop. It knows nothing about DiLoCo; the tests attach it to a syncer only
through PYTHONPATH and YETO_* variables, as a user would.

    torchrun --nproc-per-node 2 island_train.py --tp 2 --steps 16 --out DIR

Writes to DIR (global rank 0 writes the JSON, every rank its own part of the model):
  result.json        {"losses", "step_s", "step_end", "eval_before", "eval_after", "steps", "layout", ...}
  model.rank<r>.npz  "master/<name>" FP32 masters and "param/<name>" model weights this rank holds as TP rank 0 /
                     DP rank 0, full along TP, keyed by global name (full_model.py, megatron's own groups)
"""
import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def wait_for_peers(directory, count, me, timeout=600):
    """Jobs launched together start training together (rank 0 of each job meets the others through files)."""
    import time
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        open(os.path.join(directory, f"ready.{me}"), "w").close()
        deadline = time.time() + timeout
        while len([n for n in os.listdir(directory) if n.startswith("ready.")]) < count:
            if time.time() > deadline:
                raise TimeoutError(f"only some of {count} jobs reached the start barrier in {directory}")
            time.sleep(0.1)
    dist.barrier()


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
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per DP rank per step")
    ap.add_argument("--no-save", action="store_true", help="skip the model dump (benchmarks)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--start-barrier", default=None,
                    help="directory shared by jobs launched together: start training once --barrier-count are ready")
    ap.add_argument("--barrier-count", type=int, default=2)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step (a slow island)")
    ap.add_argument("--check-params", action="store_true",
                    help="TEST: after every step, check that every model param is the cast of its FP32 master and "
                         "that the data-parallel replicas are equal (result.json: param_mismatch)")
    ap.add_argument("--fail-background-push-on-rank", type=int, default=None,
                    help="TEST: that rank's background gather of a push fails (tests/shim/test_background_push.py)")
    ap.add_argument("--fail-background-base-on-rank", type=int, default=None,
                    help="TEST: that rank's part of staging a merged base fails (tests/shim/test_background_push.py)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from tests.mcore import cpu_patches, harness       # test-only CPU support for megatron-core
    cpu_patches.apply()
    dist.init_process_group("gloo")
    if a.fail_background_push_on_rank == dist.get_rank():
        fail_background_gather()
    if a.fail_background_base_on_rank == dist.get_rank():
        fail_background_stage()
    cfg = harness.RunCfg(tp=a.tp, pp=a.pp, bf16=not a.fp32, dist_opt=not a.no_dist_opt, lr=a.lr, seed=a.seed,
                         data_seed=a.data_seed, layers=a.layers, hidden=a.hidden, ffn=4 * a.hidden,
                         moe_ffn=4 * a.hidden, seq=a.seq, micro=max(a.micro, a.pp))
    ctx = harness.build(cfg)
    eval_before = harness.eval_loss(ctx)
    if a.start_barrier:
        wait_for_peers(a.start_barrier, a.barrier_count, os.path.basename(os.path.abspath(a.out)))
    import time
    losses, step_s, step_end, mismatch = [], [], [], []
    for i in range(a.steps):
        t0 = time.perf_counter()
        losses += harness.train_steps(ctx, 1)
        if a.check_params:
            mismatch += [[i + 1, what] for what in params_off_masters(ctx)]
        if a.step_sleep:
            time.sleep(a.step_sleep)
        step_s.append(time.perf_counter() - t0)
        step_end.append(time.time())
    eval_after = harness.eval_loss(ctx)
    os.makedirs(a.out, exist_ok=True)
    if not a.no_save:
        from full_model import full_model
        np.savez(os.path.join(a.out, f"model.rank{dist.get_rank()}.npz"),
                 **full_model(ctx["model"], ctx["optimizer"], cfg.layers, cfg.tied))
    if dist.get_rank() == 0:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(dict(losses=losses, step_s=step_s, step_end=step_end, eval_before=eval_before,
                           param_mismatch=mismatch,
                           eval_after=eval_after,
                           steps=len(losses), params=sum(p.numel() for c in ctx["model"] for p in c.parameters()),
                           layout=dict(tp=a.tp, pp=a.pp, world=dist.get_world_size())), f)
    dist.barrier()
    dist.destroy_process_group()


def params_off_masters(ctx) -> list:
    """TEST (every rank, collective over the data-parallel group): what the next forward would see wrongly: a model
    param that is not the cast of this rank's FP32 master of it, or that differs from a DP replica's copy."""
    from megatron.core import parallel_state as ps
    from yeto_patch.island.masters.refs import find_masters
    masters = find_masters(ctx["optimizer"])
    group = ps.get_data_parallel_group()   # (gloo: the harness runs on CPU; a dense model)
    out = []
    for c in ctx["model"]:
        for name, p in c.named_parameters():
            flat = p.detach().view(-1)
            m = masters.get(id(p))
            if m is not None and not torch.equal(flat[m.start: m.end], m.master.to(p.dtype)):
                out.append(f"rank {dist.get_rank()}: {name} is not its master's cast")
            if group is not None and dist.get_world_size(group) > 1:
                copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
                dist.all_gather(copies, flat.contiguous(), group=group)
                if not all(torch.equal(x, copies[0]) for x in copies):
                    out.append(f"rank {dist.get_rank()}: {name} differs across data-parallel replicas")
    return out


def fail_background_gather():
    """TEST: this rank's snapshots of pushes cannot be read by the background gather (a failed stage there)."""
    from yeto_patch.island.masters import view as masters
    orig = masters.MasterView.gather

    class Unreadable(dict):
        def get(self, *args):
            raise RuntimeError(f"injected failure in the background gather on rank {dist.get_rank()}")

    def gather(self, indices, snap, sink, comm):
        return orig(self, indices, Unreadable(), sink, comm)
    masters.MasterView.gather = gather


def fail_background_stage():
    """TEST: this rank's part of staging a merged base fails inside the collective (its peers learn it there)."""
    from yeto_patch.island.masters import stage as master_stage
    orig = master_stage.MasterStage._stage_round

    def _stage_round(self, rnd, sources, relative, comm, staged, pending_err):
        err = RuntimeError(f"injected failure in the background base stage on rank {dist.get_rank()}")
        return orig(self, rnd, sources, relative, comm, staged, pending_err or err)
    master_stage.MasterStage._stage_round = _stage_round


if __name__ == "__main__":
    main()
