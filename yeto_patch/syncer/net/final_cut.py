"""The end of the syncer's final cut: waiting, bounded, for the islands' acknowledgements of the final model.

``SyncerServer._final_cut`` merges the last rounds and sends every island the final model; ``await_acks`` then
waits until every island that was sent it acknowledged it (or closed), the timeout (``--final-ack-timeout``)
passed or the syncer is stopping, and logs who did not acknowledge and who acknowledged other versions;
``goodbye`` ends the sessions.
"""
from __future__ import annotations

import logging
import time

from ...wire.frames import MsgType

log = logging.getLogger("yeto.syncer")


def await_acks(coord, targets: list, versions, timeout_s: float, stopping) -> list:
    """Wait for the acknowledgements of `targets` (sessions sent the final model of `versions`) under
    ``coord.cond``; returns the islands that acknowledged."""
    deadline = time.monotonic() + timeout_s
    with coord.cond:
        while True:
            missing = [s.island for s in targets if s.final_acked is None and not s.closed]
            if not missing or time.monotonic() >= deadline or stopping.is_set():
                break
            coord.cond.wait(min(0.25, max(0.0, deadline - time.monotonic())))
    acked = [s.island for s in targets if s.final_acked is not None]
    bad = [s.island for s in targets if s.final_acked is not None and s.final_acked != versions]
    if missing:
        log.warning("final cut: no acknowledgement from %s", missing)
    if bad:
        log.warning("final cut: islands %s acknowledged other versions", bad)
    log.info("final cut acknowledged by %s", acked)
    return acked


def goodbye(targets: list) -> None:
    """BYE to every island sent the final model, then a bounded wait for it to go out."""
    for s in targets:
        s.post(MsgType.BYE, {"reason": "final cut done"})
    for s in targets:
        s.drain(2.0)
