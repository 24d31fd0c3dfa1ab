#!/usr/bin/env python
"""DiLoCo through yeto-patch against synchronous data parallel at equal tokens: held-out loss and bytes.

Every configuration is a real run, exactly like ``yeto-patch demo``: a syncer and M islands of a small
megatron-core GPT (CPU, gloo, bf16, DistributedOptimizer) launched with torchrun, yeto-patch attached only through
PYTHONPATH and YETO_* variables, each island on its own shard of byte-level text (Python's standard library).
The baseline is the same script with synchronous data parallel over all M shards (M x the batch, the same tokens
in total), cached per setting.

    python benchmarks/convergence.py --quick         # the target configuration, 4 neighbours and the regime where
                                                     # textbook DiLoCo recovers the gap (RECOVERING; ~20 min idle)
    python benchmarks/convergence.py                 # the full grid: M {2,4} x H {10,50} x push dtype
                                                     # {f32,int8,int4,int4-log} x error feedback x tau {0,>0}
    python benchmarks/convergence.py --only "M=2 H=50 int4 ef tau=5" --steps 800
    python benchmarks/convergence.py --sweep outer_lr=0.5,0.7,1.0   # what closes a gap (see --help)
    python benchmarks/convergence.py --quick --no-reference         # without the reference (faster)
    python benchmarks/convergence.py --sparse --no-reference        # the sparse push dtype's bytes/quality curve:
                                                     # int4 (ef) and topk:F+intB over F and B at the target setting

Every configuration is also run by benchmarks/diloco_reference.py (skip with --no-reference): textbook DiLoCo in
plain PyTorch on the same model, data, seed and inner optimizer (fp32, exact pushes), and the lone island (one
island alone on its own shard 0, the same steps, no DiLoCo), cached per training recipe. That separates the
algorithm's gap from yeto-patch's: if the reference is as far from the baseline as yeto-patch, DiLoCo itself
(at this M, H, model and token budget) is the cause.

Loss table: final held-out loss of yeto-patch's global model, the reference's, the baseline's (synchronous data
parallel, the demo's) and the lone island's; yeto/DDP (target <= 1.01 for M=2, H=50, int4, tau>0), reference/DDP,
yeto/reference, and the share of the lone -> DDP gap each recovers: (lone - DiLoCo) / (lone - DDP), 1 = as good as
data parallel, 0 = no better than training alone. Bytes table: bytes that crossed between islands and syncer
(pushes + bases) next to what a per-step FP32 gradient all-reduce over the same islands would send, and the
push-only ratio (the islands' uploads against their all-reduce sends).  Target: >= 100x fewer bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import diloco_reference  # noqa: E402
from yeto_patch.demo import cli as demo_cli  # noqa: E402
from yeto_patch.demo.run import DemoError, model_flags, run as demo_run  # noqa: E402

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


#: where textbook DiLoCo (the reference, tau=0) recovers a clear share of the lone -> DDP gap at the default model
#: and budget: plain averaging (outer lr 1, momentum 0) every 10 steps, 0.41. Outer Nesterov 0.7 / momentum 0.9
#: recovers 0.09 at H=50 and 0.03 at H=10 (0.4 / 0.9 at H=10: 0.23; 0.7 / 0.5 at H=50: 0.30): with two replicas and
#: few rounds, momentum 0.9 overshoots. Exact pushes and bases, so yeto-patch and the reference differ only by bf16
#: (measured: yeto-patch 0.38, yeto/ref 1.002); an algorithm check, not a bytes target (f32 every 10 steps: 5x).
RECOVERING = dict(M=2, H=10, dtype="f32", ef=False, tau=0,
                  extra=dict(outer_lr=1.0, outer_momentum=0.0, base_wire="f32"))


def quick_grid():
    yield dict(M=2, H=50, dtype="int4", ef=True, tau=TAU)     # the target configuration
    yield RECOVERING
    yield dict(M=2, H=50, dtype="int4", ef=False, tau=TAU)
    yield dict(M=2, H=50, dtype="f32", ef=False, tau=0)
    yield dict(M=2, H=10, dtype="int4", ef=True, tau=TAU)
    yield dict(M=4, H=50, dtype="int4", ef=True, tau=TAU)


#: the sparse push dtype's curve at the target setting (M=2, H=50, tau=5, error feedback): int4 first, the anchor
SPARSE_CURVE = ("int4", "topk:0.1+int4", "topk:0.05+int4", "topk:0.05+int2", "topk:0.02+int2", "topk:0.01+int2")


def sparse_grid(dtypes=SPARSE_CURVE, H=50):
    for dt in dtypes:
        yield dict(M=2, H=H, dtype=dt, ef=True, tau=min(TAU, H // 2))


def demo_flags(c, a):
    f = ["--islands", c["M"], "--layouts", a.layouts, "--steps", a.steps, "--sync-every", c["H"],
         "--push-dtype", c["dtype"], "--overlap-steps", c["tau"], "--fragments", a.fragments,
         "--hidden", a.hidden, "--layers", a.layers, "--seq-length", a.seq_length, "--batch", a.batch,
         "--micro-batch", a.micro_batch, "--lr", a.lr, "--warmup", a.warmup, "--eval-interval", a.eval_interval,
         "--eval-seqs", a.eval_seqs, "--progress-every", 30, "--baseline-layout", a.baseline_layout,
         "--base-wire", a.base_wire, "--outer-lr", a.outer_lr, "--sync-warmup", a.sync_warmup,
         "--error-feedback" if c["ef"] else "--no-error-feedback"]
    for k, v in c.get("extra", {}).items():
        f.append(f"--{k.replace('_', '-')}={v}")   # one token: a value may start with "--" (syncer_arg=--quorum=2)
    f += [f"--syncer-arg={x}" for x in a.syncer_arg]
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


def run_reference(c, a, out, cache):
    """benchmarks/diloco_reference.py for configuration c (same demo flags), in a process of its own (it applies
    megatron-core's CPU patches). The lone island (and with --reference-dp the reference's own data parallel) is
    trained once per training recipe: `cache` maps the recipe to {run: loss}."""
    flags = demo_flags(c, a)
    o = demo_cli.parse(flags)
    why = diloco_reference.unsupported(o)
    if why:
        return dict(reference_error=why)
    known = cache.setdefault(tuple(model_flags(o)) + (o.batch,), {})
    runs = ["diloco"] + [r for r in ("lone", "dp") if r not in known and (r == "lone" or a.reference_dp)]
    path, log_path = os.path.join(out, "reference.json"), os.path.join(out, "reference-output.txt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    with open(log_path, "w") as log:
        rc = subprocess.run([sys.executable, diloco_reference.__file__, *flags, "--runs", ",".join(runs),
                             "--json", path], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    if rc:
        return dict(reference_error=f"exit status {rc}, see {log_path}")
    with open(path) as f:
        res = json.load(f)
    known.update({r: res[r] for r in runs if r != "diloco"})
    return dict(reference_heldout_loss=res["diloco"], lone_heldout_loss=known["lone"],
                reference_dp_heldout_loss=known.get("dp"), reference_wall_s=sum(res[f"{r}_wall_s"] for r in runs))


def gap_share(lone, loss, ddp):
    """Share of the lone island -> data parallel gap that `loss` recovers: 1 = as good as DDP, 0 = as alone."""
    if lone is None or loss is None or ddp is None or lone == ddp:
        return None
    return (lone - loss) / (lone - ddp)


def comparisons(r):
    """The loss table's derived columns of row r."""
    yeto, ref, ddp, lone = (r.get(k) for k in ("global_heldout_loss", "reference_heldout_loss",
                                               "baseline_heldout_loss", "lone_heldout_loss"))
    return dict(reference_ratio=ref / ddp if ref and ddp else None, yeto_over_reference=yeto / ref if yeto and ref
                else None, share_yeto=gap_share(lone, yeto, ddp), share_reference=gap_share(lone, ref, ddp))


