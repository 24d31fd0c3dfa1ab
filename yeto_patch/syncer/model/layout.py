"""Deterministic partition of a parameter manifest into fragments.

A manifest is the ordered list of ``(global name, full shape, dtype)`` of every trainable parameter.  The
syncer splits it into ``P`` fragments that take turns at boundaries (Streaming DiLoCo):

* greedy by size: tensors are placed largest first (ties broken by name, then by manifest index),
* each goes to the bin with the smallest total so far; among equal totals the lowest bin index wins,
* a heap keyed ``(total, bin index)`` makes this ``O(n log P)`` (no rescanning of the bins per tensor).

Within a fragment the tensors are listed in ascending manifest order; the fragment's flat float32 vector (the
unit of INIT, PUSH and BASE bodies) is the concatenation of those tensors, each flattened in C order.  The same
manifest always gives the same layout.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
from typing import Iterable, Sequence

__all__ = ["ManifestEntry", "normalize_manifest", "partition", "fragment_numels", "fragment_offsets",
           "first_difference", "manifest_to_json"]

ManifestEntry = tuple  # (name: str, shape: tuple[int, ...], dtype: str)


def normalize_manifest(manifest: Iterable) -> list[tuple[str, tuple[int, ...], str]]:
    """Validate and canonicalise a manifest (lists from JSON become tuples). Raises ValueError naming the entry."""
    out = []
    names = set()
    for i, e in enumerate(manifest):
        try:
            name, shape, dtype = e
        except (TypeError, ValueError):
            raise ValueError(f"manifest entry {i} must be [name, shape, dtype], got {e!r}") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"manifest entry {i}: name must be a non-empty string, got {name!r}")
        if name in names:
            raise ValueError(f"manifest entry {i}: duplicate name {name!r}")
        names.add(name)
        if not isinstance(shape, (list, tuple)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 63 for d in shape):
            raise ValueError(f"manifest entry {i} ({name}): shape must be a list of ints in [0, 2**63), "
                             f"got {shape!r}")
        if not isinstance(dtype, str) or not dtype:
            raise ValueError(f"manifest entry {i} ({name}): dtype must be a string, got {dtype!r}")
        out.append((name, tuple(int(d) for d in shape), dtype))
    if not out:
        raise ValueError("manifest is empty")
    return out


def manifest_to_json(manifest) -> list:
    return [[n, list(s), d] for n, s, d in manifest]


def first_difference(a, b) -> str:
    """Human-readable description of the first entry where manifests ``a`` and ``b`` differ ('' if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if tuple(x) != tuple(y):
            return (f"entry {i}: expected {x[0]!r} shape {list(x[1])} {x[2]}, "
                    f"got {y[0]!r} shape {list(y[1])} {y[2]}")
    if len(a) != len(b):
        i = min(len(a), len(b))
        if len(a) > len(b):
            return f"entry {i}: expected {a[i][0]!r}, got the end of the manifest ({len(b)} entries, expected {len(a)})"
        return f"entry {i}: unexpected extra entry {b[i][0]!r} ({len(b)} entries, expected {len(a)})"
    return ""


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def partition(manifest, fragments: int) -> list[list[int]]:
    """Fragment -> ascending manifest indices. Greedy largest-first to the smallest bin (first such bin wins)."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if fragments > len(manifest):
        raise ValueError(f"cannot split {len(manifest)} tensors into {fragments} non-empty fragments")
    order = sorted(range(len(manifest)), key=lambda i: (-_numel(manifest[i][1]), manifest[i][0], i))
    heap = [(0, b) for b in range(fragments)]  # already a valid heap (sorted)
    bins: list[list[int]] = [[] for _ in range(fragments)]
    for i in order:
        total, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (total + _numel(manifest[i][1]), b))
    for b in bins:
        b.sort()
    return bins


def fragment_numels(manifest, layout) -> list[int]:
    return [sum(_numel(manifest[i][1]) for i in idx) for idx in layout]


def fragment_offsets(manifest, indices) -> list[tuple[int, int, int]]:
    """[(manifest index, offset, numel)] of each tensor inside its fragment's flat vector."""
    out, off = [], 0
    for i in indices:
        n = _numel(manifest[i][1])
        out.append((i, off, n))
        off += n
    return out


def layout_digest(layout) -> str:
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()
