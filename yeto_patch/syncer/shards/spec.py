"""A sharded syncer: the run's fragments split over N syncer processes (``--shard I/N``).

Fragments are independent rounds, so the state partitions by fragment: shard ``I`` of ``N`` owns a
deterministic, byte-balanced subset of the fragments (``assign``) and holds base, momentum, shadow and rounds
for those only. Every shard computes the same layout from the same manifest and ``--fragments`` (the one every
island already computes), so the same run always gives the same assignment, on every host, without talking to
the other shards. Islands connect to every shard (``YETO_DILOCO_SYNCER`` lists them in shard order, or shard 0
advertises them with ``--shard-addresses``), push each fragment to its owner, send FINAL to every shard, and
install the final model assembled from all of them (each shard's final cut waits for every island's last step,
so the cut is global).
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["ShardSpec", "parse_shard", "assign", "MAX_SHARDS"]

#: More shards than this is a typo (the fragment count bounds it anyway: every shard owns at least one).
MAX_SHARDS = 1024


@dataclass(frozen=True)
class ShardSpec:
    index: int = 0
    count: int = 1

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def as_json(self) -> list:
        return [self.index, self.count]


def parse_shard(text: str) -> ShardSpec:
    """'I/N' (0 <= I < N <= MAX_SHARDS) -> ShardSpec; ValueError naming what is wrong."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*/\s*(\d{1,6})\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not I/N (shard index / shard count, e.g. 0/3)")
    i, n = int(m.group(1)), int(m.group(2))
    if not 1 <= n <= MAX_SHARDS:
        raise ValueError(f"shard count {n} must be in [1, {MAX_SHARDS}]")
    if not 0 <= i < n:
        raise ValueError(f"shard index {i} must be in [0, {n - 1}] for {n} shards")
    return ShardSpec(i, n)


def assign(numels: Sequence[int], shards: int) -> list[list[int]]:
    """Shard -> ascending fragment indices, byte-balanced: fragments largest first (ties: lower index first),
    each to the shard with the fewest values so far (ties: lower shard index). Deterministic in (numels, shards);
    every shard gets at least one fragment (refused when there are fewer fragments than shards)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards > len(numels):
        raise ValueError(f"{shards} shards need at least {shards} fragments (the run has {len(numels)}): raise "
                         f"--fragments or start fewer shards")
    heap = [(0, s) for s in range(shards)]
    out: list[list[int]] = [[] for _ in range(shards)]
    for f in sorted(range(len(numels)), key=lambda i: (-int(numels[i]), i)):
        total, s = heapq.heappop(heap)
        out[s].append(f)
        heapq.heappush(heap, (total + int(numels[f]), s))
    for fr in out:
        fr.sort()
    return out
