"""Resource and run-control limits of the syncer (what one authenticated island may make it hold or wait for).

* model size: the first manifest fixes the run; one whose float32 size is above ``max_model_bytes`` (default:
  a quarter of the machine's physical memory, since the syncer keeps about four float32 copies: base, momentum,
  an accumulator and an INIT body or shadow) is refused at its MANIFEST, before anything is allocated for it;
* reassembly: bytes of unfinished chunked messages one island connection may hold (``island_buffer_bytes``,
  default: one fragment in its largest push encoding plus 2 MiB for small messages), checked on each message's
  first chunk; joined connections are bounded by ``--islands`` (a connection whose island's lease ran out is
  closed when another island takes its place), so all islands together hold at most ``islands`` times that;
* the ledger: islands that joined and left without leaving any state (no push merged, not finished, no pushes
  pending) are forgotten, so churned ids do not grow the ledger or the checkpoint;
* INIT: the island asked to initialize the run must make progress (one fragment's INIT) within
  ``init_timeout_s`` (default: lease + io timeout), else its claim is forgotten and another island is asked.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ...wire import codecs
from ...wire.frames import MsgType

__all__ = ["default_max_model_bytes", "model_size_error", "island_max", "island_buffer_bytes", "stateless_members",
           "InitWatch"]

SMALL_MESSAGES = 2 << 20   # room for small chunked messages next to the largest push


def default_max_model_bytes() -> int:
    """A quarter of the physical memory (at least 1 GiB when it cannot be read)."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        phys = 4 << 30
    return max(1 << 30, int(phys) // 4)


def model_size_error(numel: int, limit: int) -> Optional[str]:
    """The refusal message for a manifest of ``numel`` parameters above ``limit`` float32 bytes (None: fine)."""
    if 4 * numel <= limit:
        return None
    return (f"the manifest has {numel} parameters ({4 * numel / 2**30:.1f} GiB as float32), above this syncer's "
            f"limit of {limit / 2**30:.1f} GiB (--max-model-bytes; the syncer holds about four float32 copies)")


def island_max(largest_fragment: int) -> dict:
    """Per-type maxima for an authenticated island: INIT and PUSH bodies are one fragment (``largest_fragment``
    values; int8 with block 1 is the largest encoding), plus room for the meta; the other messages are small."""
    bulk = codecs.encoded_nbytes("int8", largest_fragment, 1) + (1 << 20)
    return {**{t: 1 << 20 for t in MsgType if t != MsgType.CHUNK}, MsgType.INIT: bulk, MsgType.PUSH: bulk}


def island_buffer_bytes(largest_push: int, configured: int = 0) -> int:
    """Bytes of unfinished chunked messages one island connection may hold (``configured`` 0: the default)."""
    return int(configured) if configured else int(largest_push) + SMALL_MESSAGES


def stateless_members(members: dict, busy: set, now: float, lease_s: float) -> list:
    """Ids of ledger entries that carry no state: not connected, not alive by lease, never had a push merged,
    not finished, no final fragments, and no pending push (``busy``: islands with a push in an open round, a
    carried push or a push key still in the staleness window)."""
    return [i for i, m in members.items()
            if not m.connected and not m.alive(now, lease_s) and not m.pushes and not m.steps and not m.tokens
            and not m.finished and not m.final_fragments and not m.last_step and i not in busy]


class InitWatch:
    """How long the island asked to INIT the run has gone without completing a fragment's INIT."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.since: Optional[float] = None
        self.failed: set = set()   # islands whose claim was forgotten (asked again only when nobody else is there)

    def assigned(self) -> None:
        self.since = self.clock()

    progress = assigned

    def expired(self) -> bool:
        return self.since is not None and self.clock() - self.since > self.timeout_s

    def clear(self) -> None:
        self.since = None


