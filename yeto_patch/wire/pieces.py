"""The codecs' work over cache-sized pieces: disjoint block-aligned pieces of a flat vector, run on a small
thread pool shared by every codec call, with per-thread scratch buffers reused from piece to piece (no fresh
pages to fault in). Results never depend on the thread count: each piece is written by exactly one task."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

__all__ = ["PIECE", "nblocks", "piece_len", "run", "scratch", "set_threads", "threads"]

PIECE = 1 << 18  # elements per piece (1 MiB of float32): amortizes the per-call overhead, stays in L2/L3


def nblocks(numel: int, block: int) -> int:
    return -(-numel // block)


_threads = max(1, min(4, os.cpu_count() or 1))
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()
_tls = threading.local()


def set_threads(n: int) -> None:
    """Number of threads the codecs use (default ``min(4, cpu_count)``); results do not depend on it."""
    global _threads, _pool
    if n < 1:
        raise ValueError("threads must be >= 1")
    with _pool_lock:
        _threads = int(n)
        if _pool is not None:
            _pool.shutdown(wait=False)
            _pool = None


def threads() -> int:
    """The number of threads the codecs use now."""
    return _threads


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads, thread_name_prefix="yeto-codec")
        return _pool


def scratch(name: str, n: int, dtype) -> np.ndarray:
    """A per-thread reusable buffer of at least ``n`` items (avoids mmap/page faults per piece)."""
    key = (name, np.dtype(dtype).str)
    d = getattr(_tls, "bufs", None)
    if d is None:
        d = _tls.bufs = {}
    a = d.get(key)
    if a is None or a.size < n:
        a = d[key] = np.empty(max(n, PIECE), dtype)
    return a[:n]


def piece_len(block: int) -> int:
    """Elements per piece: whole blocks, even, about PIECE elements."""
    return max(1, PIECE // block) * block if block <= PIECE else block


def run(numel: int, block: int, work: Callable[[int, int], None], threads: Optional[int] = None) -> None:
    """Call ``work(start, stop)`` over disjoint block-aligned pieces covering [0, numel)."""
    piece = piece_len(block)
    npieces = nblocks(numel, piece)
    nthr = min(threads or _threads, npieces)
    if nthr <= 1:
        for p in range(npieces):
            work(p * piece, min(numel, (p + 1) * piece))
        return

    # contiguous runs of pieces per task; a few tasks per thread balance uneven progress
    ntasks = min(npieces, nthr * 4)
    bounds = [npieces * i // ntasks for i in range(ntasks + 1)]

    def task(i: int) -> None:
        for p in range(bounds[i], bounds[i + 1]):
            work(p * piece, min(numel, (p + 1) * piece))

    futs = [_get_pool().submit(task, i) for i in range(ntasks)]
    err = None
    for f in futs:  # wait for all, so no thread still writes into buffers after we return
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err = err or e
    if err is not None:
        raise err
