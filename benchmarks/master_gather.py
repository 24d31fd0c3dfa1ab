"""Throughput of the island's FP32 master read / write on a 4-rank CPU island (real megatron-core, gloo).

    python benchmarks/master_gather.py [--quick] [--tp 2] [--hidden 512] [--layers 8] [--chunk-mib 4]

Builds a bf16 GPTModel with a DistributedOptimizer (TP2 x DP2 by default) in 4 spawned gloo processes and
measures, in the same run:
- read: the whole model streamed to rank 0 as float32 chunks (MasterView.read),
- write: rank 0's float32 values installed everywhere (MasterView.write, mode replace),
- raw gloo broadcast of the same number of bytes from rank 0 to all ranks (chunked like the sync),
- raw gloo point-to-point gather of the same bytes to rank 0 (each other rank sends its share),
- snapshot: each rank's own shard of the model's FP32 masters copied to host buffers (MasterView.snapshot_delta:
  what the training thread does at a boundary with tau >= 1, no communication), slowest rank,
- background gather: that snapshot turned into the delta and streamed to rank 0 from a second thread on a gloo
  group of its own (MasterView.gather: what the push pipeline does beside training),
and the peak extra resident memory per rank during read and write, next to the chunk size.
Figures are GB/s of float32 model data (1 GB = 1e9 bytes).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _RssPeak:
    def __init__(self):
        import psutil
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def stop(self):
        self._stop = True
        self.t.join()
        return max(self.peak, self.proc.memory_info().rss) - self.base


def bench_worker(cfg_kwargs: dict, chunk_bytes: int, repeat: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from tests.mcore import harness
    from yeto_patch.island import IslandComm, MasterView, build_manifest

    rank = dist.get_rank()
    ctx = harness.build(harness.RunCfg(**cfg_kwargs))
    comm = IslandComm(timeout_s=600)
    man = build_manifest(ctx["model"], comm=comm)
    view = MasterView(ctx["model"], ctx["optimizer"], man, chunk_bytes=chunk_bytes, comm=comm)
    total = man.total_numel() * 4
    got = [0]

    def sink(e, off, arr):
        got[0] += arr.nbytes

    const = np.full(chunk_bytes // 4, 0.001, dtype=np.float32)

    def source(e, off, n):
        return const[:n]

    view.read([0], sink if rank == 0 else None)       # warm-up
    view.write([0], source if rank == 0 else None)
    out = dict(model_bytes=total, read=[], write=[], bcast=[], p2p=[], read_rss=0, write_rss=0, snapshot=[],
               bg_gather=[])
    bg = IslandComm(timeout_s=600)   # the push pipeline's own group
    g = comm.group
    buf = torch.empty(chunk_bytes // 4, dtype=torch.float32)
    for _ in range(repeat):
        comm.barrier()
        got[0] = 0
        mon = _RssPeak()
        t = time.perf_counter()
        view.read(None, sink if rank == 0 else None)
        out["read"].append(time.perf_counter() - t)
        out["read_rss"] = max(out["read_rss"], mon.stop())
        if rank == 0:
            assert got[0] == total, (got[0], total)
        comm.barrier()
        mon = _RssPeak()
        t = time.perf_counter()
        view.write(None, source if rank == 0 else None)
        out["write"].append(time.perf_counter() - t)
        out["write_rss"] = max(out["write_rss"], mon.stop())
        # raw gloo broadcast of the same bytes, chunked
        comm.barrier()
        t = time.perf_counter()
        left = total // 4
        while left > 0:
            n = min(left, buf.numel())
            dist.broadcast(buf[:n], src=0, group=g)
            left -= n
        out["bcast"].append(time.perf_counter() - t)
        # raw point-to-point gather of the same bytes to rank 0 (the others send equal shares)
        comm.barrier()
        world = dist.get_world_size()
        share = (total // 4) // max(1, world - 1)
        t = time.perf_counter()
        if rank == 0:
            bufs = [torch.empty(buf.numel(), dtype=torch.float32) for _ in range(world - 1)]
            left = share
            while left > 0:
                n = min(left, buf.numel())
                works = [dist.irecv(bufs[i][:n], src=i + 1, group=g) for i in range(world - 1)]
                for w in works:
                    w.wait()
                left -= n
        else:
            left = share
            while left > 0:
                n = min(left, buf.numel())
                dist.send(buf[:n], dst=0, group=g)
                left -= n
        out["p2p"].append(time.perf_counter() - t)
        # the background push path: snapshot of the own shard, then its gather from another thread and group
        view.snapshot_anchor()
        comm.barrier()
        t = time.perf_counter()
        snap = view.snapshot_delta(range(len(man)))
        out["snapshot"].append(time.perf_counter() - t)
        comm.barrier()
        got[0] = 0
        t = time.perf_counter()
        th = threading.Thread(target=view.gather, args=(range(len(man)), snap, sink if rank == 0 else None, bg))
        th.start()
        th.join()
        out["bg_gather"].append(time.perf_counter() - t)
        if rank == 0:
            assert got[0] == total, (got[0], total)
        del snap
    out["peak_buffer_bytes"] = view.stats["peak_buffer_bytes"]
    out["anchor_bytes"] = view.anchor_bytes()
    out["n_entries"] = len(man)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, one repetition (smoke run)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--fp32", action="store_true", help="fp32 model (FP32 masters are the params)")
    a = ap.parse_args()
    if a.quick:
        a.hidden, a.layers, a.repeat, a.chunk_mib = 256, 4, 1, 1.0
    from tests.mcore.pool import WorkerPool
    cfg = dict(tp=a.tp, pp=a.pp, bf16=not a.fp32, hidden=a.hidden, ffn=4 * a.hidden, heads=8, layers=a.layers,
               vocab=32000 if not a.quick else 4096, vocab_divisible_by=128, micro=max(2, a.pp))
    chunk = int(a.chunk_mib * (1 << 20))
    t0 = time.time()
    with WorkerPool(4, start_timeout=1200, task_timeout=3000, pg_timeout_s=900) as pool:
        res = pool.run("master_gather:bench_worker", cfg, chunk, a.repeat, timeout=3000)
    r0 = res[0]
    gb = r0["model_bytes"] / 1e9
    best = lambda k: min(max(r[k][i] for r in res) for i in range(a.repeat))  # noqa: E731 slowest rank, best rep
    rd, wr, bc, pp = best("read"), best("write"), best("bcast"), best("p2p")
    sn, bgr = best("snapshot"), best("bg_gather")
    layout = f"TP{a.tp} PP{a.pp} DP{4 // (a.tp * a.pp)}"
    print(f"# master_gather: 4-rank CPU island, {layout}, {'fp32' if a.fp32 else 'bf16'} GPTModel "
          f"h={a.hidden} L={a.layers}, {r0['n_entries']} entries, {r0['model_bytes'] / 2**20:.1f} MiB float32, "
          f"chunk {a.chunk_mib:g} MiB, best of {a.repeat} (wall {time.time() - t0:.0f} s)")
    print("| operation | seconds | GB/s float32 | vs raw gloo broadcast | vs raw p2p gather |")
    print("|---|---|---|---|---|")
    for name, t in (("read (owners -> rank 0)", rd), ("write (rank 0 -> holders)", wr),
                    ("raw gloo broadcast, same bytes", bc), ("raw gloo p2p gather, same bytes", pp),
                    ("snapshot of the own shard (training thread, local)", sn),
                    ("background gather of the snapshot (own thread and group)", bgr)):
        print(f"| {name} | {t:.3f} | {gb / t:.3f} | {bc / t:.2f}x | {pp / t:.2f}x |")
    print("| peak extra RSS per rank, read (MiB) | " + " / ".join(f"{r['read_rss'] / 2**20:.1f}" for r in res)
          + f" | chunk {a.chunk_mib:g} MiB | | |")
    print("| peak extra RSS per rank, write (MiB) | " + " / ".join(f"{r['write_rss'] / 2**20:.1f}" for r in res)
          + " | | | |")
    print("| peak sync buffers per rank (MiB) | " + " / ".join(f"{r['peak_buffer_bytes'] / 2**20:.1f}" for r in res)
          + " | | | |")


if __name__ == "__main__":
    main()
