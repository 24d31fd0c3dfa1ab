"""Chunked, multithreaded float32 kernels with a fixed reduction order.

Every pass splits a flat vector into chunks of a fixed size (``CHUNK`` elements, independent of the thread
count).  Element-wise work gives the same bits however the chunks are spread over threads; reductions (the
outer-gradient norm) are summed per chunk in float64 and the per-chunk partial sums are added in chunk order,
so results are bit-identical for any number of threads.  numpy releases the GIL inside its kernels.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

import numpy as np

__all__ = ["CHUNK", "ChunkRunner", "default_threads"]

CHUNK = 1 << 18  # elements (1 MiB of float32): a chunk and its scratch stay in L2
T = TypeVar("T")


def default_threads() -> int:
    return max(1, min(32, os.cpu_count() or 1))


class ChunkRunner:
    """Runs ``fn(start, stop)`` over fixed chunks of ``[0, n)`` on a small thread pool."""

    def __init__(self, threads: Optional[int] = None, chunk: int = CHUNK):
        self.threads = max(1, int(threads or default_threads()))
        self.chunk = int(chunk)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="yeto-merge") if self.threads > 1 else None
        self._tls = threading.local()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def scratch(self, name: str, n: int, dtype=np.float32) -> np.ndarray:
        """A per-thread buffer of ``n`` elements (reused across chunks)."""
        d = getattr(self._tls, "bufs", None)
        if d is None:
            d = self._tls.bufs = {}
        a = d.get(name)
        if a is None or a.size < n or a.dtype != dtype:
            a = d[name] = np.empty(max(n, self.chunk), dtype)
        return a[:n]

    def map(self, n: int, fn: Callable[[int, int], T]) -> list[T]:
        """Results of ``fn`` per chunk, in chunk order (whatever thread ran them)."""
        nchunks = -(-n // self.chunk) if n else 0
        bounds = [(c * self.chunk, min(n, (c + 1) * self.chunk)) for c in range(nchunks)]
        if self._pool is None or nchunks <= 1:
            return [fn(a, b) for a, b in bounds]
        ntasks = min(nchunks, self.threads * 4)
        split = [nchunks * i // ntasks for i in range(ntasks + 1)]
        results: list = [None] * nchunks

        def task(t: int) -> None:
            for c in range(split[t], split[t + 1]):
                results[c] = fn(*bounds[c])

        futs = [self._pool.submit(task, t) for t in range(ntasks)]
        err = None
        for f in futs:  # wait for all before returning: no thread may still write into shared arrays
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                err = err or e
        if err is not None:
            raise err
        return results
