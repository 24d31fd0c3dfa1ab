"""When each fragment reaches a boundary: every H optimizer steps, the P fragments spread evenly over H.

Fragment f is due at the steps s (count of optimizer steps done, 1-based) with
``s % H == ((f + 1) * H // P) % H``: with H=100 and P=4 the fragments are due at steps 25, 50, 75, 100 (+ k*H),
so the island's traffic is spread out and each fragment still syncs once every H steps. With P > H several
fragments share a step.
"""
from __future__ import annotations


def offset(fragment: int, sync_every: int, fragments: int) -> int:
    return ((fragment + 1) * sync_every // fragments) % sync_every


def due_fragments(step: int, sync_every: int, fragments: int) -> list:
    """Fragments whose boundary is at `step` (steps done so far; step 0 is never a boundary)."""
    if step <= 0:
        return []
    r = step % sync_every
    return [f for f in range(fragments) if offset(f, sync_every, fragments) == r]
