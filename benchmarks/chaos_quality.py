#!/usr/bin/env python
"""Quality under failures: real megatron-core islands of different speeds, one killed and restarted from its
checkpoint mid-run; the final held-out loss against the same run without the failure and against the fixed roster.

Every island is Megatron-LM's real ``pretrain()`` (tests/shim/scripts/pretrain_gpt_cpu.py: local layer spec,
bf16, distributed optimizer, byte-level text of the Python standard library split into one shard per island and a
held-out file, as benchmarks/convergence_mlm.py), one gloo rank each on CPU, launched with torchrun, yeto-patch
attached only through PYTHONPATH and YETO_* variables (``YETO_DILOCO_SYNC_EVERY=auto:H``, the other defaults).
Island speeds differ by a sleep per iteration (speed s: the island's iteration time / s). Island 1 is SIGKILLed at
a random moment of iteration --kill-at, kept down --down seconds and relaunched with --load (its last checkpoint,
every --save-interval iterations). Runs:

- ``defaults, failure``: the syncer's defaults (elastic rounds, adaptive grace window);
- ``defaults, no failure``: the same without the kill;
- ``fixed roster, failure``: ``--quorum`` = the number of islands.

Every island ends with Megatron's evaluation of the final model (the final cut: the same model on every island).
Last line: ``chaos_quality: defaults with a failure X.XXXx the run without, fixed roster Y.YYYx`` (target: within
2%, docs/operations.md).

    python benchmarks/chaos_quality.py                     # 3 islands, 200 iterations (about 30 minutes idle)
    python benchmarks/chaos_quality.py --iters 40 --kill-at 15 --down 20     # a smoke run
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from tests.shim import procs as P  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "shim", "scripts", "pretrain_gpt_cpu.py")
VALID = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: ([0-9.eE+-]+)")
RUNS = {"defaults, failure": ([], True), "defaults, no failure": ([], False),
        "fixed roster, failure": (["--quorum", "{n}"], True)}


def build_data(out: str, shards: int) -> dict:
    """shard0..shard{n-1} / heldout as Megatron indexed datasets (uint16 tokens, documents of <= 64 KiB + eod)."""
    import numpy as np
    import torch
    from byte_corpus import DOC_BLOCK, ByteCorpus
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    os.makedirs(out, exist_ok=True)
    corpus = ByteCorpus(num_shards=shards)
    paths = {}
    for name, arr in [(f"shard{k}", corpus.shards[k]) for k in range(shards)] + [("heldout", corpus.heldout)]:
        prefix = os.path.join(out, name)
        paths[name] = prefix
        if os.path.exists(prefix + ".idx"):
            continue
        b = IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=np.uint16)
        for off in range(0, arr.size, DOC_BLOCK):
            doc = np.append(arr[off:off + DOC_BLOCK].astype(np.uint16), np.uint16(256))
            b.add_document(torch.from_numpy(doc.astype(np.int64)), [doc.size])
        b.finalize(prefix + ".idx.tmp")
        os.replace(prefix + ".bin.tmp", prefix + ".bin")
        os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return paths


def megatron_args(a, shard: str, data: dict, cache: str, ckpt: str) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(a.iters),
            "--lr", str(a.lr), "--min-lr", str(a.lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters",
            str(a.warmup), "--vocab-size", "257", "--train-data-path", shard, "--valid-data-path", data["heldout"],
            "--data-cache-path", cache, "--eval-iters", str(a.eval_seqs // 4), "--eval-interval", "1000000",
            "--transformer-impl", "local", "--use-distributed-optimizer", "--bf16",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion", "--distributed-backend", "gloo", "--log-interval", "50", "--seed",
            str(a.seed), "--save", ckpt, "--save-interval", str(a.save_interval), "--hidden-dropout", "0",
            "--attention-dropout", "0"]


def island(d: pathlib.Path, name: str, margs: list, env: dict) -> P.Proc:
    out = d / name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(P.free_port()), SCRIPT, *margs]
    return P.Proc(name, cmd, P.base_env(**env), str(d / f"{name}.log"), cwd=str(out))


def final_loss(proc: P.Proc) -> float:
    found = VALID.findall(proc.text())
    if not found:
        raise RuntimeError(f"{proc.name}: no final validation loss in {proc.log_path}")
    return float(found[-1][1])


def run(a, label: str, data: dict, root: pathlib.Path) -> dict:
    flags, failure = RUNS[label]
    n = len(a.speeds)
    d = root / label.replace(", ", "-").replace(" ", "-")
    d.mkdir(parents=True)
    port = P.free_port()
    key = P.key_file(d)
    syncer = P.start_syncer(d, port, islands=n, fragments=a.fragments, key=key, elastic=True,
                            extra=[x.replace("{n}", str(n)) for x in flags])
    procs, islands = [syncer], []

    def start(k, extra=()):
        name = f"i{k}"
        env = dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID=name,
                   YETO_DILOCO_SYNC_EVERY=a.sync_every, YETO_DILOCO_TIMEOUT=900,
                   YETO_DILOCO_METRICS=str(d / f"{name}.jsonl"))
        sleep = a.step_s * (1.0 / a.speeds[k] - 1.0)
        margs = megatron_args(a, data[f"shard{k}"], data, str(d / name / "cache"), str(d / name / "ckpt"))
        p = island(d, name + ("-restart" if extra else ""), [*margs, "--sleep-per-iteration", f"{sleep:.3f}", *extra],
                   env)
        procs.append(p)
        return p
    t0 = time.time()
    try:
        islands = [start(k, ["--crash-at-iteration", str(a.kill_at)] if failure and k == 1 else []) for k in range(n)]
        if failure:
            assert P.wait_all([islands[1]], timeout=a.timeout) != [0], P.logs(procs)
            time.sleep(a.down)
            islands[1] = start(1, ["--load", str(d / "i1" / "ckpt")])
        rcs = P.wait_all([syncer, *islands], timeout=a.timeout)
        if rcs != [0] * (n + 1):
            raise RuntimeError(f"{label} failed (rcs {rcs}):\n{P.logs(procs)}")
    finally:
        for p in procs:
            p.kill()
    losses = [final_loss(p) for p in islands]
    return {"loss": sum(losses) / n, "islands": losses, "wall_s": time.time() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", default=";".join(RUNS), help="semicolon-separated: " + "; ".join(RUNS))
    ap.add_argument("--speeds", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.7, 0.5])
    ap.add_argument("--step-s", type=float, default=0.3, help="the iteration time the speeds scale (s)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--kill-at", type=int, default=None, help="iteration island 1 is killed at (default: 45%%)")
    ap.add_argument("--down", type=float, default=60.0, help="seconds island 1 stays down")
    ap.add_argument("--save-interval", type=int, default=20)
    ap.add_argument("--sync-every", default="auto:10", help="YETO_DILOCO_SYNC_EVERY")
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-seqs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "chaos_quality"))
    a = ap.parse_args(argv)
    a.kill_at = a.kill_at or max(2, int(0.45 * a.iters))
    labels = [r.strip() for r in a.runs.split(";") if r.strip()]   # (the labels themselves hold commas)
    if set(labels) - set(RUNS):
        ap.error(f"--runs: unknown {sorted(set(labels) - set(RUNS))}; known: {'; '.join(RUNS)}")
    if a.kill_at <= a.save_interval:
        ap.error("--kill-at must come after the first checkpoint (--save-interval)")
    random.seed(a.seed)
    data = build_data(os.path.join(a.out, "data"), len(a.speeds))
    root = pathlib.Path(a.out) / time.strftime("run-%Y%m%d-%H%M%S")
    root.mkdir(parents=True)
    print(f"chaos_quality: {len(a.speeds)} islands at speeds {a.speeds}, {a.iters} iterations, "
          f"YETO_DILOCO_SYNC_EVERY={a.sync_every}; island i1 killed at iteration {a.kill_at}, down {a.down:.0f}s, "
          f"checkpoints every {a.save_interval}; output {root}", flush=True)
    res = {}
    for label in labels:
        res[label] = run(a, label, data, root)
        r = res[label]
        print(f"  {label:22s} held-out loss {r['loss']:.4f} (islands {', '.join(f'{x:.4f}' for x in r['islands'])})"
              f"  {r['wall_s']:.0f}s", flush=True)
    base = res.get("defaults, no failure", {}).get("loss")
    print("| run | held-out loss | / no failure |\n|---|---|---|")
    for label, r in res.items():
        print(f"| {label} | {r['loss']:.4f} | {r['loss'] / base:.4f} |" if base else f"| {label} | {r['loss']:.4f} | |")
    fig = {k: f"{res[k]['loss'] / base:.3f}x" if base and k in res else "n/a"
           for k in ("defaults, failure", "fixed roster, failure")}
    print(f"chaos_quality: defaults with a failure {fig['defaults, failure']} the run without, fixed roster "
          f"{fig['fixed roster, failure']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
