#!/usr/bin/env python
"""DiLoCo through yeto-patch against synchronous data parallel at equal tokens: held-out loss and bytes.

Every configuration is a real run, exactly like ``yeto-patch demo``: a syncer and M islands of a small
megatron-core GPT (CPU, gloo, bf16, DistributedOptimizer) launched with torchrun, yeto-patch attached only through
PYTHONPATH and YETO_* variables, each island on its own shard of byte-level text (Python's standard library).
The baseline is the same script with synchronous data parallel over all M shards (M x the batch, the same tokens
in total), cached per setting.

    python benchmarks/convergence.py --quick         # the target configuration and 4 neighbours (~10 min idle)
    python benchmarks/convergence.py                 # the full grid: M {2,4} x H {10,50} x push dtype
                                                     # {f32,int8,int4,int4-log} x error feedback x tau {0,>0}
    python benchmarks/convergence.py --only "M=2 H=50 int4 ef tau=5" --steps 800
    python benchmarks/convergence.py --sweep outer_lr=0.5,0.7,1.0   # what closes a gap (see --help)

Columns: final held-out loss of the global model, the baseline's, their ratio (target <= 1.01 for M=2, H=50,
int4, tau>0), bytes that crossed between islands and syncer (pushes + bases) next to what a per-step FP32
gradient all-reduce over the same islands would send, and the push-only ratio (the islands' uploads against
their all-reduce sends).  Target: >= 100x fewer bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from yeto_patch.demo import cli as demo_cli  # noqa: E402
from yeto_patch.demo.run import DemoError, run as demo_run  # noqa: E402

DTYPES = ("f32", "int8", "int4", "int4-log")
TAU = 5


def label(c):
    return (f"M={c['M']} H={c['H']} {c['dtype']}{' ef' if c['ef'] else ''} tau={c['tau']}"
            + "".join(f" {k}={v}" for k, v in sorted(c.get("extra", {}).items())))


def full_grid():
    for M, H, dt, ef, tau in itertools.product((2, 4), (10, 50), DTYPES, (False, True), (0, TAU)):
        if dt == "f32" and ef:
            continue  # f32 has no quantization residual
        yield dict(M=M, H=H, dtype=dt, ef=ef, tau=min(tau, H // 2))


def quick_grid():
    yield dict(M=2, H=50, dtype="int4", ef=True, tau=TAU)     # the target configuration
    yield dict(M=2, H=50, dtype="int4", ef=False, tau=TAU)
    yield dict(M=2, H=50, dtype="f32", ef=False, tau=0)
    yield dict(M=2, H=10, dtype="int4", ef=True, tau=TAU)
    yield dict(M=4, H=50, dtype="int4", ef=True, tau=TAU)


def demo_flags(c, a):
    f = ["--islands", c["M"], "--layouts", a.layouts, "--steps", a.steps, "--sync-every", c["H"],
         "--push-dtype", c["dtype"], "--overlap-steps", c["tau"], "--fragments", a.fragments,
         "--hidden", a.hidden, "--layers", a.layers, "--seq-length", a.seq_length, "--batch", a.batch,
         "--micro-batch", a.micro_batch, "--lr", a.lr, "--warmup", a.warmup, "--eval-interval", a.eval_interval,
         "--eval-seqs", a.eval_seqs, "--progress-every", 30, "--baseline-layout", a.baseline_layout,
         "--base-wire", a.base_wire, "--outer-lr", a.outer_lr, "--sync-warmup", a.sync_warmup,
         "--error-feedback" if c["ef"] else "--no-error-feedback"]
    for k, v in c.get("extra", {}).items():
        f += [f"--{k.replace('_', '-')}", v]
    if a.cache_dir:
        f += ["--cache-dir", a.cache_dir]
    return [str(x) for x in f]


def run_one(c, a, out_root):
    out = os.path.join(out_root, label(c).replace(" ", "_").replace("=", ""))
    o = demo_cli.parse(demo_flags(c, a) + ["--out", out])
    buf = io.StringIO()
    t0 = time.time()
    try:
        with contextlib.redirect_stdout(buf):
            res = demo_run(o)
    except DemoError as err:
        with open(os.path.join(out, "demo-output.txt"), "w") as f:
            f.write(buf.getvalue())
        return dict(config=c, error=str(err).splitlines()[0], out=out, wall_s=time.time() - t0)
    with open(os.path.join(out, "demo-output.txt"), "w") as f:
        f.write(buf.getvalue())
    keep = ("initial_heldout_loss", "global_heldout_loss", "baseline_heldout_loss", "loss_ratio", "bytes_pushed",
            "bytes_pulled", "bytes_between", "allreduce_bytes", "bytes_ratio", "upload_ratio", "merges",
            "islands_identical", "islands_wall_s", "params", "warmup_steps", "warmup_allreduce_bytes",
            "bytes_ratio_diloco_only", "upload_ratio_diloco_only", "baseline_heldout_at_warmup")
    return dict(config=c, out=out, wall_s=time.time() - t0, **{k: res.get(k) for k in keep})


def _mb(x):
    return "n/a" if not x else f"{x / 1e6:.2f}"


def table(rows, target=1.01):
    warm = any(r.get("warmup_steps") for r in rows)
    head = ("| config | final loss | baseline | ratio | MB between | MB all-reduce | bytes ratio | push ratio | "
            "same model | wall s |")
    if warm:  # with a synchronous warm-up the ratios above include its K steps of all-reduce
        head += " warm-up K | bytes ratio, DiLoCo steps only | push ratio, DiLoCo steps only |"
    lines = [head, "|" + "---|" * (13 if warm else 10)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {label(r['config'])} | FAILED: {r['error'][:80]} |||||||||")
            continue
        ratio = r.get("loss_ratio")
        flag = ""
        c = r["config"]
        if c["M"] == 2 and c["H"] == 50 and c["dtype"] == "int4" and c["tau"] > 0 and ratio is not None:
            flag = " (target <= %.2f: %s)" % (target, "met" if ratio <= target else "MISSED")
        lines.append(
            f"| {label(c)} | {r['global_heldout_loss']:.4f} | {r['baseline_heldout_loss']:.4f} | "
            f"{ratio:.4f}{flag} | {_mb(r['bytes_between'])} | {_mb(r['allreduce_bytes'])} | "
            f"{(r['bytes_ratio'] or 0):.0f}x | {(r['upload_ratio'] or 0):.0f}x | "
            f"{'yes' if r['islands_identical'] else 'NO'} | {r['wall_s']:.0f} |"
            + (f" {r.get('warmup_steps') or 0} | {(r.get('bytes_ratio_diloco_only') or 0):.0f}x | "
               f"{(r.get('upload_ratio_diloco_only') or 0):.0f}x |" if warm else ""))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the target configuration and a few neighbours")
    ap.add_argument("--only", action="append", default=[], help="run only configurations whose label "
                    "contains this text (repeatable), e.g. 'M=2 H=50 int4 ef'")
    ap.add_argument("--sweep", action="append", default=[],
                    help="NAME=v1,v2: repeat every selected configuration for each value of a demo option "
                         "(outer_lr, outer_momentum, merge_alpha, fragments, base_wire, lr, warmup ...)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--layouts", default="single", help="island layout(s), as in yeto-patch demo")
    ap.add_argument("--baseline-layout", default="dp2")
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--base-wire", choices=("f32", "bf16", "int8", "int4"), default="int4",
                    help="how merged bases go to islands (the syncer's --base-wire; final models are f32)")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov learning rate (momentum 0.9)")
    ap.add_argument("--sync-warmup", type=int, default=0, metavar="K", help="train the first K steps "
                    "synchronously (the baseline's own first K steps), then DiLoCo for the rest; the K steps' "
                    "all-reduce bytes count in the bytes ratios (sweep it with --sweep sync_warmup=50,100)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--eval-seqs", type=int, default=128, help="held-out sequences (x seq-length bytes) per "
                    "evaluation; the final loss of every run is measured on the same windows")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "convergence"))
    ap.add_argument("--cache-dir", default=None, help="baseline cache (default: the demo's)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    configs = list(quick_grid() if a.quick else full_grid())
    if a.only:
        configs = [c for c in configs if any(s in label(c) for s in a.only)] or \
            [c for c in full_grid() if any(s in label(c) for s in a.only)]
    for sw in a.sweep:
        name, _, vals = sw.partition("=")
        configs = [dict(c, extra={**c.get("extra", {}), name: v}) for c in configs for v in vals.split(",")]
    if not configs:
        ap.error("no configuration selected")
    os.makedirs(a.out, exist_ok=True)
    print(f"convergence: {len(configs)} configuration(s), {a.steps} steps, GPT {a.layers}x{a.hidden} "
          f"seq {a.seq_length}, {a.batch} sequences/step/island, islands {a.layouts}, outer lr {a.outer_lr}, "
          f"bases {a.base_wire}, synchronous warm-up {a.sync_warmup} steps; output {a.out}", flush=True)
    rows = []
    t0 = time.time()
    for i, c in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] {label(c)} ...", flush=True)
        r = run_one(c, a, a.out)
        rows.append(r)
        if "error" in r:
            print(f"    FAILED: {r['error']}  (see {r['out']})", flush=True)
        else:
            print(f"    loss {r['global_heldout_loss']:.4f} vs baseline {r['baseline_heldout_loss']:.4f} "
                  f"(ratio {r['loss_ratio']:.4f}), bytes {r['bytes_ratio'] or 0:.0f}x fewer "
                  f"(push-only {r['upload_ratio'] or 0:.0f}x), {r['wall_s']:.0f}s", flush=True)
    print()
    print(table(rows))
    print(f"\n{len(rows)} runs in {time.time() - t0:.0f}s; command: python benchmarks/convergence.py "
          + " ".join(argv if argv is not None else sys.argv[1:]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
