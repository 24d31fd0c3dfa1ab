"""Per-boundary JSONL records, written by island rank 0 (``YETO_DILOCO_METRICS``).

One line per event, flushed as written so a crash keeps what happened:
- ``{"event": "boundary", ...}`` one per fragment boundary (the push of a fragment's delta), completed when the
  push's answer (the merged base) is installed or at the final cut: step, fragment, base_version (pushed
  against), version (installed), bytes (pushed), codec, steps / tokens (since the anchor, as reported),
  gather_ms / encode_ms (on the training thread), send_ms (background), wait_ms (training blocked waiting for
  the base), install_ms, pull_lag (steps from push to install), installed (bool), mode ("replace" | "blend").
- ``{"event": "start", ...}``, ``{"event": "install", ...}`` (a base installed that answered no push of ours,
  e.g. merged by a quorum without us), ``{"event": "final", ...}``.
- ``{"event": "merge", ...}`` (from the syncer, with a base it merged): step (this island's, when the base
  arrived), fragment, version, lag (staleness: versions this island's push was behind; absent when it had no push
  in that merge), weight (its share of the merge), islands (pushes merged), outer_lr, outer_grad_norm.
Every record carries ``island``, ``time`` (unix seconds) and ``step``. A boundary record also has delta_norm (the
L2 norm of the pushed delta, before quantization).

Sinks (``add_sink(fn)``, e.g. the figures for the launcher's TensorBoard / W&B, ``island/figures.py``) get every
record as it is written, with or without a file; a sink that raises is dropped with one warning.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Optional

log = logging.getLogger("yeto_patch")


class BoundaryLog:
    def __init__(self, path: Optional[str], island: str):
        self.path, self.island = path, island
        self._f = None
        self._lock = threading.Lock()
        self._sinks: list = []
        self._closers: list = []
        if path:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            self._f = open(path, "a", buffering=1, encoding="utf-8")

    def add_sink(self, sink, close=None) -> None:
        """`sink(record)` is called with every record written from now on; `close()` (optional) when the log
        closes."""
        with self._lock:
            self._sinks.append(sink)
            if close is not None:
                self._closers.append(close)

    def write(self, event: str, **fields) -> None:
        if self._f is None and not self._sinks:
            return
        rec = {"event": event, "island": self.island, "time": round(time.time(), 3), **fields}
        if self._f is not None:
            line = json.dumps(rec, separators=(",", ":"), default=_plain)
            with self._lock:
                if self._f is not None:
                    self._f.write(line + "\n")
        for sink in list(self._sinks):
            try:
                sink(rec)
            except Exception as e:  # noqa: BLE001 - a figure never stops training
                with self._lock:
                    if sink in self._sinks:
                        self._sinks.remove(sink)
                log.warning("yeto-patch: a boundary-log sink failed (%s: %s); it gets no more records",
                            type(e).__name__, e)

    def installed(self, step: int, fragment: int, version: int, mode: str, why: str, ms: float, updates: int,
                  push=None, wire=None, **extra) -> None:
        """A base was installed: completes the boundary record of the push it answered (`push`: the fragment's
        ``Push``, `wire`: its ``PushWire`` with the figures measured on the way) or records an install that
        answered none (not at start). `extra`: a staged install's figures (stage_ms: the background staging;
        staged_wait_ms: the training thread's wait for it)."""
        if push is not None:
            rec = {"step": push.step, "fragment": fragment, "base_version": push.base_version, "steps": push.steps,
                   "tokens": push.tokens, "final": push.final, "wait_ms": 0.0}
            if wire is not None:
                rec.update(wire.figures, codec=wire.codec, send_ms=wire.send_ms)
            rec.update(version=int(version), installed=True, mode=mode, install_ms=round(ms, 2),
                       pull_lag=step - push.step, updates=updates, **extra)
            self.write("boundary", **rec)
            log.info("yeto-patch: step %d: installed fragment %d v%d (%s, pushed at step %d, lag %d steps, "
                     "waited %.0f ms)", step, fragment, version, mode, rec["step"], rec["pull_lag"],
                     rec.get("wait_ms", 0.0))
        elif why != "start":
            self.write("install", step=step, fragment=fragment, version=int(version), mode=mode,
                       install_ms=round(ms, 2), reason=why, updates=updates, **extra)

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None
            closers, self._closers = self._closers, []
        for close in closers:
            close()


def _plain(o):
    try:
        return o.item()
    except Exception:
        return str(o)
