#!/usr/bin/env python
"""Textbook DiLoCo in plain PyTorch, on the demo's model, data and inner optimizer: what yeto-patch should match.

Why: benchmarks/convergence.py compares yeto-patch's global model with synchronous data parallel. A gap there is
either DiLoCo's own (the algorithm at this M, H, model and token budget) or yeto-patch's (quantized pushes and
bases, overlap timing, bf16). This module runs DiLoCo as the paper writes it (Douillard et al. 2023), in one
process: M replicas, each H inner AdamW steps on its own shard, then the outer step: the replicas' pseudo-gradients
(anchor minus local weights) averaged, torch's SGD(nesterov=True) on the anchor with that as .grad, every replica
reset to the new anchor (its Adam state kept). It also trains the lone island (M=1, H=infinity: replica 0 alone
on shard 0, the same steps, no outer step) and, on request, its own synchronous data parallel (all shards, M x the
batch), which measures the baseline's bf16-against-fp32 offset.

The same recipe as an island, by construction: the demo's options go through yeto_patch.demo.run.model_flags and
examples/train_gpt.parse_args, so every hyperparameter (lr, min lr, warm-up, weight decay, clip, beta2, seed,
shards, held-out windows) is the island's own. The model is megatron-core's GPTModel with train_gpt.build()'s
TransformerConfig, built here (world size 1, gloo, TP1/PP1, tests/mcore/cpu_patches.py) from the same seed, so
architecture and initialisation need no proof of equality; a re-implementation would. Batches are
ByteCorpus.global_batch(shards, step, batch, seq_len), as train_gpt draws them. The inner optimizer is what
get_megatron_optimizer builds on CPU: torch AdamW (beta1 0.9, eps 1e-8, no weight decay on biases and 1-D
parameters), global grad-norm clipping, megatron's OptimizerParamScheduler (linear warm-up from 0, cosine to min
lr; the first update runs at lr 0 as in train_gpt). Streaming fragments use the syncer's partition and the
islands' schedule; with tau > 0 the base merged from step t's deltas is installed after step t + tau as
alpha * local + (1 - alpha) * base and becomes the anchor; the final cut installs pending bases, merges every
fragment once more and replaces each replica by the result (the global model). Checked: the lone island after 60
steps has train_gpt.py --fp32's held-out loss to 4 decimals (2.7499; bf16: 2.7495), and the same initial loss.

Deliberate differences (see NOT_MODELLED): fp32 throughout, so that the reference is the algorithm alone (the
islands compute in bf16 over FP32 masters; the baseline's offset from that is what --runs dp measures);
exact pushes and bases (no int4/int8, no error feedback; --coded-pushes encodes the pushes as the islands do, with
their error feedback); yeto-patch installs a base when it has been staged, at
some step in t+1..t+tau depending on timing, the reference always at t+tau; --sync-warmup is not modelled.

    python benchmarks/diloco_reference.py --islands 2 --steps 500 -H 50 --tau 5 --layers 2 --hidden 64 \\
        --seq-length 64 --batch 8 --runs diloco,lone,dp --json ref.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
for _p in (ROOT, EXAMPLES):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from yeto_patch.island.boundary.schedule import due_fragments  # noqa: E402
from yeto_patch.syncer.model.layout import partition  # noqa: E402

RUNS = ("diloco", "lone", "dp")
NOT_MODELLED = ("bf16 compute, the pushes' codec and error feedback (unless --coded-pushes), int4/int8 bases, "
                "install timing under tau, --sync-warmup")


# --- DiLoCo itself: any torch modules ---------------------------------------------------------------------------

class CodedPushes:
    """What an island's push does to its pseudo-gradient (``--coded-pushes``): the product's codec (the demo's
    --push-dtype) at ``block``, and with error feedback (--error-feedback, the demo's default) the residual of each
    replica's push of a parameter carried into its next one, as the island's PushEncoder does."""

    def __init__(self, codec, block, error_feedback, replicas, params):
        from yeto_patch.wire import codecs
        codecs.check_codec(codec, block)
        self.codec, self.block, self.error_feedback = codec, block, error_feedback
        self.residual = [[None] * params for _ in range(replicas)]

    def __call__(self, k, i, g):
        from yeto_patch.wire import codecs
        x = g.detach().float().reshape(-1).numpy().copy()
        if self.error_feedback and self.residual[k][i] is not None:
            x += self.residual[k][i]
        sent = codecs.decode(self.codec, codecs.encode(self.codec, x, self.block), x.size, self.block)
        if self.error_feedback:
            self.residual[k][i] = x - sent
        return torch.from_numpy(sent).reshape(g.shape)


class OuterOptimizer:
    """The global model (the syncer's role): one anchor copy of the weights, and per fragment Nesterov momentum SGD
    on it (torch SGD(nesterov=True)'s update, written out: ``m = mu*m + g;  anchor -= lr*(g + mu*m)``, m from
    zero), with the syncer's momentum warm-up: round v of a fragment (1-based) uses ``mu * min(1, (v - 1) /
    warmup)`` (yeto_patch.syncer.model.outer.warmed_momentum; warmup 0: mu from the first round)."""

    def __init__(self, params, fragments, lr, momentum, warmup=0, pushes=None):
        self.anchor = [p.detach().clone() for p in params]
        self.pushes = pushes   # a CodedPushes, or None: exact pushes
        self.fragments = fragments
        self.lr, self.momentum, self.warmup = lr, momentum, warmup
        self.m = [torch.zeros_like(a) for a in self.anchor]
        self.rounds = [0] * len(fragments)

    @torch.no_grad()
    def merge(self, f, replicas):
        """Outer step of fragment f from the replicas' current weights; returns the new anchor tensors."""
        from yeto_patch.syncer.model.outer import warmed_momentum
        self.rounds[f] += 1
        mu = warmed_momentum(self.momentum, self.rounds[f], self.warmup)
        for i in self.fragments[f]:
            g = torch.stack([self._pushed(k, i, self.anchor[i] - r[i].detach())
                             for k, r in enumerate(replicas)]).mean(0)
            self.m[i].mul_(mu).add_(g)
            self.anchor[i].sub_(g.add(self.m[i], alpha=mu), alpha=self.lr)
        return [self.anchor[i] for i in self.fragments[f]]

    def _pushed(self, k, i, g):
        return g if self.pushes is None else self.pushes(k, i, g)


@torch.no_grad()
def install(params, idx, base, alpha=None):
    """Replace params[idx] by base, or blend alpha * local + (1 - alpha) * base (alpha given: overlap)."""
    for i, b in zip(idx, base):
        if alpha is None:
            params[i].copy_(b)
        else:
            params[i].mul_(alpha).add_(b, alpha=1 - alpha)


def train_diloco(models, inner_step, steps, sync_every, outer, tau=0, alpha=0.5):
    """Run `steps` inner steps on every replica (inner_step(k, step)); fragments merge on the islands' schedule.

    tau = 0: synchronous DiLoCo, each merge installed at once. tau > 0: the base is installed (blended) after
    step t + tau and replicas train on meanwhile. Last step: the final cut. Returns the global model's tensors."""
    params = [list(m.parameters()) for m in models]
    frags = len(outer.fragments)
    pending = {}  # fragment -> (step to install after, base)
    for s in range(1, steps + 1):
        for k in range(len(models)):
            inner_step(k, s - 1)
        for f in [f for f, (due, _) in pending.items() if due == s or s == steps]:
            for p in params:
                install(p, outer.fragments[f], pending[f][1], alpha)
            del pending[f]
        for f in range(frags) if s == steps else due_fragments(s, sync_every, frags):
            base = outer.merge(f, params)
            if tau == 0 or s == steps:
                for p in params:
                    install(p, outer.fragments[f], base)
            else:
                pending[f] = (s + tau, [b.clone() for b in base])
    return outer.anchor


# --- the demo's model, data and inner optimizer ---------------------------------------------------------------

@dataclass
class Replica:
    """One island: the model, its AdamW and LR schedule, and the shards its batches come from."""
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: object
    shards: list
    batch: int


def train_args(o):
    """train_gpt's namespace for an island of demo options `o`, in fp32."""
    import train_gpt
    from yeto_patch.demo.run import model_flags
    return train_gpt.parse_args(model_flags(o) + ["--global-batch-size", str(o.batch), "--fp32"])


def init_megatron(a):
    """World size 1 over gloo, TP1/PP1, CPU patches applied: what train_gpt.py does on a one-process launch."""
    import train_gpt
    from megatron.core import parallel_state as ps
    train_gpt.init_distributed(a)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def gpt_model(a):
    """GPTModel exactly as train_gpt.build() makes it (same TransformerConfig, same seeding), fp32, no wrappers."""
    import train_gpt
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(a.seed)
    model_parallel_cuda_manual_seed(a.seed)
    cfg = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, use_cpu_initialization=True, bf16=False, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, bias_dropout_fusion=False)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=train_gpt.padded_vocab(a),
                    max_sequence_length=a.seq_length, pre_process=True, post_process=True,
                    position_embedding_type="rope", share_embeddings_and_output_weights=a.tie_embeddings)


