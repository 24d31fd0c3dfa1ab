"""Training throughput of a small GPT island with yeto-patch attached (H=50, int4 pushes, tau > 0, local syncer)
next to the same run without it, as a ratio (target >= 0.97), plus the per-boundary time split from the JSONL.

    python benchmarks/boundary_overhead.py            # ~6 min on 2 cores: 2 pairs of 300-step runs
    python benchmarks/boundary_overhead.py --quick    # ~2 min: 1 pair of 150-step runs, a smaller model

Each run is an ordinary 2-rank megatron-core job on CPU (tests/shim/scripts/island_train.py, TP2 bf16
DistributedOptimizer, launched with torchrun); the attached run gets only PYTHONPATH and YETO_* variables and a
local syncer (whose CPU time counts against the attached run). The machine is shared and noisy, so the two runs
of a pair train at the same time, started together (a start barrier), and each one's rate is measured over the
same wall-clock window, from the later warm-up end to the earlier last step: whatever else holds the cores hits
both alike. The ratio is attached steps/s over plain steps/s in that window (the mean over the pairs).
The JSONL gives a second, direct figure: the time the training thread spent in boundaries (gather, encode, wait,
install), as a share of the attached run's step time.
"""
import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.shim import procs as P  # noqa: E402


def window_rates(a_end, b_end, warm):
    """Steps each run completed per second within the common window [later warm-up end, earlier last step)."""
    t0 = max(a_end[warm], b_end[warm])
    t1 = min(a_end[-2], b_end[-2])          # the last step is the final cut
    if t1 <= t0:
        raise SystemExit("the two runs did not overlap long enough; use more --steps")

    def rate(ends):
        return (bisect.bisect_left(ends, t1) - bisect.bisect_left(ends, t0)) / (t1 - t0)
    return rate(a_end), rate(b_end), t1 - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one short pair of runs of a smaller model")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--push", default="int4")
    ap.add_argument("--no-error-feedback", action="store_true")
    ap.add_argument("--warm", type=int, default=5, help="first steps left out of the window")
    ap.add_argument("--out", default=None, help="keep logs and JSONL here (default: a temporary directory)")
    a = ap.parse_args(argv)
    a.steps = a.steps or (150 if a.quick else 300)
    a.pairs = a.pairs or (1 if a.quick else 2)
    a.layers = a.layers or (2 if a.quick else 4)
    a.hidden = a.hidden or (128 if a.quick else 256)
    import pathlib
    workdir = pathlib.Path(a.out or tempfile.mkdtemp(prefix="yeto-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    key = P.key_file(workdir)
    ratios, rows, boundaries, step_ms = [], [], [], []
    t_all = time.time()
    for i in range(a.pairs):
        port = P.free_port()
        sdir = workdir / f"syncer{i}"
        sdir.mkdir(exist_ok=True)
        layout = ["--tp", "2", "--layers", str(a.layers), "--hidden", str(a.hidden), "--seq", str(a.seq),
                  "--micro", str(a.micro), "--no-save", "--start-barrier", str(workdir / f"barrier{i}")]
        env = dict(YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_SYNC_EVERY=a.sync_every, YETO_DILOCO_PUSH_DTYPE=a.push,
                   YETO_DILOCO_OVERLAP_STEPS=a.tau, YETO_DILOCO_TIMEOUT=300,
                   YETO_DILOCO_ERROR_FEEDBACK=0 if a.no_error_feedback else 1)
        syncer = P.start_syncer(sdir, port, islands=1, fragments=a.fragments, key=key)
        shim = P.start_island(workdir, f"shim{i}", port, layout, a.steps, env)
        plain = P.start_island(workdir, f"plain{i}", port, layout, a.steps, {}, attach=False)
        rcs = P.wait_all([shim, plain, syncer], timeout=3600)
        if any(rc != 0 for rc in rcs):
            print(P.logs([shim, plain, syncer]), file=sys.stderr)
            raise SystemExit(f"pair {i} failed: exit codes {rcs}")
        rs, rp = P.island_result(str(workdir / f"shim{i}")), P.island_result(str(workdir / f"plain{i}"))
        r_shim, r_plain, win = window_rates(rs["step_end"], rp["step_end"], a.warm)
        ratios.append(r_shim / r_plain)
        rows.append((i, r_plain, r_shim, win))
        step_ms.append(statistics.median(rs["step_s"][a.warm:-1]) * 1000)
        boundaries += [rec for rec in P.metrics(str(workdir / f"shim{i}"))
                       if rec["event"] == "boundary" and not rec.get("final")]
        print(f"  pair {i}: plain {r_plain:.2f} steps/s, attached {r_shim:.2f} steps/s over {win:.1f} s "
              f"-> ratio {r_shim / r_plain:.3f}", flush=True)

    ratio = statistics.mean(ratios)
    ef = "without" if a.no_error_feedback else "with"
    print()
    print(f"model: GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batches {a.micro}x2, TP2 bf16 "
          f"DistributedOptimizer, 2 CPU ranks per run; {a.steps} steps; H={a.sync_every}, {a.fragments} fragments, "
          f"push {a.push} {ef} error feedback, tau={a.tau}")
    print()
    print("| pair | without yeto-patch (steps/s) | with yeto-patch (steps/s) | window (s) | ratio |")
    print("|---|---|---|---|---|")
    for i, rp_, rs_, win in rows:
        print(f"| {i} | {rp_:.2f} | {rs_:.2f} | {win:.1f} | {rs_ / rp_:.3f} |")
    print(f"| **mean** | | | | **{ratio:.3f}** (target >= 0.97) |")
    print()
    if boundaries:
        print(f"per-boundary time split ({len(boundaries)} boundaries; gather, encode, wait and install block the "
              f"training thread; send runs on the background sender)")
        print()
        print("| part | mean (ms) | max (ms) |")
        print("|---|---|---|")
        for k in ("gather_ms", "encode_ms", "send_ms", "wait_ms", "install_ms"):
            vals = [float(b.get(k) or 0.0) for b in boundaries]
            print(f"| {k[:-3]} | {statistics.mean(vals):.1f} | {max(vals):.1f} |")
        by = statistics.mean(b["bytes"] for b in boundaries)
        lag = statistics.mean(b.get("pull_lag", 0) for b in boundaries)
        print(f"\npush size {by / 1e6:.3f} MB per boundary ({a.push}); pull lag {lag:.2f} steps on average")
        blocked = sum(float(b.get(k) or 0) for b in boundaries
                      for k in ("gather_ms", "encode_ms", "wait_ms", "install_ms"))
        steps = a.pairs * (a.steps - 1)
        print(f"training thread blocked by boundaries: {blocked / steps:.2f} ms per step = "
              f"{100 * blocked / steps / statistics.mean(step_ms):.2f}% of the median attached step "
              f"({statistics.mean(step_ms):.1f} ms)")
    print(f"\n(total {time.time() - t_all:.0f} s; logs and JSONL in {workdir})")
    with open(workdir / "summary.json", "w") as f:
        json.dump(dict(ratios=ratios, ratio=ratio, rows=rows, args=vars(a)), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
