#!/usr/bin/env python
"""DiLoCo through yeto-patch on Megatron-LM's own training loop: two islands (TP2 and PP2) against one data-parallel
job and against each island training alone, on byte-level text; held-out loss.

Every run is Megatron-LM's real ``pretrain()`` (tests/shim/scripts/pretrain_gpt_cpu.py: local layer spec, bf16,
distributed optimizer, Megatron's GPTDataset over indexed .bin/.idx files, NullTokenizer with vocabulary 257 =
256 bytes + end of document), 2 gloo ranks per job on CPU, launched with torchrun; yeto-patch is attached only
through PYTHONPATH and YETO_* variables.  Data: the Python standard library's sources split by document
(examples/byte_corpus.py) into island shards 0 and 1 and a held-out file.

- ``ddp``: one DP2 job, global batch 8 over both shards (the islands' tokens in total);
- ``lone-tp2`` / ``lone-pp2``: one island alone on its own shard, global batch 4, the same steps;
- DiLoCo rows: a syncer and the two islands (TP2 on shard 0, PP2 on shard 1, global batch 4 each, the TP2 island
  padding its vocabulary like the PP2 one so the final models are identical), ``YETO_DILOCO_SYNC_EVERY=H`` and
  the row's settings; ``defaults`` sets nothing else.

Every job ends with Megatron's own evaluation of its final model on the same held-out samples (128 sequences);
the DiLoCo rows evaluate the final cut on both islands (the same model; both figures are printed).  The last line:
``convergence_mlm: defaults X.XXXx DDP, best measured Y.YYYx DDP, lone island Z.ZZZx DDP`` (docs/convergence.md).

    python benchmarks/convergence_mlm.py          # ddp, lone islands, defaults, previous defaults, best measured
    python benchmarks/convergence_mlm.py --only ddp,defaults --row 'lr1|YETO_DILOCO_OVERLAP_STEPS=5|--outer-lr 1'
    python benchmarks/convergence_mlm.py --only lone-tp2,defaults --iters 20     # a smoke run (tests/shim)
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from tests.shim import procs as P  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "shim", "scripts", "pretrain_gpt_cpu.py")
LAYOUT = {"tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
          "pp2": ["--pipeline-model-parallel-size", "2"], "dp2": []}
# DiLoCo rows: (island variables beyond H, syncer flags)
SETTINGS = {
    "defaults": ({}, []),
    "previous defaults": ({"YETO_DILOCO_OVERLAP_STEPS": 0, "YETO_DILOCO_ERROR_FEEDBACK": 0}, ["--outer-lr", "0.7"]),
    "best measured": ({"YETO_DILOCO_OVERLAP_STEPS": 5, "YETO_DILOCO_ERROR_FEEDBACK": 1,
                       "YETO_DILOCO_MERGE_ALPHA": 0.5}, ["--outer-lr", "0.7"]),
}
ROWS = ("ddp", "lone-tp2", "lone-pp2", *SETTINGS)
VALID = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: ([0-9.eE+-]+)")


def build_data(out: str) -> dict:
    """shard0 / shard1 / heldout as Megatron indexed datasets (uint16 tokens, documents of <= 64 KiB + eod)."""
    import numpy as np
    import torch
    from byte_corpus import ByteCorpus, DOC_BLOCK
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    os.makedirs(out, exist_ok=True)
    corpus = ByteCorpus(num_shards=2)
    paths = {}
    for name, arr in (("shard0", corpus.shards[0]), ("shard1", corpus.shards[1]), ("heldout", corpus.heldout)):
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


def megatron_args(a, gbs: int, train: list, data: dict, cache: str) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", "2", "--global-batch-size", str(gbs), "--train-iters", str(a.iters),
            "--lr", str(a.lr), "--min-lr", str(a.lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters",
            str(a.warmup), "--vocab-size", "257", "--train-data-path", *train, "--valid-data-path",
            data["heldout"], "--data-cache-path", cache, "--eval-iters", str(a.eval_seqs // gbs),
            "--eval-interval", "1000000", "--transformer-impl", "local", "--use-distributed-optimizer", "--bf16",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion", "--distributed-backend", "gloo", "--log-interval", "50",
            "--seed", str(a.seed)]


def job(tmp: str, name: str, layout: str, margs: list, env: dict) -> P.Proc:
    out = os.path.join(tmp, name)
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(P.free_port()), SCRIPT, *LAYOUT[layout], *margs]
    return P.Proc(name, cmd, P.base_env(**env), os.path.join(tmp, f"{name}.log"), cwd=out)


def final_loss(proc: P.Proc) -> float:
    found = VALID.findall(proc.text())
    if not found:
        raise RuntimeError(f"{proc.name}: no final validation loss in {proc.log_path}")
    return float(found[-1][1])


def run_plain(a, row: str, data: dict, tmp: str) -> dict:
    layout, gbs, train = {"ddp": ("dp2", 8, ["1", data["shard0"], "1", data["shard1"]]),
                          "lone-tp2": ("tp2", 4, [data["shard0"]]),
                          "lone-pp2": ("pp2", 4, [data["shard1"]])}[row]
    p = job(tmp, row, layout, megatron_args(a, gbs, train, data, os.path.join(tmp, row, "cache")), {})
    rcs = P.wait_all([p], timeout=a.timeout)
    if rcs != [0]:
        raise RuntimeError(f"{row} failed (rc {rcs[0]}); log {p.log_path}:\n{p.text()[-3000:]}")
    return {"loss": final_loss(p)}


def run_diloco(a, row: str, data: dict, tmp: str) -> dict:
    env, flags = SETTINGS[row]
    d = pathlib.Path(tmp) / row.replace(" ", "-")
    d.mkdir(parents=True, exist_ok=True)
    port = P.free_port()
    key = P.key_file(d)
    syncer = P.start_syncer(d, port, islands=2, fragments=a.fragments, key=key, extra=flags)
    islands = []
    for name, layout, shard in (("tp2", "tp2", "shard0"), ("pp2", "pp2", "shard1")):
        yeto = dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID=name,
                    YETO_DILOCO_SYNC_EVERY=a.sync_every, YETO_DILOCO_TIMEOUT=900,
                    YETO_DILOCO_METRICS=str(d / name / "metrics.jsonl"), **env)
        margs = megatron_args(a, 4, [data[shard]], data, str(d / name / "cache"))
        islands.append(job(str(d), name, layout, margs, yeto))
    rcs = P.wait_all([*islands, syncer], timeout=a.timeout)
    if rcs != [0, 0, 0]:
        raise RuntimeError(f"{row} failed (rcs {rcs}):\n{P.logs([*islands, syncer])}")
    losses = [final_loss(p) for p in islands]
    return {"loss": sum(losses) / 2, "islands": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--only", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    ap.add_argument("--row", action="append", default=[], metavar="'NAME|VAR=V ...|SYNCER FLAGS'",
                    help="an extra DiLoCo row (repeatable), e.g. 'lr0.4|YETO_DILOCO_ERROR_FEEDBACK=1|--outer-lr 0.4'")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=10, help="H")
    ap.add_argument("--fragments", type=int, default=1, help="the syncer's --fragments")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-seqs", type=int, default=128, help="held-out sequences in the final evaluation")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per row")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "convergence_mlm"))
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.only.split(",") if r.strip()]
    for spec in a.row:
        name, _, rest = spec.partition("|")
        env, _, flags = rest.partition("|")
        SETTINGS[name.strip()] = (dict(kv.split("=", 1) for kv in env.split()), flags.split())
        rows.append(name.strip())
    bad = [r for r in rows if r not in ROWS and r not in SETTINGS]
    if bad:
        ap.error(f"unknown rows {bad}; choose from {', '.join(ROWS)}")
    data = build_data(os.path.join(a.out, "data"))
    tmp = os.path.join(a.out, time.strftime("run-%Y%m%d-%H%M%S"))
    os.makedirs(tmp)
    print(f"convergence_mlm: Megatron-LM pretrain(), GPT {a.layers}x{a.hidden} seq {a.seq_length}, {a.iters} "
          f"iterations, lr {a.lr} cosine, H={a.sync_every}, {a.fragments} fragment(s); output {tmp}", flush=True)
    res = {}
    for r in rows:
        t0 = time.time()
        res[r] = (run_plain if r in ("ddp", "lone-tp2", "lone-pp2") else run_diloco)(a, r, data, tmp)
        res[r]["wall_s"] = time.time() - t0
        extra = "" if "islands" not in res[r] else " (islands %.4f / %.4f)" % tuple(res[r]["islands"])
        print(f"  {r:18s} held-out loss {res[r]['loss']:.4f}{extra}  {res[r]['wall_s']:.0f}s", flush=True)
    print(table(res))
    ddp, lone = reference_losses(res)
    fig = {k: f"{res[k]['loss'] / ddp:.3f}x" if ddp and k in res else "n/a" for k in ("defaults", "best measured")}
    print(f"convergence_mlm: defaults {fig['defaults']} DDP, best measured {fig['best measured']} DDP, lone island "
          + (f"{lone / ddp:.3f}x" if lone and ddp else "n/a") + " DDP")
    return 0


def reference_losses(res: dict) -> tuple:
    """(DDP's loss, the better lone island's loss) of the rows run, None where not run."""
    lone = min((res[r]["loss"] for r in ("lone-tp2", "lone-pp2") if r in res), default=None)
    return res.get("ddp", {}).get("loss"), lone


def table(res: dict) -> str:
    ddp, lone = reference_losses(res)
    out = ["| run | held-out loss | / DDP | share of the lone-island gap recovered | wall s |", "|---|---|---|---|---|"]
    for r, v in res.items():
        ratio = f"{v['loss'] / ddp:.4f}" if ddp else "n/a"
        share = (f"{(lone - v['loss']) / (lone - ddp):+.2f}" if ddp and lone and lone != ddp and r in SETTINGS
                 else "")
        out.append(f"| {r} | {v['loss']:.4f} | {ratio} | {share} | {v['wall_s']:.0f} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