def inner_optimizer(model, a):
    """AdamW with megatron's parameter groups under megatron's LR schedule, as train_gpt.build() configures it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    no_wd = [p for n, p in model.named_parameters() if p.ndim == 1 or n.endswith(".bias")]
    wd = [p for n, p in model.named_parameters() if not (p.ndim == 1 or n.endswith(".bias"))]
    opt = torch.optim.AdamW([dict(params=wd, wd_mult=1.0), dict(params=no_wd, wd_mult=0.0)], lr=a.lr,
                            betas=(0.9, a.adam_beta2), eps=1e-8, weight_decay=a.weight_decay)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr,
        lr_warmup_steps=min(a.lr_warmup_iters, max(a.train_iters - 1, 0)), lr_decay_steps=max(a.train_iters, 1),
        lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay, end_wd=a.weight_decay,
        wd_incr_steps=max(a.train_iters, 1), wd_incr_style="constant")
    return opt, sched


def replica(a, shards, batch):
    model = gpt_model(a)
    return Replica(model, *inner_optimizer(model, a), shards=shards, batch=batch)


def token_loss(model, rows):
    """Mean next-byte loss over every token of `rows` ([n, seq + 1] int64 numpy)."""
    t = torch.from_numpy(rows)
    tokens, labels = t[:, :-1].contiguous(), t[:, 1:].contiguous()
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, pos, None, labels=labels).float().mean()


def train_step(r, corpus, step, a):
    """One island step of train_gpt.py: its batch for `step`, loss, backward, clip, AdamW, schedule."""
    r.opt.zero_grad(set_to_none=True)
    token_loss(r.model, corpus.global_batch(r.shards, step, r.batch, a.seq_length)).backward()
    torch.nn.utils.clip_grad_norm_(r.model.parameters(), a.clip_grad)
    r.opt.step()
    r.sched.step(1)


@torch.no_grad()
def heldout_loss(model, rows, micro):
    model.eval()
    losses = [token_loss(model, rows[i: i + micro]) for i in range(0, rows.shape[0], micro)]
    model.train()
    return float(torch.stack(losses).mean())


def fragments_of(model, n):
    """The syncer's partition of the model's (global name, shape) manifest into n fragments."""
    manifest = [(name, tuple(p.shape), "float32") for name, p in model.named_parameters()]
    return partition(manifest, n)


def run_diloco(o, a, corpus):
    reps = [replica(a, [k], o.batch) for k in range(o.islands)]
    from yeto_patch.syncer.model.outer import MOMENTUM_WARMUP   # (the syncer's default momentum warm-up)
    nparams = len(list(reps[0].model.parameters()))
    pushes = CodedPushes(o.push_dtype, o.push_block, o.error_feedback, o.islands, nparams) \
        if getattr(o, "coded_pushes", False) else None
    outer = OuterOptimizer(reps[0].model.parameters(), fragments_of(reps[0].model, o.fragments), o.outer_lr,
                           o.outer_momentum, MOMENTUM_WARMUP, pushes)
    final = train_diloco([r.model for r in reps], lambda k, s: train_step(reps[k], corpus, s, a), o.steps,
                         o.sync_every, outer, tau=o.overlap_steps, alpha=o.merge_alpha)
    install(list(reps[0].model.parameters()), range(len(final)), final)
    return reps[0].model


def run_plain(o, a, corpus, shards):
    """No outer step: the lone island (shards [0]) or synchronous data parallel (every shard, batch x M)."""
    r = replica(a, shards, o.batch * len(shards))
    for s in range(o.steps):
        train_step(r, corpus, s, a)
    return r.model


def unsupported(o):
    """Why the reference cannot run these demo options, or None."""
    return "--sync-warmup is not modelled" if getattr(o, "sync_warmup", 0) else None


def run(o, runs=("diloco", "lone")):
    """{run: final held-out loss} (+ initial loss, wall times) of the reference for demo options `o`."""
    from byte_corpus import ByteCorpus
    a = train_args(o)
    init_megatron(a)
    torch.set_num_threads(1)  # as the demo's islands (OMP_NUM_THREADS=1): more threads thrash a shared CPU
    corpus = ByteCorpus(a.text, num_shards=a.num_shards, heldout_frac=a.heldout_frac, seed=a.data_seed)
    heldout = corpus.heldout_windows(a.eval_seqs, a.seq_length)
    out = {"initial": heldout_loss(gpt_model(a), heldout, a.micro_batch_size), "not_modelled": NOT_MODELLED}
    train = {"diloco": lambda: run_diloco(o, a, corpus), "lone": lambda: run_plain(o, a, corpus, [0]),
             "dp": lambda: run_plain(o, a, corpus, list(range(o.islands)))}
    for name in runs:
        t0 = time.time()
        out[name] = heldout_loss(train[name](), heldout, a.micro_batch_size)
        out[f"{name}_wall_s"] = round(time.time() - t0, 1)
    return out


def parse(argv=None):
    """(demo options, runs, json path): this script takes the demo's flags, plus --runs and --json."""
    from yeto_patch.demo import cli as demo_cli
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--runs", default="diloco,lone", help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--coded-pushes", action="store_true", help="encode each replica's pseudo-gradient with the "
                    "product's codec (--push-dtype), with error feedback unless --no-error-feedback")
    ap.add_argument("--push-block", type=int, default=256, help="the codec's block with --coded-pushes "
                    "(YETO_DILOCO_BLOCK)")
    mine, rest = ap.parse_known_args(argv)
    runs = [r for r in mine.runs.split(",") if r]
    if any(r not in RUNS for r in runs):
        raise SystemExit(f"--runs: expected some of {', '.join(RUNS)}, got {mine.runs}")
    o = demo_cli.parse(rest)
    o.coded_pushes, o.push_block = mine.coded_pushes, mine.push_block
    return o, runs, mine.json


def main(argv=None):
    o, runs, path = parse(argv)
    why = unsupported(o)
    if why:
        raise SystemExit(f"diloco_reference: {why}")
    res = run(o, runs)
    print(json.dumps(res))
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
