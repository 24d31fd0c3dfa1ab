"""Where every element of a manifest entry lives on an island, and how it is moved in bounded rounds.

:class:`EntryLayout` (an entry's tensor-parallel sharding and, per shard, its read owners and holders),
:class:`Item` (a piece of one entry's full tensor moved in one round), :func:`build_items` / :func:`chunk_rounds`
(the chunk plan of an operation) and :func:`cover` (one read owner per local element).  Pure bookkeeping,
no communication; used by :mod:`yeto_patch.island.masters.view`.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import numpy as np

from yeto_patch.island.masters.collective import IslandError


# ---------------------------------------------------------------------------------------------------------
# layout: shards, owners, holders
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ShardLayout:
    owners: List[Tuple[int, int, int]]   # (x, y, rank): read owner of local flat [x, y), disjoint, covering
    holders: Tuple[int, ...]             # every rank with a copy of the shard
    masters: List[Tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (x, y, rank): FP32 masters

    def master_holders(self, x: int, y: int) -> List[int]:
        """Ranks with a FP32 master of some of local [x, y) (the owner among them)."""
        return sorted({rk for a, b, rk in self.masters if a < y and x < b})


@dataclasses.dataclass
class EntryLayout:
    padded_shape: Tuple[int, ...]
    full_numel: int                      # kept elements (real vocabulary rows)
    nshards: int
    partition_dim: int
    stride: int
    shards: List[ShardLayout]

    @property
    def geometry(self):
        """(outer, s, T, seg): full flat = [outer, s, T, seg]; shard r's local flat = [outer, s, seg]."""
        P, d, T, s = self.padded_shape, self.partition_dim, self.nshards, self.stride
        if d < 0:
            n = int(np.prod(P)) if P else 1
            return 1, 1, 1, n
        outer = int(np.prod(P[:d])) if d > 0 else 1
        inner = int(np.prod(P[d + 1:])) if d + 1 < len(P) else 1
        return outer, s, T, (P[d] // T // s) * inner

    @property
    def local_numel(self) -> int:
        outer, s, _T, seg = self.geometry
        return outer * s * seg


@dataclasses.dataclass
class Item:
    """A piece of one entry's full tensor moved in one round: full flat [offset, offset+count)."""
    entry: int
    offset: int
    count: int
    rows: Optional[Tuple[int, int]]      # (o0, o1) outer rows interleaving all shards, or None
    shard: int                           # for non-row items: the shard and its local offset
    local_offset: int
    virtual: bool = False                # beyond this island's padded rows: read as zeros, never installed

    def parts(self, lay: EntryLayout):
        """[(shard r, local start a, local end b)]: the local ranges of each shard this item covers."""
        if self.virtual:
            return []
        if self.rows is None:
            return [(self.shard, self.local_offset, self.local_offset + self.count)]
        outer, s, T, seg = lay.geometry
        o0, o1 = self.rows
        return [(r, o0 * s * seg, o1 * s * seg) for r in range(T)]


def build_items(e: int, lay: EntryLayout, chunk: int) -> List[Item]:
    outer, s, T, seg = lay.geometry
    row = s * T * seg
    padded = outer * row   # the values of this island's (padded) rows
    # the run's vocabulary rows beyond this island's padded rows (names.py vocab_rows): virtual here
    tail = [Item(e, off, min(chunk, lay.full_numel - off), None, 0, 0, virtual=True)
            for off in range(padded, lay.full_numel, chunk)]
    items = []
    truncated = lay.full_numel < padded
    if not truncated and row <= chunk:
        k = max(1, chunk // row)
        for o0 in range(0, outer, k):
            o1 = min(outer, o0 + k)
            items.append(Item(e, o0 * row, (o1 - o0) * row, (o0, o1), 0, 0))
        return items + tail
    for kseg in range(outer * s * T):
        f = kseg * seg
        if f >= lay.full_numel:
            break
        r, q = kseg % T, kseg // T
        length = min(seg, lay.full_numel - f)
        for off in range(0, length, chunk):
            n = min(chunk, length - off)
            items.append(Item(e, f + off, n, None, r, q * seg + off))
    return items + tail


def chunk_rounds(items: List[Item], chunk: int) -> List[List[Item]]:
    rounds, cur, n = [], [], 0
    for it in items:
        if cur and n + it.count > chunk:
            rounds.append(cur)
            cur, n = [], 0
        cur.append(it)
        n += it.count
    if cur:
        rounds.append(cur)
    return rounds


def cover(name, r, n_local, rows) -> List[Tuple[int, int, int]]:
    """Pick one read owner per local element: the lowest rank owning it."""
    owners = []
    covered = []   # disjoint sorted intervals already assigned
    for rank, s, e in sorted(rows):
        if e <= s:
            continue
        # subtract covered intervals from [s, e)
        segs = [(s, e)]
        for cs, ce in covered:
            nxt = []
            for a, b in segs:
                if ce <= a or cs >= b:
                    nxt.append((a, b))
                    continue
                if a < cs:
                    nxt.append((a, cs))
                if ce < b:
                    nxt.append((ce, b))
            segs = nxt
        for a, b in segs:
            owners.append((a, b, rank))
            covered.append((a, b))
    owners.sort()
    pos = 0
    for a, b, _ in owners:
        if a != pos:
            break
        pos = b
    if pos != n_local:
        raise IslandError(f"'{name}' shard {r}: local elements [{pos}, ...) of {n_local} have no FP32 master on "
                          f"any rank (is the parameter frozen on some ranks, or outside the optimizer?)")
    return owners
