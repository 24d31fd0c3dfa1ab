"""Syncer merge and transfer benchmark.

    python benchmarks/syncer_merge.py [--quick] [--params P] [--pushes M] [--threads T] [--json out.json]

1. fold: M int4 pushes of a P-parameter fragment are accepted by the syncer's Coordinator (validated, decoded
   and folded into one accumulator as they arrive) and merged with Nesterov (finite check + commit).  Reported
   as GB/s of the minimal memory traffic (per push: int4 codes + scales read, accumulator read+write; outer step:
   accumulator, momentum and base read, momentum and base written) next to the same run's memory bandwidth
   (a multithreaded numpy triad on the same thread count).  Target: >= 0.8x of the memory-bound estimate (issue 38).
   Runs in its own process so its peak RSS can be set against the fragment size.
2. transfer: INIT (island -> syncer, f32) and BASE (syncer -> island, f32, a rejoining island) of one P-parameter
   fragment end to end over loopback through the real client and server, next to a raw socket send of the same
   number of bytes over loopback.  Target: >= 0.8x.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from yeto_patch.syncer.model.runner import ChunkRunner  # noqa: E402
from yeto_patch.syncer.rounds.coordinator import Coordinator  # noqa: E402
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings  # noqa: E402
from yeto_patch.syncer.rounds.pushes import ReceivedPush
from yeto_patch.wire import codecs  # noqa: E402


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Triad:
    """Memory bandwidth of ``c = a + s*b`` over the runner's threads on preallocated, touched arrays."""

    def __init__(self, n: int, runner: ChunkRunner):
        self.n, self.runner = n, runner
        self.a = np.ones(n, np.float32)
        self.b = np.ones(n, np.float32)
        self.c = np.ones(n, np.float32)

    def run(self, reps: int = 2) -> float:
        a, b, c, s = self.a, self.b, self.c, np.float32(0.5)

        def triad(lo, hi):
            np.multiply(b[lo:hi], s, out=c[lo:hi])
            np.add(c[lo:hi], a[lo:hi], out=c[lo:hi])

        best = 0.0
        self.cpu_rate = 0.0
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            self.runner.map(self.n, triad)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            best = max(best, 12 * self.n / dt / 1e9)  # 3 streams of 4n bytes (c's second touch is in cache)
            self.cpu_rate = max(self.cpu_rate, 12 * self.n / max(dc, 1e-9) / 1e9)  # GB per CPU-second
        return best


