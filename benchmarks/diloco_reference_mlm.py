#!/usr/bin/env python
"""Textbook Streaming DiLoCo on the setting of benchmarks/convergence_mlm.py, from a given start: what yeto-patch
on Megatron-LM's loop should match.

Why: convergence_mlm.py measures yeto-patch's final model against DDP and against one island alone. Whether a
gap is DiLoCo's own (the algorithm at this F, H, tau, alpha, outer optimizer and start) or yeto-patch's (int4
pushes, error feedback, bf16, install timing, who initialized) needs the algorithm alone from the same start
and on the same samples. This script is that, in one process and fp32:

- the model is Megatron-LM's own: tests/shim/scripts/pretrain_gpt_cpu.py's ``model_provider`` under
  ``initialize_megatron`` (world size 1), the same Megatron arguments as the islands minus bf16 and the
  distributed optimizer, so architecture, dropout and configuration need no proof of equality;
- its weights are the start given by ``--init`` (a job's ``--export-npz-at-start`` dump: the FP32 masters of the
  island whose INIT the run takes), loaded into every replica;
- the samples are the islands' own: the same script's dataset provider (Megatron's GPTDataset over shard 0 with
  seed SA for replica 0, shard 1 with seed SB for replica 1, global batch 4 in Megatron's order), held-out
  samples drawn with ``--valid-seed``, evaluated as Megatron's ``evaluate`` does (token mean of ``--eval-seqs``
  sequences);
- the inner optimizer is what Megatron builds without Transformer Engine: torch AdamW (betas 0.9/0.999, eps
  1e-8, weight decay 0.01 except on biases and 1-D parameters), global grad-norm clipping at 1.0, Megatron's
  OptimizerParamScheduler (linear warm-up from 0, cosine to min lr; the first update at lr 0);
- DiLoCo is benchmarks/diloco_reference.py's ``train_diloco``: the syncer's fragment partition, the islands'
  schedule, outer Nesterov (torch SGD, nesterov=True) on the mean pseudo-gradient, the base from step t's deltas
  installed after step t + tau as alpha * local + (1 - alpha) * base; the final cut merges every fragment once
  more and is the global model.

Not modelled: bf16 compute, int4 pushes and error feedback, quantized bases, the islands' dropout random streams
(the same probability, other draws). ``--runs lone`` also trains replica 0 alone from the start (the lone island in
fp32).

    python benchmarks/diloco_reference_mlm.py --init RUN/lone-11-22-init-a/start \\
        --data bench-out/convergence_mlm/data --seeds 11:22 --fragments 4 -H 10 --tau 5 --json ref.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "shim", "scripts")
for _p in (ROOT, SCRIPTS, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def megatron_argv(o) -> list:
    """The islands' Megatron arguments (benchmarks/convergence_mlm.py), fp32, no distributed optimizer."""
    eval_iters = o.eval_seqs // 4
    return ["--num-layers", str(o.layers), "--hidden-size", str(o.hidden), "--num-attention-heads", "4",
            "--seq-length", str(o.seq_length), "--max-position-embeddings", str(o.seq_length),
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(o.iters),
            "--lr", str(o.lr), "--min-lr", str(o.lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters",
            str(o.warmup), "--vocab-size", "257", "--make-vocab-size-divisible-by", "128",
            "--train-data-path", os.path.join(o.data, "shard0"), "--valid-data-path", os.path.join(o.data, "heldout"),
            "--data-cache-path", o.cache, "--eval-iters", str(eval_iters), "--eval-interval", "1000000",
            "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
            "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--distributed-backend", "gloo",
            "--seed", str(o.seeds[0])]


def init_megatron(o):
    """Megatron-LM's arguments and initialization in this one process (world size 1, gloo, CPU patches)."""
    from tests.shim import procs as P
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(P.free_port()))
    sys.argv = [sys.argv[0], *megatron_argv(o)]
    import pretrain_gpt_cpu as S   # applies the CPU patches first
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.initialize import initialize_megatron
    parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    initialize_megatron(allow_no_cuda=True)
    S.VALID_SEED = o.valid_seed
    return S


