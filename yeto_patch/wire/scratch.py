"""Scratch pieces for streamed frame crypto (wire/secure.py, wire/transport.py).

A protected frame is sealed and opened piece by piece (:data:`PIECE` bytes); in ``aead`` mode the ciphertext of
one piece passes through a scratch buffer on each side. The buffers come from one free list shared by every
connection of the process (at most :data:`KEEP` idle ones are kept), so scratch memory is a function of the
frames being sealed or opened at once, not of the connections held, and no frame faults in fresh pages.
"""
from __future__ import annotations

import collections
import contextlib
import threading

__all__ = ["PIECE", "KEEP", "piece"]

PIECE = 1 << 20   # bytes per crypto step: amortises per-call and per-syscall costs, stays in L2 for the copy
KEEP = 8

_free: collections.deque = collections.deque()
_lock = threading.Lock()


@contextlib.contextmanager
def piece():
    """A :data:`PIECE`-byte scratch buffer (memoryview) for the duration of the ``with`` block."""
    with _lock:
        buf = _free.pop() if _free else None
    if buf is None:
        buf = memoryview(bytearray(PIECE))
    try:
        yield buf
    finally:
        with _lock:
            if len(_free) < KEEP:
                _free.append(buf)
