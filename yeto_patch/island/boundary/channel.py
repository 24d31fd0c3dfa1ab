"""Rank 0's decisions, sent to every rank of the island, so that every rank runs the same collectives in the
same order.

- ``rank0(fn, what)``: run `fn` on rank 0 and broadcast its JSON result, or its error (raised on every rank
  with rank 0's message as an ``EngineError``);
- ``broadcast_json(obj, what)``: one gloo broadcast when the JSON fits in 4 KiB (plans almost always do), else
  a second one for the rest; errors and timeouts name the call;
- ``await_ready(...)``: every rank loops until rank 0's `ready()` holds, bounded by YETO_DILOCO_TIMEOUT; rank 0
  blocks at most a slice at a time (the other ranks wait in a gloo collective with its own timeout) and can hand
  back requests the whole island must serve meanwhile (the syncer's INIT requests).

`comm` is an ``IslandComm`` (group, rank, timeout_s) or anything with those attributes; torch is imported only
by ``broadcast_json``.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Optional

from yeto_patch.island.errors import EngineError, describe
from yeto_patch.island.keepalive import waiting

log = logging.getLogger("yeto_patch")


class IslandChannel:
    SMALL = 4096

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank

    @waiting   # (the other ranks wait for rank 0 here: keep-alive calls while it lasts, island/keepalive.py)
    def rank0(self, fn: Callable[[], object], what: str):
        """Run fn on rank 0 and broadcast its JSON result (or its error) to every rank."""
        out = None
        if self.rank == 0:
            try:
                out = {"ok": fn()}
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                out = {"error": describe(e, what)}
        out = self.broadcast_json(out, f"yeto-patch: {what}")
        if "error" in out:
            raise EngineError(out["error"] + ("" if self.rank == 0 else " [island rank 0]"))
        return out["ok"]

    def broadcast_json(self, obj, what: str):
        import torch
        import torch.distributed as dist
        small = self.SMALL
        data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == 0 else b""
        head = torch.zeros(small, dtype=torch.uint8)
        if self.rank == 0:
            n = len(data)
            head[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
            k = min(n, small - 8)
            if k:
                head[8:8 + k] = torch.frombuffer(bytearray(data[:k]), dtype=torch.uint8)
        try:
            dist.broadcast(head, src=0, group=self.comm.group)
            raw = head.numpy().tobytes()
            n = int.from_bytes(raw[:8], "little")
            if n <= small - 8:
                body = raw[8:8 + n]
            else:
                rest = torch.zeros(n - (small - 8), dtype=torch.uint8)
                if self.rank == 0:
                    rest.copy_(torch.frombuffer(bytearray(data[small - 8:]), dtype=torch.uint8))
                dist.broadcast(rest, src=0, group=self.comm.group)
                body = raw[8:] + rest.numpy().tobytes()
        except Exception as e:  # gloo timeout or a peer that went away
            raise EngineError(f"{what}: the island's broadcast failed on rank {self.rank} (timeout "
                              f"{self.comm.timeout_s:.0f}s): {type(e).__name__}: {e}") from e
        return json.loads(body.decode())

    def await_ready(self, ready: Callable[[], bool], what: str, *, timeout: float, slice_s: float,
                    wait: Callable[[float], None], source: str, step: Callable[[], int],
                    requests: Optional[Callable[[], list]] = None, serve: Optional[Callable[[int], None]] = None,
                    patience=None):
        """Every rank: loop until rank 0's `ready()` is True, within `timeout` seconds (then an EngineError naming
        `what` and `source`). Rank 0 sleeps in `wait(seconds)` between checks and logs once what it waits for;
        `requests()` (rank 0) returns items that every rank then passes to `serve(item)`. `patience` (rank 0, an
        island/link/patience.Patience): the timeout counts only while the syncer is unreachable instead, and
        a long wait is logged every minute with what the syncer says it waits for."""
        t_end = time.monotonic() + timeout
        logged = False

        def probe():
            nonlocal logged, t_end
            t_slice = time.monotonic() + slice_s
            while True:
                if ready():
                    return {"done": True}
                if requests is not None:
                    req = requests()
                    if req:
                        return {"init": req}
                now = time.monotonic()
                if patience is not None:
                    patience.check()
                    t_end = max(t_end, now + slice_s)
                elif now >= t_end:
                    raise EngineError(f"yeto-patch: timed out after {timeout:.0f}s (YETO_DILOCO_TIMEOUT) "
                                      f"waiting for {what} from {source}")
                if now >= t_slice:
                    return {"wait": True}
                if not logged:
                    log.info("yeto-patch: step %d: waiting for %s (%s)", step(), what,
                             "giving up after YETO_DILOCO_TIMEOUT=%.0fs without the syncer" % timeout
                             if patience is not None else "up to %.0fs" % (t_end - now))
                    logged = True
                wait(min(t_end, t_slice) - now)
        while True:
            out = self.rank0(probe, f"wait for {what}")
            if out.get("done"):
                return
            for item in out.get("init", []):
                serve(int(item))