def load_start(model, prefix):
    """The FP32 masters of a --export-npz-at-start dump (every rank's part) into `model` (tied copy skipped)."""
    import numpy as np
    import torch
    got = {}
    for path in sorted(glob.glob(prefix + ".rank*.npz")):
        with np.load(path) as z:
            got.update({k[len("master/"):]: z[k] for k in z.files if k.startswith("master/")})
    if not got:
        raise SystemExit(f"no start dump {prefix}.rank*.npz")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in got:
                raise SystemExit(f"the start dump has no {name}")
            if tuple(got[name].shape) != tuple(p.shape):
                raise SystemExit(f"{name}: the start has shape {got[name].shape}, the model {tuple(p.shape)}")
            p.copy_(torch.from_numpy(got[name]))
    extra = set(got) - {n for n, _ in model.named_parameters()} - {"output_layer.weight(tied)"}
    if extra:
        raise SystemExit(f"the start dump has tensors the model lacks: {sorted(extra)[:5]}")


class Replica:
    """One island: Megatron's model from the start, AdamW with Megatron's groups and schedule, its samples."""

    def __init__(self, S, o, start, shard, seed):
        import torch
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.training import get_args
        args = get_args()
        self.model = S.model_provider()
        load_start(self.model, start)
        no_wd = [p for n, p in self.model.named_parameters() if p.ndim == 1 or n.endswith(".bias")]
        wd = [p for n, p in self.model.named_parameters() if not (p.ndim == 1 or n.endswith(".bias"))]
        self.opt = torch.optim.AdamW([dict(params=wd, wd_mult=1.0), dict(params=no_wd, wd_mult=0.0)], lr=args.lr,
                                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                     weight_decay=args.weight_decay)
        self.sched = OptimizerParamScheduler(
            self.opt, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.train_iters,
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters, wd_incr_style="constant")
        self.clip = args.clip_grad
        paths = [os.path.join(o.data, shard)]
        if o.data_layout == "corpus":   # both replicas sample both shards, each in the order of its own seed
            paths = ["1", os.path.join(o.data, "shard0"), "1", os.path.join(o.data, "shard1")]
        args.seed, args.train_data_path = seed, paths
        eval_n = o.eval_seqs
        self.train, self.valid, _ = S.train_valid_test_datasets_provider([o.iters * 4, eval_n, eval_n])

    def step(self, k):
        import torch
        self.opt.zero_grad(set_to_none=True)
        batch = [self.train[i] for i in range(4 * k, 4 * k + 4)]
        token_loss(self.model, batch).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step(1)


def token_loss(model, samples):
    """Token mean of Megatron's per-token losses over `samples` (GPTDataset items)."""
    import torch
    b = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask",
                                                                          "position_ids")}
    losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float()
    mask = b["loss_mask"].float()
    return (losses * mask).sum() / mask.sum()


def heldout_loss(model, valid, n):
    import torch
    model.eval()
    with torch.no_grad():
        losses = [float(token_loss(model, [valid[i] for i in range(j, min(j + 4, n))])) for j in range(0, n, 4)]
    model.train()
    return sum(losses) / len(losses)


