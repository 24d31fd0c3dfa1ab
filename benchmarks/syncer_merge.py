"""Syncer merge and transfer benchmark.

    python benchmarks/syncer_merge.py [--quick] [--params P] [--pushes M] [--threads T] [--json out.json]

1. fold: M int4 pushes of a P-parameter fragment are accepted by the syncer's Coordinator (validated, decoded
   and folded into one accumulator as they arrive) and merged with Nesterov (finite check + commit).  Reported
   as GB/s of the minimal memory traffic (per push: int4 codes + scales read, accumulator read+write; outer step:
   accumulator, momentum and base read, momentum and base written) next to the same run's memory bandwidth
   (a multithreaded numpy triad on the same thread count).  Target: >= 0.5x of the memory-bound estimate.
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

from yeto_patch.syncer.merge import ChunkRunner  # noqa: E402
from yeto_patch.syncer.rounds import Coordinator, MergeSettings, Push, RoundSettings  # noqa: E402
from yeto_patch.wire import codecs  # noqa: E402


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mem_bandwidth(n: int, runner: ChunkRunner, reps: int = 3) -> float:
    """GB/s of a triad c = a + s*b (3 x 4n bytes moved) over the runner's threads; best of ``reps``."""
    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.empty(n, np.float32)
    s = np.float32(0.5)

    def triad(lo, hi):
        np.multiply(b[lo:hi], s, out=c[lo:hi])
        np.add(c[lo:hi], a[lo:hi], out=c[lo:hi])

    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.map(n, triad)
        dt = time.perf_counter() - t0
        best = max(best, 12 * n / dt / 1e9)  # triad as written touches c twice: count the 3 streams only
    del a, b, c
    return best


def fold_part(P: int, M: int, threads: int) -> dict:
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
    bw = mem_bandwidth(P, runner)
    rss_setup = peak_rss()
    times = []
    for rnd in range(3):
        t0 = time.perf_counter()
        for k, body in enumerate(pushes):
            c.accept(Push(f"i{k}", 0, rnd, "int4", 256, body, tokens=1000 + k))
        rec = c.merge(0)
        times.append(time.perf_counter() - t0)
        assert rec.ok
    dt = min(times)
    code_bytes = codecs.encoded_nbytes("int4", P)
    moved = M * (code_bytes + 8 * P) + 20 * P
    gbs = moved / dt / 1e9
    frag = 4 * P
    return {"params": P, "pushes": M, "threads": runner.threads, "seconds": dt, "moved_GB": moved / 1e9,
            "merge_GBps": gbs, "mem_bw_GBps": bw, "ratio_vs_memory_bound": gbs / bw,
            "fragment_MB": frag / 1e6, "peak_rss_MB": peak_rss() / 1e6, "rss_before_MB": rss0 / 1e6,
            "peak_rss_over_fragment": peak_rss() / frag,
            "held_pushes_MB": M * code_bytes / 1e6,
            "syncer_state_over_fragment": (peak_rss() - rss0 - M * code_bytes) / frag}


def raw_rate(nbytes: int) -> float:
    """Bytes/s of a plain sendall over loopback TCP of ``nbytes`` (4 MiB pieces) into a preallocated buffer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    buf = np.ones(nbytes, np.uint8)
    dst = bytearray(nbytes)
    done = threading.Event()

    def rx():
        s, _ = srv.accept()
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


def transfer_part(P: int, threads: int) -> dict:
    import logging

    from yeto_patch.syncer.server import ServerConfig, SyncerServer
    from yeto_patch.wire.client import SyncerClient

    logging.getLogger("yeto").setLevel(logging.WARNING)
    key = b"b" * 32
    manifest = [("w", (P,), "float32")]
    cfg = ServerConfig(listen="127.0.0.1:0", islands=2, fragments=1, key=key, merge_threads=threads,
                       rounds=RoundSettings(islands=2))
    server = SyncerServer(cfg)
    host, port = server.start()
    addr = f"{host}:{port}"
    values = np.random.default_rng(0).standard_normal(P, dtype=np.float32)
    nbytes = 4 * P
    raw = [raw_rate(nbytes) for _ in range(2)]
    try:
        a = SyncerClient(addr, key, "a", manifest, timeout=60)
        a.connect()
        t0 = time.perf_counter()
        a.send_init(0, [values])
        while not server.coord.initialized:
            time.sleep(0.0005)
        t_init = time.perf_counter() - t0
        a.wait_ready(60)
        rates = []
        for k in range(2):
            b = SyncerClient(addr, key, "b", manifest, timeout=60)
            t0 = time.perf_counter()
            b.connect()
            got = b.wait_ready(60)
            rates.append(nbytes / (time.perf_counter() - t0))
            assert np.array_equal(got[0].values, values)
            b.close()
            time.sleep(0.1)
        a.close()
    finally:
        server.stop()
    raw_best = max(raw)
    return {"bytes_MB": nbytes / 1e6, "raw_loopback_GBps": raw_best / 1e9, "init_GBps": nbytes / t_init / 1e9,
            "init_ratio": nbytes / t_init / raw_best, "base_GBps": max(rates) / 1e9,
            "base_ratio": max(rates) / raw_best}


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
        print(f"fold+merge  P={f['params']:,} M={f['pushes']} int4 threads={f['threads']}: {f['seconds']:.3f}s, "
              f"{f['merge_GBps']:.2f} GB/s of {f['moved_GB']:.2f} GB minimal traffic; memory bandwidth (triad) "
              f"{f['mem_bw_GBps']:.2f} GB/s -> {f['ratio_vs_memory_bound']:.2f}x of the memory-bound estimate "
              f"(target >= 0.5)")
        print(f"memory      fragment {f['fragment_MB']:.0f} MB f32; peak RSS {f['peak_rss_MB']:.0f} MB = "
              f"{f['peak_rss_over_fragment']:.2f}x the fragment (includes the benchmark's {f['held_pushes_MB']:.0f} MB "
              f"of encoded pushes; syncer state beyond them {f['syncer_state_over_fragment']:.2f}x: base, "
              f"momentum, accumulator)")
    t = out.get("transfer")
    if t:
        print(f"transfer    {t['bytes_MB']:.0f} MB f32 over loopback: raw socket {t['raw_loopback_GBps']:.2f} GB/s; "
              f"INIT {t['init_GBps']:.2f} GB/s ({t['init_ratio']:.2f}x); BASE {t['base_GBps']:.2f} GB/s "
              f"({t['base_ratio']:.2f}x) (target >= 0.8x)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
