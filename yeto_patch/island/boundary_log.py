"""Per-boundary JSONL records, written by island rank 0 (``YETO_DILOCO_METRICS``).

One line per event, flushed as written so a crash keeps what happened:
- ``{"event": "boundary", ...}`` one per fragment boundary (the push of a fragment's delta), completed when the
  push's answer (the merged base) is installed or at the final cut: step, fragment, base_version (pushed
  against), version (installed), bytes (pushed), codec, steps / tokens (since the anchor, as reported),
  gather_ms / encode_ms (on the training thread), send_ms (background), wait_ms (training blocked waiting for
  the base), install_ms, pull_lag (steps from push to install), installed (bool), mode ("replace" | "blend").
- ``{"event": "start", ...}``, ``{"event": "install", ...}`` (a base installed that answered no push of ours,
  e.g. merged by a quorum without us), ``{"event": "final", ...}``.
Every record carries ``island``, ``time`` (unix seconds) and ``step``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional


class BoundaryLog:
    def __init__(self, path: Optional[str], island: str):
        self.path, self.island = path, island
        self._f = None
        self._lock = threading.Lock()
        if path:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            self._f = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        if self._f is None:
            return
        rec = {"event": event, "island": self.island, "time": round(time.time(), 3), **fields}
        line = json.dumps(rec, separators=(",", ":"), default=_plain)
        with self._lock:
            self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def _plain(o):
    try:
        return o.item()
    except Exception:
        return str(o)
