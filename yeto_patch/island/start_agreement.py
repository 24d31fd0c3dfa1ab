"""Every rank of a job agrees at its first training step whether yeto-patch can start, before any collective.

Ranks read YETO_* from their own environment. When the environments differ (one node got a wrong value), the
ranks with a bad value would raise while the others went on into the island's first collective and waited there
until a timeout. Instead every rank reports through torch.distributed's default key-value store (the launcher's
rendezvous store: no collective, no accelerator memory): the first error wins, and every rank raises it, naming
the rank that saw it. O(1) store operations per rank.
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

_generation = 0


def agree(local_error: Optional[str], timeout_s: float = 120.0) -> Optional[str]:
    """None when every rank is fine, else the first error message (with the rank that raised it). Every rank
    calls it the same number of times (once per process in a training job)."""
    global _generation
    _generation += 1
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return local_error
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # no default store to talk through: each rank decides alone
        return local_error
    return agree_through(store, rank, world, local_error, timeout_s, f"yeto_patch/start/{_generation}/")


def agree_through(store, rank: int, world: int, local_error: Optional[str], timeout_s: float,
                  prefix: str) -> Optional[str]:
    """``agree`` over a given key-value store (torch.distributed.Store) under the keys `prefix`*."""
    _PREFIX = prefix
    if world == 1:
        return local_error
    if local_error is not None:
        store.compare_set(_PREFIX + "error", "", f"{local_error} [rank {rank}]")
    if store.add(_PREFIX + "arrived", 1) == world:
        store.set(_PREFIX + "done", "1")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait([_PREFIX + "done"], datetime.timedelta(seconds=max(1.0, min(5.0, timeout_s))))
            break
        except Exception:
            if store.check([_PREFIX + "error"]):
                break   # someone failed: do not wait for ranks that may never train
            if time.monotonic() > deadline:
                n = int(store.add(_PREFIX + "arrived", 0))
                return (f"yeto-patch: only {n} of {world} ranks reached their first training step within "
                        f"{timeout_s:.0f}s; the others did not start training")
    if store.check([_PREFIX + "error"]):
        msg = store.get(_PREFIX + "error").decode()
        return msg if msg else local_error
    return local_error
