"""Bounds on every number a peer sends the syncer (docs/protocol.md, "Pushes"): a peer is untrusted, so a counter is
an integer in a documented range, never an arbitrary-precision integer that could make a ledger sum, a weight or a
checkpoint unusable, and a value echoed in a reply or a log line is cut to a few characters."""
from __future__ import annotations

__all__ = ["INT64_MAX", "MAX_PUSH_STEPS", "MAX_PUSH_TOKENS", "MAX_PATIENCE_S", "MAX_RATE", "bounded_int",
           "bounded_number", "shown"]

INT64_MAX = (1 << 63) - 1
#: Largest ``steps`` one push may report (local optimizer steps since its anchor).
MAX_PUSH_STEPS = 1 << 31
#: Largest ``tokens`` one push may report: every weight is then an exact float64, and any round's total weight
#: (a few pushes per island) stays far below float32's range, so weights can never become infinite.
MAX_PUSH_TOKENS = 1 << 53
#: Largest ``patience`` (seconds until the island blocks waiting for the push's answer) a push may report; larger
#: or malformed values are read as "unknown".
MAX_PATIENCE_S = 1e6
#: Largest compute rate (steps/s) an island's heartbeat may say (larger: ignored).
MAX_RATE = 1e6


def bounded_int(v, hi: int = INT64_MAX, lo: int = 0) -> bool:
    """Whether ``v`` is an integer (not a bool) in ``[lo, hi]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def bounded_number(v, hi: float, lo: float = 0.0) -> bool:
    """Whether ``v`` is a finite int or float (not a bool) in ``[lo, hi]``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi


def shown(v, limit: int = 40) -> str:
    """A peer's value for a message: its repr, cut to ``limit`` characters (an integer of thousands of digits
    or a long string must not end up in replies and logs whole)."""
    if isinstance(v, int) and v.bit_length() > 128:
        return f"<an integer of {v.bit_length()} bits>"
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."