def fragments_of(model, n, vocab_rows):
    """The syncer's partition of the islands' manifest (global names; vocabulary tensors of `vocab_rows` rows)."""
    from yeto_patch.syncer.model.layout import partition
    manifest = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name == "embedding.word_embeddings.weight":
            shape = (vocab_rows, *shape[1:])
        manifest.append((name, shape, "float32"))
    return partition(manifest, n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, help="prefix of the start dump (PREFIX.rank*.npz)")
    ap.add_argument("--data", required=True, help="folder of shard0 / shard1 / heldout (convergence_mlm.py)")
    ap.add_argument("--seeds", default="11:22", help="SA:SB, the islands' seeds (their samples)")
    ap.add_argument("--valid-seed", type=int, default=1234)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("-H", "--sync-every", type=int, default=10)
    ap.add_argument("--tau", type=int, default=None, help="default: the islands' auto, min(5, H // 2)")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--outer-lr", type=float, default=None, help="default: the syncer's auto for these pushes")
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--momentum-warmup", type=int, default=None, help="outer momentum warm-up, rounds per "
                    "fragment (default: the syncer's, yeto_patch.syncer.model.outer.MOMENTUM_WARMUP)")
    ap.add_argument("--vocab-rows", type=int, default=384, help="rows of the manifest's embedding (partition)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--eval-seqs", type=int, default=128)
    ap.add_argument("--data-layout", default="shards", choices=("shards", "corpus"), help="shards: replica 0 on "
                    "shard 0, replica 1 on shard 1; corpus: both on both shards, each in its seed's order")
    ap.add_argument("--runs", default="diloco", help="comma-separated: diloco, lone")
    ap.add_argument("--dropout-seed", type=int, default=None, help="seed of the dropout draws (default: SA); "
                    "other values measure how much the draws alone move the result")
    ap.add_argument("--cache", default=None, help="Megatron's dataset index cache (default: beside --data)")
    ap.add_argument("--json", default=None)
    o = ap.parse_args(argv)
    o.seeds = [int(x) for x in o.seeds.split(":")]
    o.dropout_seed = o.seeds[0] if o.dropout_seed is None else o.dropout_seed
    o.cache = o.cache or os.path.join(o.data, "ref-cache")
    from yeto_patch.config import AUTO_TAU_MAX
    from yeto_patch.syncer.model.outer import MOMENTUM_WARMUP, lr_for_steps
    warmup = MOMENTUM_WARMUP if o.momentum_warmup is None else o.momentum_warmup
    tau = min(AUTO_TAU_MAX, o.sync_every // 2) if o.tau is None else o.tau
    outer_lr = lr_for_steps(o.sync_every, blended=tau > 0) if o.outer_lr is None else o.outer_lr
    S = init_megatron(o)
    import torch
    from diloco_reference import OuterOptimizer, install, train_diloco
    torch.set_num_threads(1)
    out = {"tau": tau, "alpha": o.alpha, "outer_lr": outer_lr, "fragments": o.fragments, "momentum_warmup": warmup}
    for run in [r for r in o.runs.split(",") if r]:
        t0 = time.time()
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        torch.manual_seed(o.dropout_seed)
        model_parallel_cuda_manual_seed(o.dropout_seed)   # (dropout draws: every run of this script the same)
        reps = [Replica(S, o, o.init, shard, seed) for shard, seed in (("shard0", o.seeds[0]), ("shard1", o.seeds[1]))]
        if run == "lone":
            for k in range(o.iters):
                reps[0].step(k)
            final = reps[0].model
        else:
            outer = OuterOptimizer(reps[0].model.parameters(), fragments_of(reps[0].model, o.fragments, o.vocab_rows),
                                   outer_lr, o.outer_momentum, warmup)
            anchor = train_diloco([r.model for r in reps], lambda k, s: reps[k].step(s), o.iters, o.sync_every,
                                  outer, tau=tau, alpha=o.alpha)
            install(list(reps[0].model.parameters()), range(len(anchor)), anchor)
            final = reps[0].model
        out[run] = heldout_loss(final, reps[0].valid, o.eval_seqs)
        out[f"{run}_wall_s"] = round(time.time() - t0, 1)
        print(f"diloco_reference_mlm: {run} held-out loss {out[run]:.4f} ({out[f'{run}_wall_s']:.0f}s)", flush=True)
    print(json.dumps(out))
    if o.json:
        with open(o.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