def fold_part(P: int, M: int, threads: int, rounds: int = 6) -> dict:
    runner = ChunkRunner(threads)
    codecs.set_threads(threads)
    rng = np.random.default_rng(0)
    rss0 = peak_rss()
    pushes = []
    for k in range(M):
        d = (rng.standard_normal(P, dtype=np.float32) * 0.01)
        pushes.append(codecs.encode("int4", d, threads=threads))
        del d
    c = Coordinator(MergeSettings(outer="nesterov", weights="tokens"), RoundSettings(islands=M), runner)
    c.set_manifest([("w", (P,), "float32")], 1)
    c.init_fragment(0, rng.standard_normal(P, dtype=np.float32))
    for k in range(M):
        c.join(f"i{k}", "1")
    triad = Triad(P, runner)
    bw = triad.run(3)
    import psutil
    proc = psutil.Process()
    rss_base = proc.memory_info().rss  # pushes + base held; before any accumulator or momentum exists
    peak = [rss_base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    times, bws, ratios, cpu_ratios = [], [], [], []
    code_bytes = codecs.encoded_nbytes("int4", P)
    moved = M * (code_bytes + 8 * P) + 20 * P
    for rnd in range(rounds):
        bw_i = triad.run(2)  # measured next to each round: the machine may be shared
        t0, c0 = time.perf_counter(), time.process_time()
        for k, body in enumerate(pushes):
            c.accept(ReceivedPush(f"i{k}", 0, rnd, "int4", 256, body, steps=1, tokens=1000 + k))
        rec = c.merge(0)
        dt_i = time.perf_counter() - t0
        if rnd:
            cpu_ratios.append(moved / max(time.process_time() - c0, 1e-9) / 1e9 / triad.cpu_rate)
        assert rec.ok
        times.append(dt_i)
        bws.append(bw_i)
        if rnd:  # round 0 pays one-time page faults of momentum and accumulator
            ratios.append(moved / dt_i / 1e9 / bw_i)
    stop.set()
    sampler.join()
    dt = min(times[1:])
    gbs = moved / dt / 1e9
    bw = max(bw, max(bws))
    frag = 4 * P
    return {"params": P, "pushes": M, "threads": runner.threads, "seconds": dt, "moved_GB": moved / 1e9,
            "merge_GBps": gbs, "mem_bw_GBps": bw, "ratio_vs_memory_bound": float(np.median(ratios)),
            "ratio_best_round": max(ratios), "bandwidths": bws,
            "cpu_time_ratio": float(np.median(cpu_ratios)),
            "fragment_MB": frag / 1e6, "peak_rss_MB": peak_rss() / 1e6, "rss_before_MB": rss0 / 1e6,
            "peak_rss_over_fragment": peak_rss() / frag,
            "held_pushes_MB": M * code_bytes / 1e6,
            "merge_rss_growth_over_fragment": (peak[0] - rss_base) / frag,
            "times": times}


_RAW_SRC: dict = {}


def _raw_source(nbytes: int) -> np.ndarray:
    """The bytes a raw send sends (allocated once, outside any timing or CPU accounting)."""
    if nbytes not in _RAW_SRC:
        _RAW_SRC.clear()
        _RAW_SRC[nbytes] = np.ones(nbytes, np.uint8)
    return _RAW_SRC[nbytes]


def raw_rate(nbytes: int, fresh: bool = True) -> float:
    """Bytes/s of a plain sendall over loopback TCP of ``nbytes`` (4 MiB pieces) received with recv_into into
    one buffer: ``fresh`` allocates it when the message starts (untouched pages, as any receiver of a new
    message has), else it is allocated and touched beforehand."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    buf = _raw_source(nbytes)
    pre = None if fresh else np.ones(nbytes, np.uint8)
    done = threading.Event()

    def rx():
        s, _ = srv.accept()
        dst = np.empty(nbytes, np.uint8) if pre is None else pre
        mv = memoryview(dst)
        got = 0
        while got < nbytes:
            got += s.recv_into(mv[got:], min(nbytes - got, 4 << 20))
        s.close()
        done.set()

    t = threading.Thread(target=rx)
    t.start()
    cl = socket.create_connection(srv.getsockname())
    for o in (socket.SO_SNDBUF,):
        cl.setsockopt(socket.SOL_SOCKET, o, 4 << 20)
    t0 = time.perf_counter()
    mv = memoryview(buf)
    for o in range(0, nbytes, 4 << 20):
        cl.sendall(mv[o:o + (4 << 20)])
    done.wait()
    dt = time.perf_counter() - t0
    cl.close()
    t.join()
    srv.close()
    return nbytes / dt


def _one_transfer(P: int, threads: int, values: np.ndarray) -> tuple:
    from yeto_patch.syncer.net.server import ServerConfig, SyncerServer
    from yeto_patch.wire.client import SyncerClient

    key = b"b" * 32
    manifest = [("w", (P,), "float32")]
    cfg = ServerConfig(listen="127.0.0.1:0", islands=2, fragments=1, key=key, merge_threads=threads,
                       rounds=RoundSettings(islands=2), initializer="a")   # (b joins after a's INIT)
    server = SyncerServer(cfg)
    host, port = server.start()
    addr = f"{host}:{port}"
    nbytes = 4 * P
    try:
        a = SyncerClient(addr, key, "a", manifest, timeout=60)
        a.connect()
        t0 = time.perf_counter()
        a.send_init(0, [values])
        with server.coord.cond:  # notified when the last INIT fragment is installed
            server.coord.cond.wait_for(lambda: server.coord.initialized, timeout=120)
        t_init = time.perf_counter() - t0
        a.wait_ready(60)
        b = SyncerClient(addr, key, "b", manifest, timeout=60)  # a joining island: the BASE of the fragment
        t0 = time.perf_counter()
        b.connect()
        got = b.wait_ready(60)
        t_base = time.perf_counter() - t0
        assert np.array_equal(got[0].values, values)
        b.close()
        a.close()
    finally:
        server.stop()
    return nbytes / t_init, nbytes / t_base


def transfer_part(P: int, threads: int, reps: int = 3) -> dict:
    import logging

    logging.getLogger("yeto").setLevel(logging.WARNING)
    from yeto_patch.syncer.model import outer_jit
    outer_jit.warm()   # (as yeto-syncer does before it listens: the INIT check's kernel is compiled or loaded)
    values = np.random.default_rng(0).standard_normal(P, dtype=np.float32)
    nbytes = 4 * P
    raws, inits, bases, ri, rb = [], [], [], [], []
    cr = []
    _raw_source(nbytes)
    for _ in range(reps):  # interleaved, ratios per repetition: the machine may be shared
        c0 = time.process_time()
        raw = raw_rate(nbytes)
        c_raw = time.process_time() - c0
        c0 = time.process_time()
        i, b = _one_transfer(P, threads, values)
        c_ours = (time.process_time() - c0) / 3  # INIT, then BASE to the initializing and to the joining island
        cr.append(c_raw / max(c_ours, 1e-9))
        raws.append(raw)
        inits.append(i)
        bases.append(b)
        ri.append(i / raw)
        rb.append(b / raw)
    raw_touched = raw_rate(nbytes, fresh=False)
    return {"bytes_MB": nbytes / 1e6, "raw_loopback_GBps": max(raws) / 1e9,
            "raw_touched_buffer_GBps": raw_touched / 1e9, "init_GBps": max(inits) / 1e9,
            "init_ratio": float(np.median(ri)), "base_GBps": max(bases) / 1e9, "base_ratio": float(np.median(rb)),
            "init_ratios": ri, "base_ratios": rb, "cpu_time_ratio": float(np.median(cr))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run (P = 4M, M = 3)")
    ap.add_argument("--params", type=int, default=None, help="fragment parameters P (default 64M; quick 4M)")
    ap.add_argument("--pushes", type=int, default=None, help="pushes M per round (default 4; quick 3)")
    ap.add_argument("--threads", type=int, default=None, help="merge/codec threads (default: CPU count, max 32)")
    ap.add_argument("--transfer-params", type=int, default=None, help="P for the transfer part (default P)")
    ap.add_argument("--part", choices=("fold", "transfer", "all"), default="all")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    a = ap.parse_args(argv)
    P = a.params or (4 << 20 if a.quick else 64 << 20)
    M = a.pushes or (3 if a.quick else 4)
    threads = a.threads or min(32, os.cpu_count() or 1)
    out = {}
    if a.part == "fold":
        print(json.dumps(fold_part(P, M, threads)))
        return 0
    if a.part in ("all",):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--part", "fold", "--params", str(P),
                            "--pushes", str(M), "--threads", str(threads)], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        out["fold"] = json.loads(r.stdout.strip().splitlines()[-1])
    if a.part in ("all", "transfer"):
        out["transfer"] = transfer_part(a.transfer_params or P, threads)
    f = out.get("fold")
    if f:
        print(f"fold+merge  P={f['params']:,} M={f['pushes']} int4 threads={f['threads']}: best round "
              f"{f['seconds']:.3f}s = {f['merge_GBps']:.2f} GB/s of {f['moved_GB']:.2f} GB minimal traffic; memory "
              f"bandwidth (triad) up to {f['mem_bw_GBps']:.2f} GB/s; merge/bandwidth measured round by round: "
              f"median {f['ratio_vs_memory_bound']:.2f}x, best {f['ratio_best_round']:.2f}x of the memory-bound "
              f"estimate (target >= 0.8); in GB per CPU-second (robust to a loaded machine) "
              f"{f['cpu_time_ratio']:.2f}x")
        print(f"memory      fragment {f['fragment_MB']:.0f} MB f32; peak RSS {f['peak_rss_MB']:.0f} MB = "
              f"{f['peak_rss_over_fragment']:.2f}x the fragment (process total: interpreter, the benchmark's "
              f"{f['held_pushes_MB']:.0f} MB of encoded pushes and its input arrays); growth while folding and "
              f"merging, over the base and pushes: {f['merge_rss_growth_over_fragment']:.2f}x the fragment "
              f"(momentum + one accumulator = 2x expected)")
    t = out.get("transfer")
    if t:
        print(f"transfer    {t['bytes_MB']:.0f} MB f32 over loopback: raw socket {t['raw_loopback_GBps']:.2f} GB/s "
              f"into a fresh buffer ({t['raw_touched_buffer_GBps']:.2f} GB/s into a pre-touched one); "
              f"INIT up to {t['init_GBps']:.2f} GB/s (median {t['init_ratio']:.2f}x); BASE up to "
              f"{t['base_GBps']:.2f} GB/s (median {t['base_ratio']:.2f}x) (target >= 0.8x of the fresh-buffer raw "
              f"send, ratios per interleaved repetition); CPU seconds of a raw send over ours per transfer (both "
              f"ends, includes handshakes and server start-up): {t['cpu_time_ratio']:.2f}x")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
