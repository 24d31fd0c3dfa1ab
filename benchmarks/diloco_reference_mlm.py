#!/usr/bin/env python
"""Textbook Streaming DiLoCo on anyone's Megatron islands, from a given start: what yeto-patch should match.

Why: benchmarks/convergence_mlm.py measures yeto-patch's final model against DDP and against one island alone. Whether a
gap is DiLoCo's own (the algorithm at this F, H, tau, alpha, outer optimizer and start) or yeto-patch's (int4
pushes, error feedback, bf16, install timing, who initialized) needs the algorithm alone from the same start
and on the same samples. This script is that, in one process and fp32, on a setting given as the islands' own
Megatron argument lists (``--island``, one per island, as their launchers pass them) and YETO_* variables
(``--island-env``), or, without ``--island``, on benchmarks/convergence_mlm.py's islands (``--data`` and the
benchmark's options, which build exactly those argument lists):

- the model is Megatron-LM's own: tests/shim/scripts/pretrain_gpt_cpu.py's ``model_provider`` (pretrain_gpt.py's
  GPT) under ``initialize_megatron`` (world size 1), on the first island's arguments minus parallelism, bf16 and
  the distributed optimizer (``DROP``), with its padded vocabulary kept; every island must describe the same model
  (``MODEL_FIELDS``, checked);
- its weights are the start given by ``--init`` (a job's ``--export-npz-at-start`` dump: the FP32 masters of the
  island whose INIT the run takes), loaded into every replica;
- the samples are the islands' own: Megatron's GPTDataset over each island's ``--train-data-path`` /
  ``--data-path`` with its ``--seed``, its ``--global-batch-size`` per step in Megatron's order, held-out samples
  from the first island's ``--valid-data-path`` drawn with ``--valid-seed``, evaluated as Megatron's ``evaluate``
  does (token mean of ``--eval-seqs`` sequences);
- each replica's inner optimizer is what Megatron builds from its island's arguments without Transformer Engine:
  torch AdamW (its betas, eps and weight decay, none on biases and 1-D parameters), global grad-norm clipping,
  Megatron's OptimizerParamScheduler (its lr, min lr, warm-up and decay; the first update at lr 0);
- DiLoCo is benchmarks/diloco_reference.py's ``train_diloco``: the syncer's fragment partition, the islands'
  schedule, H / tau / alpha as yeto-patch's config resolves the islands' variables, outer Nesterov on the mean
  pseudo-gradient with the syncer's momentum warm-up, the base from step t's deltas installed after step t + tau
  as alpha * local + (1 - alpha) * base; the final cut merges every fragment once more and is the global model.

Not modelled: bf16 compute, the pushes' codec and error feedback (unless ``--push-dtype``: the product's codec at
``--push-block``, each replica's residual carried as the island's PushEncoder does), quantized bases, the islands'
dropout random streams (the same probability, other draws). ``--runs lone`` also trains replica 0 (the first
island) alone from the start.

    python benchmarks/diloco_reference_mlm.py --init RUN/lone-11-22-init-a/start \\
        --data bench-out/convergence_mlm/data --seeds 11:22 --fragments 4 -H 10 --tau 5 --json ref.json
    python benchmarks/diloco_reference_mlm.py --init START --fragments 4 --island-env "YETO_DILOCO_SYNC_EVERY=10" \\
        --island "$(cat island_a.args)" --island "$(cat island_b.args)"
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


def benchmark_islands(o) -> list:
    """The Megatron argument lists of benchmarks/convergence_mlm.py's islands (TP2 on shard 0 with seed SA, PP2 on
    shard 1 with seed SB, global batch 4), from this script's benchmark options: what ``--island`` gives when the
    islands are someone else's."""
    data = {"shards": [[os.path.join(o.data, "shard0")], [os.path.join(o.data, "shard1")]],
            "corpus": [["1", os.path.join(o.data, "shard0"), "1", os.path.join(o.data, "shard1")]] * 2}[o.data_layout]
    common = ["--num-layers", str(o.layers), "--hidden-size", str(o.hidden), "--num-attention-heads", "4",
              "--seq-length", str(o.seq_length), "--max-position-embeddings", str(o.seq_length),
              "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(o.iters),
              "--lr", str(o.lr), "--min-lr", str(o.lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters",
              str(o.warmup), "--vocab-size", "257", "--valid-data-path", os.path.join(o.data, "heldout"),
              "--eval-iters", str(o.eval_seqs // 4), "--eval-interval", "1000000", "--transformer-impl", "local",
              "--use-distributed-optimizer", "--bf16", "--no-gradient-accumulation-fusion",
              "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
              "--distributed-backend", "gloo"]
    layouts = [["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
               ["--pipeline-model-parallel-size", "2"]]
    return [[*layouts[k], *common, "--train-data-path", *data[k], "--seed", str(o.seeds[k])] for k in range(2)]


#: island flags the one-process fp32 reference drops (flag -> how many values follow): parallelism, precision,
#: the distributed optimizer, and the benchmark script's own extras
DROP = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
        "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 1,
        "--virtual-pipeline-model-parallel-size": 1, "--num-layers-per-virtual-pipeline-stage": 1,
        "--decoder-first-pipeline-num-layers": 1, "--decoder-last-pipeline-num-layers": 1,
        "--make-vocab-size-divisible-by": 1, "--bf16": 0, "--fp16": 0, "--use-distributed-optimizer": 0,
        "--sequence-parallel": 0, "--overlap-grad-reduce": 0, "--overlap-param-gather": 0,
        "--data-cache-path": 1, "--valid-seed": 1, "--export-npz-at-start": 1, "--export-npz": 1,
        "--save": 1, "--load": 1, "--save-interval": 1, "--distributed-backend": 1}
#: what must be equal across islands for them to train one model
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "group_query_attention", "seq_length", "max_position_embeddings", "vocab_size",
                "untie_embeddings_and_output_weights", "normalization", "swiglu", "position_embedding_type",
                "add_bias_linear", "hidden_dropout", "attention_dropout", "transformer_impl", "spec")


def parse_island(argv: list):
    """One island's Megatron arguments as Megatron's own parser reads them (defaults filled in, not validated)."""
    from megatron.training.arguments import add_megatron_arguments
    ns, _ = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_known_args(argv)
    return ns


def padded_vocab(ns) -> int:
    """Megatron's padded vocabulary of an island (what its embedding and the syncer's manifest have)."""
    m = (ns.make_vocab_size_divisible_by or 128) * (ns.tensor_model_parallel_size or 1)
    return -(-ns.vocab_size // m) * m


def strip(argv: list) -> list:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in DROP:
            i += 1 + DROP[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def check_islands(islands: list) -> None:
    """The islands train one model (MODEL_FIELDS and the padded vocabulary agree), each with a vocabulary given."""
    first = islands[0]
    if first.vocab_size is None:
        raise SystemExit("the islands' arguments give no --vocab-size (the reference needs the vocabulary size)")
    for k, ns in enumerate(islands[1:], 1):
        diff = [f for f in MODEL_FIELDS if getattr(ns, f, None) != getattr(first, f, None)]
        if padded_vocab(ns) != padded_vocab(first):
            diff.append(f"padded vocabulary {padded_vocab(ns)} != {padded_vocab(first)}")
        if diff:
            raise SystemExit(f"island {k}'s arguments describe another model than island 0's: {diff}")


def megatron_argv(o) -> list:
    """The reference's own Megatron arguments: island 0's, without parallelism, bf16 and the distributed
    optimizer, with island 0's padded vocabulary kept (so the start's embedding fits), world size 1 over gloo."""
    return [*strip(o.islands[0]), "--make-vocab-size-divisible-by", str(padded_vocab(o.parsed[0])),
            "--distributed-backend", "gloo", "--data-cache-path", o.cache, "--eval-iters",
            str(max(1, o.eval_seqs // o.parsed[0].global_batch_size))]


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

    def __init__(self, S, o, start, island):
        import torch
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.training import get_args
        args = get_args()
        self.model = S.model_provider()
        load_start(self.model, start)
        no_wd = [p for n, p in self.model.named_parameters() if p.ndim == 1 or n.endswith(".bias")]
        wd = [p for n, p in self.model.named_parameters() if not (p.ndim == 1 or n.endswith(".bias"))]
        a = island   # the island's own inner optimizer and schedule (as Megatron builds them without TE)
        self.opt = torch.optim.AdamW([dict(params=wd, wd_mult=1.0), dict(params=no_wd, wd_mult=0.0)], lr=a.lr,
                                     betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, weight_decay=a.weight_decay)
        self.sched = OptimizerParamScheduler(
            self.opt, init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr,
            lr_warmup_steps=a.lr_warmup_iters, lr_decay_steps=a.lr_decay_iters or a.train_iters,
            lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay, end_wd=a.weight_decay,
            wd_incr_steps=a.train_iters, wd_incr_style="constant")
        self.clip = a.clip_grad
        self.gbs = island.global_batch_size
        args.seed, args.train_data_path, args.data_path = island.seed, island.train_data_path, island.data_path
        eval_n = o.eval_seqs
        self.train, self.valid, _ = S.train_valid_test_datasets_provider([o.iters * self.gbs, eval_n, eval_n])

    def step(self, k):
        import torch
        self.opt.zero_grad(set_to_none=True)
        batch = [self.train[i] for i in range(self.gbs * k, self.gbs * (k + 1))]
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


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--init", required=True, help="prefix of the start dump (PREFIX.rank*.npz)")
    ap.add_argument("--island", action="append", default=[], metavar="'MEGATRON ARGS'",
                    help="one island's Megatron argument list, as its launcher passes it (shell-quoted; one "
                    "--island per island, the initializing one first); without it: the benchmark's islands from "
                    "the options below")
    ap.add_argument("--island-env", default="", metavar="'YETO_VAR=V ...'", help="the islands' YETO_* variables: "
                    "H, tau and alpha resolved by yeto-patch's own config (default: YETO_DILOCO_SYNC_EVERY=-H)")
    ap.add_argument("--valid-seed", type=int, default=1234, help="seed of the held-out draw (the islands' "
                    "--valid-seed; Megatron's own: their --seed)")
    ap.add_argument("--fragments", type=int, default=1, help="the syncer's --fragments")
    ap.add_argument("--outer-lr", type=float, default=None, help="default: the syncer's auto for these pushes")
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--momentum-warmup", type=int, default=None, help="outer momentum warm-up, rounds per "
                    "fragment (default: the syncer's, yeto_patch.syncer.model.outer.MOMENTUM_WARMUP)")
    ap.add_argument("--vocab-rows", type=int, default=None, help="rows of the manifest's embedding (default: the "
                    "islands' padded vocabulary)")
    ap.add_argument("--eval-seqs", type=int, default=128)
    ap.add_argument("--push-dtype", default=None, help="encode each replica's pseudo-gradient with the product's "
                    "codec (YETO_DILOCO_PUSH_DTYPE, e.g. int4, int1), with the islands' error feedback; default: "
                    "exact pushes")
    ap.add_argument("--push-block", type=int, default=256, help="the codec's block (YETO_DILOCO_BLOCK)")
    ap.add_argument("--no-error-feedback", action="store_true", help="with --push-dtype: no residual carried")
    ap.add_argument("--runs", default="diloco", help="comma-separated: diloco, lone")
    ap.add_argument("--dropout-seed", type=int, default=None, help="seed of the dropout draws (default: island "
                    "0's --seed); other values measure how much the draws alone move the result")
    ap.add_argument("--cache", default=None, help="Megatron's dataset index cache (default: beside --data, or a "
                    "folder under /tmp)")
    ap.add_argument("--json", default=None)
    b = ap.add_argument_group("the benchmark's islands (benchmarks/convergence_mlm.py; without --island)")
    b.add_argument("--data", default=None, help="folder of shard0 / shard1 / heldout (convergence_mlm.py)")
    b.add_argument("--data-layout", default="shards", choices=("shards", "corpus"), help="shards: island a on "
                   "shard 0, b on shard 1; corpus: both on both shards, each in its seed's order")
    b.add_argument("--seeds", default="11:22", help="SA:SB, the islands' seeds (their samples)")
    b.add_argument("-H", "--sync-every", type=int, default=10)
    b.add_argument("--tau", type=int, default=None, help="default: the islands' auto, min(5, H // 2)")
    b.add_argument("--alpha", type=float, default=None, help="default: the islands' (0.5)")
    b.add_argument("--iters", type=int, default=300)
    b.add_argument("--lr", type=float, default=1e-3)
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--layers", type=int, default=2)
    b.add_argument("--hidden", type=int, default=64)
    b.add_argument("--seq-length", type=int, default=64)
    o = ap.parse_args(argv)
    import shlex
    if o.island:
        o.islands = [shlex.split(x) for x in o.island]
    elif o.data:
        o.seeds = [int(x) for x in o.seeds.split(":")]
        o.islands = benchmark_islands(o)
    else:
        ap.error("give the islands' Megatron arguments (--island, one per island) or the benchmark's --data")
    if o.push_dtype is not None:
        from yeto_patch.wire import codecs
        from yeto_patch.wire.frames import CodecError
        try:
            codecs.check_codec(o.push_dtype, o.push_block)
        except CodecError as e:
            ap.error(f"--push-dtype {o.push_dtype} --push-block {o.push_block}: {e}")
    o.parsed = [parse_island(x) for x in o.islands]
    check_islands(o.parsed)
    o.iters = o.parsed[0].train_iters
    if any(ns.train_iters != o.iters for ns in o.parsed):
        ap.error("the islands train different --train-iters")
    o.dropout_seed = o.parsed[0].seed if o.dropout_seed is None else o.dropout_seed
    o.cache = o.cache or (os.path.join(o.data, "ref-cache") if o.data else "/tmp/diloco-reference-cache")
    o.vocab_rows = o.vocab_rows or padded_vocab(o.parsed[0])
    o.h, o.tau_, o.alpha_ = diloco_settings(o)
    return o


def pushes_label(o) -> str:
    """What the replicas' pushes are: 'exact', or the codec, its block and whether error feedback is on."""
    if o.push_dtype is None:
        return "exact"
    return f"{o.push_dtype} block {o.push_block}{'' if o.no_error_feedback else ' + error feedback'}"


def diloco_settings(o) -> tuple:
    """(H, tau, alpha) as the islands resolve them: their YETO_* variables through yeto-patch's config (explicit
    -H/--tau/--alpha win, for the benchmark's islands)."""
    from yeto_patch import config
    env = dict(kv.split("=", 1) for kv in o.island_env.split())
    env = {k: v for k, v in env.items() if k in ("YETO_DILOCO_SYNC_EVERY", "YETO_DILOCO_OVERLAP_STEPS",
                                                 "YETO_DILOCO_MERGE_ALPHA")}
    if o.island_env == "" or "YETO_DILOCO_SYNC_EVERY" not in env:
        env["YETO_DILOCO_SYNC_EVERY"] = str(o.sync_every)
    if o.tau is not None:
        env["YETO_DILOCO_OVERLAP_STEPS"] = str(o.tau)
    if o.alpha is not None:
        env["YETO_DILOCO_MERGE_ALPHA"] = str(o.alpha)
    s = config.from_env({**env, "YETO_DILOCO_DISABLE": "1"})
    return s.sync_every, s.overlap_steps, s.merge_alpha


def main(argv=None):
    o = parse(argv)
    from yeto_patch.syncer.model.outer import MOMENTUM_WARMUP, lr_for_steps
    warmup = MOMENTUM_WARMUP if o.momentum_warmup is None else o.momentum_warmup
    tau, alpha = o.tau_, o.alpha_
    outer_lr = lr_for_steps(o.h, blended=tau > 0) if o.outer_lr is None else o.outer_lr
    S = init_megatron(o)
    import torch
    from diloco_reference import CodedPushes, OuterOptimizer, install, train_diloco
    torch.set_num_threads(1)
    out = {"H": o.h, "tau": tau, "alpha": alpha, "outer_lr": outer_lr, "fragments": o.fragments,
           "pushes": pushes_label(o),
           "momentum_warmup": warmup, "islands": len(o.islands)}
    for run in [r for r in o.runs.split(",") if r]:
        t0 = time.time()
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        torch.manual_seed(o.dropout_seed)
        model_parallel_cuda_manual_seed(o.dropout_seed)   # (dropout draws: every run of this script the same)
        reps = [Replica(S, o, o.init, ns) for ns in o.parsed]
        if run == "lone":
            for k in range(o.iters):
                reps[0].step(k)
            final = reps[0].model
        else:
            params = list(reps[0].model.parameters())
            pushes = None if o.push_dtype is None else CodedPushes(
                o.push_dtype, o.push_block, not o.no_error_feedback, len(reps), len(params))
            outer = OuterOptimizer(params, fragments_of(reps[0].model, o.fragments, o.vocab_rows),
                                   outer_lr, o.outer_momentum, warmup, pushes)
            anchor = train_diloco([r.model for r in reps], lambda k, s: reps[k].step(s), o.iters, o.h,
                                  outer, tau=tau, alpha=alpha)
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
