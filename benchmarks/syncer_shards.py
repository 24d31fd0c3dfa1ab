"""Sharded syncer: per-shard memory and aggregate merge throughput for 1, 2 and 4 shards, in one run.

    python benchmarks/syncer_shards.py [--quick] [--params P] [--fragments F] [--islands M] [--rounds R]
                                       [--shards 1,2,4] [--threads-per-shard T] [--json out.json]

One model of P float32 parameters in F equal tensors (the layout and shard assignment the syncer computes:
``layout.partition`` and ``shards.assign``). For each shard count N, N shard processes run at the same time,
each a real ``Coordinator`` with ``--shard I/N`` semantics: INIT of the fragments it owns, then R rounds in which
M islands' int4 pushes of every owned fragment are accepted (validated, decoded, folded) and merged (Nesterov).
Each process reports its peak RSS (ru_maxrss) and its merge time; the figures are

* per-shard peak RSS (the largest shard's) and its ratio to one syncer's: about 1/N plus the interpreter and the
  pushes in flight (each shard holds state for its fragments only);
* aggregate merge throughput (parameters merged per second, all shards together, wall time of the slowest) and
  its ratio to one syncer's: it scales with the cores the shards get. By default every shard count shares this
  machine's cores (one syncer already merges on all of them); `--threads-per-shard 1` gives each shard one core,
  so N shards use N cores (up to the CPU count).

The pushes are encoded once per process before timing (an island's work, not the syncer's).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from yeto_patch.syncer.model.layout import fragment_numels, partition  # noqa: E402
from yeto_patch.syncer.model.runner import ChunkRunner  # noqa: E402
from yeto_patch.syncer.rounds.coordinator import Coordinator  # noqa: E402
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings  # noqa: E402
from yeto_patch.syncer.rounds.pushes import ReceivedPush
from yeto_patch.syncer.shards.spec import ShardSpec, assign  # noqa: E402
from yeto_patch.wire import codecs  # noqa: E402


def manifest(params: int, fragments: int) -> list:
    n = params // fragments
    return [(f"decoder.layers.{i}.mlp.linear_fc1.weight", (n,), "float32") for i in range(fragments)]


def worker(params, fragments, islands, rounds, index, count, threads) -> dict:
    """One shard: INIT its fragments, then `rounds` rounds of `islands` int4 pushes per fragment, merged."""
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # interpreter + imports
    runner = ChunkRunner(threads)
    coord = Coordinator(MergeSettings(outer="nesterov"), RoundSettings(islands=islands), runner,
                        shard=ShardSpec(index, count))
    coord.set_manifest(manifest(params, fragments), fragments)
    rng = np.random.default_rng(index)
    for f in coord.owned:
        coord.init_fragment(f, rng.standard_normal(coord.frags[f].numel, dtype=np.float32))
    for k in range(islands):
        coord.join(f"i{k}", "1")
    pushes = {f: [codecs.encode("int4", rng.standard_normal(coord.frags[f].numel, dtype=np.float32) * 0.01,
                                threads=threads) for _ in range(islands)] for f in coord.owned}
    times = []
    for rnd in range(rounds):
        t0 = time.perf_counter()
        for f in coord.owned:
            for k, body in enumerate(pushes[f]):
                coord.accept(ReceivedPush(f"i{k}", f, rnd, "int4", codecs.DEFAULT_BLOCK, body, steps=1))
            assert coord.merge(f).ok
        times.append(time.perf_counter() - t0)
    merge_s = sum(times[1:]) / (rounds - 1) if rounds > 1 else times[0]   # (round 0 pays first-touch faults)
    return {"shard": index, "owned": coord.owned, "params": int(sum(coord.frags[f].numel for f in coord.owned)),
            "merge_s": merge_s, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "start_rss": rss_start}


def run_shards(a, count) -> dict:
    """`count` shard processes at once; their reports and the wall time of the slowest."""
    threads = a.threads_per_shard or max(1, (os.cpu_count() or 1) // count)
    cmd = [sys.executable, __file__, "--worker", "--params", str(a.params), "--fragments", str(a.fragments),
           "--islands", str(a.islands), "--rounds", str(a.rounds), "--threads", str(threads)]
    procs = [subprocess.Popen([*cmd, "--index", str(i), "--count", str(count)], stdout=subprocess.PIPE, text=True)
             for i in range(count)]
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode:
            raise SystemExit(f"shard worker failed ({p.returncode})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    wall = max(r["merge_s"] for r in reports)
    merged = sum(r["params"] for r in reports)   # per round
    return {"shards": count, "reports": reports, "peak_rss": max(r["peak_rss"] for r in reports),
            "state_rss": max(r["peak_rss"] - r["start_rss"] for r in reports),
            "wall_s": wall, "params_per_s": merged / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small model (CI setting)")
    ap.add_argument("--params", type=int, default=64 << 20)
    ap.add_argument("--fragments", type=int, default=8)
    ap.add_argument("--islands", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--threads-per-shard", type=int, default=0, help="merge threads of each shard (default 0: the "
                    "CPU count / shards, so every count shares this machine's cores; 1: one core per shard, to see "
                    "throughput scale with the cores the shards get)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.params, a.fragments, a.islands, a.rounds, a.index, a.count, a.threads)))
        return 0
    if a.quick:
        a.params, a.rounds = 4 << 20, 3
    counts = [int(x) for x in a.shards.split(",")]
    numels = fragment_numels(manifest(a.params, a.fragments), partition(manifest(a.params, a.fragments), a.fragments))
    print(f"model: {a.params / 1e6:.1f} M float32 parameters in {a.fragments} fragments, {a.islands} islands' int4 "
          f"pushes, {a.rounds} rounds; {os.cpu_count()} CPUs, "
          f"{a.threads_per_shard or 'CPUs / shards'} merge thread(s) per shard")
    results = []
    for n in counts:
        r = run_shards(a, n)
        results.append(r)
        base = results[0]
        print(f"{n} shard(s) {assign(numels, n)}: per-shard peak RSS {r['peak_rss'] / 2**20:.1f} MiB, of it "
              f"{r['state_rss'] / 2**20:.1f} MiB after start-up ({r['state_rss'] / base['state_rss']:.2f}x of "
              f"{base['shards']}); round wall {r['wall_s']:.3f}s, {r['params_per_s'] / 1e6:.1f} M params merged/s "
              f"({r['params_per_s'] / base['params_per_s']:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"params": a.params, "fragments": a.fragments, "islands": a.islands, "rounds": a.rounds,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
