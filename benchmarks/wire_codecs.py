#!/usr/bin/env python
"""Codec, digest and memcpy throughput of yeto_patch.wire on one flat float32 vector.

    python benchmarks/wire_codecs.py            # 256 MiB of float32 (the target measurement)
    python benchmarks/wire_codecs.py --quick    # 16 MiB, one repeat (smoke run)
    python benchmarks/wire_codecs.py --mib 64 --repeat 5 --threads 2 --codecs int8,int4

Throughput is GB/s of float32 input (numel * 4 bytes / seconds), best of --repeat runs.  In the same run it
measures numpy's memcpy (np.copyto of the float32 array: read bandwidth = bytes read / s), xxh3_64 over the
float32 bytes, and a naive one-line numpy implementation of each codec (same format, no blocking/threads),
then prints ratios: encode/memcpy, decode/memcpy, encode/naive, decode/naive.
Targets on the 2-core reference machine (int8/int4/int4-log/int1): encode >= 0.8x memcpy, decode >= 0.9x memcpy,
both >= 3x naive.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from yeto_patch.wire import codec_jit, codec_kernels, codec_names, codecs, pieces  # noqa: E402

TARGETS = {"int8", "int4", "int4-log", "int1"}


# ------------------------------------------------------------------------- naive one-line implementations
def naive_encode(codec, x, block):
    """The same byte format in plain whole-array numpy (no pieces, no threads, no bit tricks)."""
    if codec == "f32":
        return x.tobytes()
    if codec == "bf16":
        b = x.view(np.uint32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    pad = (-x.size) % block
    xb = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, block)
    if codec == "int1":   # the block's mean |x| (exact integer sums, docs/protocol.md); the sign bits
        ab = np.abs(xb).view(np.int32)
        e = np.maximum(ab.max(axis=1, keepdims=True) >> 23, 1)
        ex = ab >> 23
        q = ((ab & 0x7FFFFF) | ((ex > 0) << 23)).astype(np.int64) << 7 >> np.minimum(e - np.maximum(ex, 1), 31)
        sizes = np.full(xb.shape[0], float(block))
        sizes[-1] -= pad
        s = q.sum(axis=1) * np.ldexp(1.0, e[:, 0].astype(np.int64) - 157) / sizes
        return s.astype(np.float32).tobytes() + np.packbits(np.signbit(x), bitorder="little").tobytes()
    k = {"int8": 127.0, "int4": 7.0, "int4-log": 4.0 / 3.0}[codec]
    amax = np.abs(xb).max(axis=1, keepdims=True)
    inv = np.float32(k) / np.maximum(amax, codec_kernels.TINY[k])
    if codec == "int8":
        q = np.rint(xb * inv).astype(np.int8).ravel()[: x.size]
        return (amax / np.float32(127)).tobytes() + q.tobytes()
    if codec == "int4":
        q = (np.rint(xb * inv) + 8).astype(np.uint8).ravel()[: x.size]
        s = amax / np.float32(7)
    else:
        t = np.abs(xb) * inv
        lvl = np.where(t > 0, np.clip(np.frexp(t)[1] - 1 + 7, 0, 7), 0).astype(np.uint8)
        q = (lvl | ((xb < 0) & (lvl > 0)).astype(np.uint8) << 3).ravel()[: x.size]
        s = amax
    q = np.concatenate([q, np.zeros(q.size % 2, np.uint8)])
    return s.astype(np.float32).tobytes() + (q[0::2] | (q[1::2] << 4)).tobytes()


def naive_decode(codec, buf, n, block):
    b = np.frombuffer(buf, np.uint8)
    if codec == "f32":
        return b.view(np.float32).copy()
    if codec == "bf16":
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    nb = -(-n // block)
    s = b[: 4 * nb].view(np.float32)
    c = b[4 * nb:]
    if codec == "int8":
        q = c.view(np.int8).astype(np.float32)
    elif codec == "int1":
        q = 1 - 2 * np.unpackbits(c, count=n, bitorder="little").astype(np.float32)
    else:
        nib = np.stack([c & 15, c >> 4], axis=1).ravel()[:n]
        if codec == "int4":
            q = nib.astype(np.float32) - 8
        else:
            lvl = (nib & 7).astype(np.float32)
            q = np.where(lvl > 0, np.exp2(lvl - 7), 0).astype(np.float32) * np.where(nib & 8, -1, 1)
    return q * np.repeat(s, block)[:n]


def best(fn, repeat):
    t = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t)


def timed(fn):
    """(wall seconds, process CPU seconds of all threads) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=None, help="size of the float32 input in MiB (default 256, "
                    "16 with --quick)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 MiB, one repeat (unless given)")
    ap.add_argument("--repeat", type=int, default=None, help="timed repeats, best kept (default 3)")
    ap.add_argument("--block", type=int, default=codecs.DEFAULT_BLOCK)
    ap.add_argument("--threads", type=int, default=None, help="codec threads (default min(4, cpus))")
    ap.add_argument("--codecs", default=",".join(codecs.CODECS + ("topk:0.02+int2", "topk:0.05+int4")),
                    help="(the sparse topk:F+intB codecs have no naive column: tests/wire/test_sparse.py checks "
                         "them byte-equal to a per-value reference)")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive implementations")
    ap.add_argument("--numpy", action="store_true", help="the numpy reference kernels instead of the fused (numba) "
                    "ones")
    args = ap.parse_args(argv)
    mib = args.mib if args.mib is not None else (16.0 if args.quick else 256.0)
    repeat = args.repeat or (1 if args.quick else 3)
    if args.threads:
        codecs.set_threads(args.threads)
    codec_jit.set_enabled(not args.numpy)
    n = int(mib * (1 << 20)) // 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.exp(rng.standard_normal(n // args.block + 1, dtype=np.float32)).repeat(args.block)[:n]
    gb = x.nbytes / 1e9
    dst = np.empty_like(x)
    np.copyto(dst, x)
    xx = gb / best(lambda: xxhash.xxh3_64_intdigest(x), repeat)
    print(f"input: {mib:g} MiB float32 ({n} values), block {args.block}, codec threads {pieces.threads()}, "
          f"best of {repeat}; cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; kernels: "
          f"{'fused (numba)' if codec_jit.enabled() else 'numpy'}")
    print("memcpy = np.copyto of the float32 input (single thread), measured in the same rounds as each row")
    print("cpu columns: the same ratios in GB per CPU-second (all threads), robust when other processes load "
          "the machine")
    hdr = (f"{'codec':14} {'B/value':>7} {'memcpy':>7} {'enc GB/s':>8} {'dec GB/s':>8} {'enc/mcpy':>8} "
           f"{'dec/mcpy':>8} {'cpu enc':>7} {'cpu dec':>7} {'naive enc':>9} {'naive dec':>9} {'enc/naive':>9} "
           f"{'dec/naive':>9} {'max err':>9}")
    print(hdr)
    print("-" * len(hdr))
    ok = True
    below = []
    mcpy_all = []
    for codec in args.codecs.split(","):
        nbytes = codecs.encoded_nbytes(codec, n, args.block)
        enc = np.empty(nbytes, np.uint8)
        codecs.encode(codec, x, args.block, out=enc)
        codecs.decode(codec, enc, n, args.block, out=dst)
        tm, te, td = [], [], []
        for _ in range(repeat):  # interleaved so that load changes hit all three alike
            tm.append(timed(lambda: np.copyto(dst, x)))
            te.append(timed(lambda: codecs.encode(codec, x, args.block, out=enc)))
            td.append(timed(lambda: codecs.decode(codec, enc, n, args.block, out=dst)))
        memcpy, e, d = (gb / min(w for w, _ in v) for v in (tm, te, td))
        cm, ce, cd = (gb / max(1e-9, min(c for _, c in v)) for v in (tm, te, td))
        mcpy_all.append(memcpy)
        err = float(np.abs(dst - x).max() / np.abs(x).max())
        if args.no_naive or codec_names.sparse(codec):
            ne = nd = float("nan")
        else:
            ref = naive_encode(codec, x, args.block)
            if ref != enc.tobytes():
                print(f"  !! {codec}: the naive encoding differs from the codec's bytes")
                ok = False
            ne = gb / best(lambda: naive_encode(codec, x, args.block), 1)
            nd = gb / best(lambda: naive_decode(codec, ref, n, args.block), 1)
            if not np.array_equal(naive_decode(codec, ref, n, args.block), dst):
                print(f"  !! {codec}: the naive decoding differs from the codec's")
                ok = False
            del ref
        if codec_names.sparse(codec):   # the sparse decode is exact only at the kept values
            err = float(np.abs(dst - x)[dst != 0].max(initial=0) / np.abs(x).max())
        print(f"{codec:14} {nbytes / n:7.3f} {memcpy:7.2f} {e:8.2f} {d:8.2f} {e / memcpy:8.2f} {d / memcpy:8.2f} "
              f"{ce / cm:7.2f} {cd / cm:7.2f} {ne:9.2f} {nd:9.2f} {e / ne:9.1f} {d / nd:9.1f} {err:9.2e}")
        if codec in TARGETS:
            if e < 0.8 * memcpy or d < 0.9 * memcpy or (not args.no_naive and (e < 3 * ne or d < 3 * nd)):
                below.append(codec)
    print(f"xxh3_64 digest: {xx:.2f} GB/s ({xx / max(mcpy_all or [1]):.2f}x the best memcpy)")
    print("targets (int8/int4/int4-log/int1): encode >= 0.8x memcpy, decode >= 0.9x memcpy, both >= 3x naive: "
          + ("met" if not below else "NOT met for " + ", ".join(below)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