def _mb(x):
    return "n/a" if not x else f"{x / 1e6:.2f}"


def _num(x, fmt=".4f"):
    return "n/a" if x is None else format(x, fmt)


def _target(c, ratio, target):
    if c["M"] == 2 and c["H"] == 50 and c["dtype"] == "int4" and c["tau"] > 0 and ratio is not None:
        return " (target <= %.2f: %s)" % (target, "met" if ratio <= target else "MISSED")
    return ""


def loss_table(rows, target=1.01):
    lines = ["| config | yeto-patch | reference | DDP | lone island | yeto/DDP | ref/DDP | yeto/ref | "
             "gap recovered: yeto | gap recovered: ref |", "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            lines.append(f"| {label(r['config'])} | FAILED: {r['error'][:80]} |||||||||")
            continue
        ref = r.get("reference_heldout_loss")
        lines.append(
            f"| {label(r['config'])} | {r['global_heldout_loss']:.4f} | "
            f"{_num(ref) if ref is not None else r.get('reference_error', 'skipped')} | "
            f"{r['baseline_heldout_loss']:.4f} | {_num(r.get('lone_heldout_loss'))} | "
            f"{r['loss_ratio']:.4f}{_target(r['config'], r['loss_ratio'], target)} | "
            f"{_num(r.get('reference_ratio'))} | {_num(r.get('yeto_over_reference'))} | "
            f"{_num(r.get('share_yeto'), '.2f')} | {_num(r.get('share_reference'), '.2f')} |")
    return "\n".join(lines)


def bytes_table(rows):
    warm = any(r.get("warmup_steps") for r in rows)
    head = "| config | MB pushed | MB between | MB all-reduce | bytes ratio | push ratio | same model | wall s |"
    if warm:  # with a synchronous warm-up the ratios above include its K steps of all-reduce
        head += " warm-up K | bytes ratio, DiLoCo steps only | push ratio, DiLoCo steps only |"
    lines = [head, "|" + "---|" * (11 if warm else 8)]
    for r in rows:
        if "error" in r:
            continue
        lines.append(
            f"| {label(r['config'])} | {_mb(r['bytes_pushed'])} | {_mb(r['bytes_between'])} | "
            f"{_mb(r['allreduce_bytes'])} | "
            f"{(r['bytes_ratio'] or 0):.0f}x | {(r['upload_ratio'] or 0):.0f}x | "
            f"{'yes' if r['islands_identical'] else 'NO'} | {r['wall_s']:.0f} |"
            + (f" {r.get('warmup_steps') or 0} | {(r.get('bytes_ratio_diloco_only') or 0):.0f}x | "
               f"{(r.get('upload_ratio_diloco_only') or 0):.0f}x |" if warm else ""))
    return "\n".join(lines)


def progress_line(r):
    """The line printed after configuration r ran."""
    line = (f"    loss {r['global_heldout_loss']:.4f} vs baseline {r['baseline_heldout_loss']:.4f} "
            f"(ratio {r['loss_ratio']:.4f}), bytes {r['bytes_ratio'] or 0:.0f}x fewer "
            f"(push-only {r['upload_ratio'] or 0:.0f}x), {r['wall_s']:.0f}s")
    if "reference_heldout_loss" in r:
        line += (f"\n    reference {r['reference_heldout_loss']:.4f} (ratio {_num(r['reference_ratio'])}, yeto/ref "
                 f"{_num(r['yeto_over_reference'])}), lone island {_num(r['lone_heldout_loss'])}"
                 + (f", reference DP {r['reference_dp_heldout_loss']:.4f}" if r.get("reference_dp_heldout_loss")
                    else "")
                 + f"; lone->DDP gap recovered: yeto {_num(r['share_yeto'], '.2f')}, "
                 f"reference {_num(r['share_reference'], '.2f')}; {r['reference_wall_s']:.0f}s")
    elif "reference_error" in r:
        line += f"\n    reference: {r['reference_error']}"
    return line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the target configuration and a few neighbours")
    ap.add_argument("--sparse", nargs="?", const=",".join(SPARSE_CURVE), default=None, metavar="DTYPES",
                    help="the sparse push dtype's bytes/quality curve at the target setting (comma-separated "
                         "push dtypes; default: %(const)s)")
    ap.add_argument("--sparse-h", type=int, default=50, help="H of the --sparse curve")
    ap.add_argument("--only", action="append", default=[], help="run only configurations whose label "
                    "contains this text (repeatable), e.g. 'M=2 H=50 int4 ef'")
    ap.add_argument("--sweep", action="append", default=[],
                    help="NAME=v1,v2: repeat every selected configuration for each value of a demo option "
                         "(outer_lr, outer_momentum, merge_alpha, fragments, base_wire, lr, warmup ...)")
    ap.add_argument("--syncer-arg", action="append", default=[], metavar="FLAG",
                    help="extra flag for the syncer of every run, e.g. --syncer-arg=--quorum=2 (the fixed roster: "
                         "no timing in which pushes a merge holds, for comparing codecs)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--layouts", default="single", help="island layout(s), as in yeto-patch demo")
    ap.add_argument("--baseline-layout", default="dp2")
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--base-wire", type=demo_cli.base_wire_type, default="int4", metavar="DTYPE",
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
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip benchmarks/diloco_reference.py (textbook DiLoCo and the lone island): faster")
    ap.add_argument("--reference-dp", action="store_true",
                    help="the reference also trains its own data-parallel run (a sanity check of the baseline)")
    a = ap.parse_args(argv)
    configs = list(sparse_grid(a.sparse.split(","), a.sparse_h) if a.sparse else quick_grid() if a.quick else full_grid())
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
    rows, plain_runs = [], {}
    t0 = time.time()
    for i, c in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] {label(c)} ...", flush=True)
        r = run_one(c, a, a.out)
        rows.append(r)
        if "error" in r:
            print(f"    FAILED: {r['error']}  (see {r['out']})", flush=True)
            continue
        if a.reference:
            r.update(run_reference(c, a, r["out"], plain_runs))
        r.update(comparisons(r))
        print(progress_line(r), flush=True)
    print()
    print(loss_table(rows))
    print()
    print(bytes_table(rows))
    if a.reference:
        print(f"\nreference: textbook DiLoCo, fp32, exact pushes; not modelled: {diloco_reference.NOT_MODELLED}")
    print(f"\n{len(rows)} runs in {time.time() - t0:.0f}s; command: python benchmarks/convergence.py "
          + " ".join(argv if argv is not None else sys.argv[1:]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
