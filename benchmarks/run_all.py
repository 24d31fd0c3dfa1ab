#!/usr/bin/env python
"""Run every yeto-patch benchmark with its quick setting and write one markdown report.

    python benchmarks/run_all.py                       # -> bench-out/benchmarks.md (and printed)
    python benchmarks/run_all.py --only wire,syncer    # a subset
    python benchmarks/run_all.py --full                # each benchmark's default (long) setting

Benchmarks (each is a script in this folder that prints its own table and exits):
  wire         wire_codecs.py         codec / digest throughput against memcpy
  syncer       syncer_merge.py        fold + outer step GB/s against memory bandwidth; INIT/BCAST over loopback
  gather       master_gather.py       chunked FP32 master gathers over gloo
  overhead     boundary_overhead.py   island throughput with yeto-patch next to without
  scaling      boundary_scaling.py    training-thread time per boundary against model size and own-shard memcpy
  convergence  convergence.py         DiLoCo via yeto-patch against synchronous data parallel, loss and bytes
  mlm          convergence_mlm.py     two islands on Megatron-LM's pretrain() against the lone island from the same
                                      start and textbook DiLoCo (--quick: the CI setting, F = 4, each island
                                      initializing)
  fuzz         fuzz_syncer.py         hostile frames and handshakes against a running syncer; state unchanged

The report starts with one summary table (benchmark, command, status, wall time) followed by each benchmark's
own output. A benchmark that is missing or fails is reported as such; the others still run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "benchmarks")
BENCHMARKS = [
    ("wire", "wire_codecs.py"),
    ("syncer", "syncer_merge.py"),
    ("gather", "master_gather.py"),
    ("overhead", "boundary_overhead.py"),
    ("scaling", "boundary_scaling.py"),
    ("convergence", "convergence.py"),
    ("mlm", "convergence_mlm.py"),
    ("fuzz", "fuzz_syncer.py"),
]


def _versions():
    import importlib.metadata as md
    out = [f"Python {platform.python_version()}"]
    for d in ("torch", "megatron-core", "numpy"):
        try:
            out.append(f"{d} {md.version(d)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(out)


def _body(text):
    """A benchmark's output as markdown: its own markdown table lines as they are, everything else fenced."""
    lines = text.rstrip().splitlines()
    out, fence = [], []

    def flush():
        if fence and any(x.strip() for x in fence):
            out.extend(["```"] + fence + ["```"])
        fence.clear()

    for ln in lines:
        if ln.lstrip().startswith("|") and ln.rstrip().endswith("|"):
            if not out or not out[-1].lstrip().startswith("|"):
                flush()
                out.append("")
            out.append(ln)
        else:
            if out and out[-1].lstrip().startswith("|"):
                out.append("")
            fence.append(ln)
    flush()
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(n for n, _ in BENCHMARKS))
    ap.add_argument("--full", action="store_true", help="run each benchmark without --quick")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "benchmarks.md"))
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args(argv)
    chosen = BENCHMARKS
    if a.only:
        want = {x.strip() for x in a.only.split(",") if x.strip()}
        unknown = want - {n for n, _ in BENCHMARKS}
        if unknown:
            ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
        chosen = [(n, s) for n, s in BENCHMARKS if n in want]
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    results = []
    for name, script in chosen:
        path = os.path.join(HERE, script)
        cmd = [a.python, os.path.join("benchmarks", script)] + ([] if a.full else ["--quick"])
        shown = "python " + " ".join(cmd[1:])
        if not os.path.exists(path):
            results.append((name, shown, "missing", 0.0, f"{script} is not in this checkout"))
            print(f"== {name}: {script} is missing", flush=True)
            continue
        print(f"== {name}: {shown}", flush=True)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=a.timeout)
            status = "ok" if p.returncode == 0 else f"exit {p.returncode}"
            output = p.stdout
        except subprocess.TimeoutExpired as e:
            status = f"timed out after {a.timeout:.0f}s"
            output = (e.stdout or b"").decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        wall = time.time() - t0
        print(output.rstrip(), flush=True)
        print(f"== {name}: {status} in {wall:.0f}s\n", flush=True)
        results.append((name, shown, status, wall, output))
    md = [f"# yeto-patch benchmarks ({'full' if a.full else 'quick'} settings)", "",
          f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"{_versions()}. Reproduce: `python benchmarks/run_all.py{' --full' if a.full else ''}`.", "",
          "| benchmark | command | status | wall time |", "|---|---|---|---|"]
    for name, shown, status, wall, _ in results:
        md.append(f"| {name} | `{shown}` | {status} | {wall:.0f} s |")
    for name, shown, status, wall, output in results:
        md += ["", f"## {name}", "", f"`{shown}`: {status}, {wall:.0f} s", "", _body(output)]
    text = "\n".join(md) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    print(f"report: {a.out}")
    return 0 if all(r[2] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
