"""Test helpers: two (or more) islands on Megatron-LM's own loop (tests/shim/scripts/pretrain_gpt_cpu.py, 2 ranks
each: TP2, PP2, DP2 or EP2) and one syncer with a fixed roster of them; the others start once the syncer saw the
first one join, so the connection order is forced; tau = 0 (synchronous, reproducible bits) unless a test sets
it. Every rank dumps its FP32 masters and weights at the first forward step (after the island's start, tied
output-layer copy included: ``<island>/start.rank*.npz``) and at the end (``<island>/final.rank*.npz``). Used by
tests/shim/test_megatron_lm_islands.py, tests/shim/test_moe_islands.py and benchmarks/init_compare.py."""
from __future__ import annotations

import os
import pathlib
import sys
import time

import numpy as np

from tests.shim import procs as P

SCRIPT = os.path.join(P.ROOT, "tests", "shim", "scripts", "pretrain_gpt_cpu.py")
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
           "dp2": [], "ep2": ["--expert-model-parallel-size", "2"]}
# a small MoE GPT (every layer: 4 experts, top-2, alltoall dispatcher, SequentialMLP; no linear biases, which
# SequentialMLP with TP1 cannot train on: an in-place-on-view autograd error in megatron-core's mlp.py)
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-ffn-hidden-size", "64", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff",
       "1e-2", "--disable-bias-linear"]
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.weight(tied)")
TIED = "output_layer.weight(tied)"


def mlm_args(vocab, iters, extra=()):
    """A tiny GPT (2 layers, hidden 64, learned absolute positions, tied embeddings), bf16, distributed optimizer,
    mock data, global batch 4."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "1e-3", "--lr-decay-style", "constant", "--vocab-size",
            str(vocab), "--mock-data", "--transformer-impl", "local", "--use-distributed-optimizer", "--bf16",
            "--eval-iters", "0", "--eval-interval", "1000", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--distributed-backend", "gloo", "--log-interval", "1", "--seed", "1234", *extra]


def island(tmp, name, layout, port, key, args, env_extra=None):
    out = os.path.join(tmp, name)
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(P.free_port()), SCRIPT, *LAYOUTS[layout], *args,
           "--export-npz-at-start", os.path.join(out, "start"), "--export-npz", os.path.join(out, "final")]
    env = dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID=name,
               YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_OVERLAP_STEPS=0, YETO_DILOCO_TIMEOUT=900,
               YETO_DILOCO_METRICS=os.path.join(out, "metrics.jsonl"), **(env_extra or {}))
    return P.Proc(name, cmd, P.base_env(**env), os.path.join(tmp, f"{name}.log"), cwd=out)


def run_pair(tmp, first, second, vocab=100, iters=2, extra=None, env=None, timeout=1200):
    """first/second: (island id, layout); see run_islands. Returns (rcs, (first, second, syncer))."""
    return run_islands(tmp, [first, second], vocab, iters, extra, env, timeout)


def run_islands(tmp, islands, vocab=100, iters=2, extra=None, env=None, timeout=1200):
    """islands: [(island id, layout), ...] with a fixed roster of all of them; they start at once, but every one
    after the first waits at its first train_step (where an island connects) until the syncer logged that the
    first joined. extra/env: {island id: extra Megatron arguments / YETO_* variables}. Returns (rcs, (*islands,
    syncer))."""
    extra, env = extra or {}, env or {}
    tmp = str(tmp)
    port = P.free_port()
    key = P.key_file(pathlib.Path(tmp))
    go = os.path.join(tmp, "others-may-connect")
    syncer = P.start_syncer(pathlib.Path(tmp), port, islands=len(islands), fragments=2, key=key,
                            extra=("--init-lowest-id",))
    procs = [island(tmp, name, layout, port, key,
                    [*mlm_args(vocab, iters, extra.get(name, ())), *(["--wait-for-file", go] if k else [])],
                    env.get(name))
             for k, (name, layout) in enumerate(islands)]
    first = islands[0][0]
    deadline = time.time() + timeout
    while f"island {first} joined" not in syncer.text():
        if any(p.poll() is not None for p in (*procs, syncer)) or time.time() > deadline:
            break
        time.sleep(0.3)
    open(go, "w").close()
    rcs = P.wait_all([*procs, syncer], timeout=max(60.0, deadline - time.time()))
    return rcs, (*procs, syncer)


def dump(tmp, name, when="start", kind="master") -> dict:
    return P.npz_parts(os.path.join(str(tmp), name, f"{when}.rank*.npz"), kind)


def initializer(syncer_log: str) -> str:
    """The island whose INIT the syncer took (from its log line)."""
    key = "run initialized from island "
    line = next(x for x in syncer_log.splitlines() if key in x)
    return line.split(key, 1)[1].split("'s INIT", 1)[0]


def compare(init: dict, other: dict, real_rows: int) -> list:
    """[(name, part, max|d|, |d|, |init|)] for every tensor of `other` against its INIT tensor (a tied copy
    against the INIT embedding); vocabulary tensors split into real rows and padding rows; tensors of the INIT
    the other side lacks are listed as missing."""
    rows = []
    for n in sorted(other):
        ref = "embedding.word_embeddings.weight" if n == TIED else n
        x, y = init.get(ref), other[n]
        if x is None:
            rows.append((n, "not in INIT", float("nan"), float("nan"), float("nan")))
            continue
        parts = [("all", x, y)]
        if n in VOCAB:
            k = min(real_rows, x.shape[0], y.shape[0])
            parts = [("real rows", x[:k], y[:k])]
            m = min(x.shape[0], y.shape[0])
            if m > k:
                parts.append((f"pad rows {k}:{m}", x[k:m], y[k:m]))
        elif x.shape != y.shape:
            rows.append((n, f"shape {x.shape}/{y.shape}", float("nan"), float("nan"), float("nan")))
            continue
        for part, xa, ya in parts:
            d = xa.astype(np.float64) - ya.astype(np.float64)
            rows.append((n, part, float(np.abs(d).max()) if d.size else 0.0, float(np.linalg.norm(d)),
                         float(np.linalg.norm(xa))))
    for n in sorted(k for k in init if k not in other and k != TIED):
        rows.append((n, "missing here", float("nan"), float("nan"), float("nan")))
    return rows


def differing(rows, padding=False) -> list:
    """(name, part) of the rows that are not equal (padding rows only with padding=True)."""
    return [(n, part) for n, part, mx, _, _ in rows if (padding or not part.startswith("pad")) and not mx == 0.0]


def table(rows) -> str:
    out = [f"{'tensor':52s} {'part':16s} {'max|d|':>10s} {'|d|':>10s} {'|INIT|':>10s}"]
    out += [f"{n:52s} {part:16s} {mx:10.3e} {nd:10.3e} {ni:10.3e}" for n, part, mx, nd, ni in rows]
    return "\n".join(out)
