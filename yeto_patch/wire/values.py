"""Values the island side of the syncer protocol hands to its caller (see :mod:`.client`).

:class:`Welcome` (the syncer's answer to HELLO), :class:`Base` (a fragment's base, full or as updates),
:class:`PushReply`, :class:`SyncerRefusal` (a refused push) and :func:`recoverable` (a lost link vs a final
refusal).  Stdlib + numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import codec_names, codecs
from .frames import AuthError, CodecError, PeerError, ProtocolError

__all__ = ["SyncerRefusal", "Welcome", "Base", "PushReply", "SyncerStatus", "Schedule", "recoverable",
           "shard_fields", "merge_info"]


class SyncerRefusal(PeerError):
    """The syncer refused a push (the connection stays usable)."""

    def __init__(self, code: str, message: str, fragment=None, base_version=None):
        super().__init__(code, message)
        self.fragment = fragment
        self.base_version = base_version


@dataclass
class Welcome:
    island_id: str
    layout: list
    numels: list
    fragments: int
    versions: Optional[list]
    needs_init: list
    base_wire: str
    heartbeat_s: float
    lease_s: float
    islands: int
    quorum: int
    total_rounds: Optional[int]
    final: bool
    run_id: Optional[str] = None    # the syncer's run (named in its authenticated HELLO_OK)
    shard: tuple = (0, 1)           # (index, count) of the syncer shard that answered
    owned: list = None              # the fragments that shard owns (default: every fragment)
    shard_addresses: tuple = ()     # every shard's address in shard order, when the syncer knows them

    def __post_init__(self):
        if self.owned is None:
            self.owned = list(range(int(self.fragments)))


def shard_fields(meta: dict) -> dict:
    """The WELCOME's shard fields, checked (a syncer of an older release sends none: one shard owning all)."""
    n = meta.get("fragments")
    shard, owned, addrs = meta.get("shard", [0, 1]), meta.get("owned"), meta.get("shard_addresses") or []
    ok = (isinstance(n, int) and isinstance(shard, list) and len(shard) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in shard) and 0 <= shard[0] < shard[1] <= n)
    if ok and owned is not None:
        ok = (isinstance(owned, list) and all(isinstance(f, int) and not isinstance(f, bool) for f in owned)
              and owned == sorted(set(owned)) and all(0 <= f < n for f in owned))
    if ok:
        ok = isinstance(addrs, list) and len(addrs) in (0, shard[1]) and all(
            isinstance(a, str) and 0 < len(a) <= 300 for a in addrs)
    if not ok:
        raise ProtocolError(f"malformed WELCOME shard fields: shard={shard!r:.80} owned={owned!r:.80}")
    return {"shard": tuple(shard), "owned": list(range(n)) if owned is None else owned,
            "shard_addresses": tuple(addrs)}


@dataclass(frozen=True)
class Schedule:
    """An island's schedule as its heartbeats say it: its H now and the step of each fragment's next boundary (by
    fragment) after the step the heartbeat says."""
    sync_every: int
    next_boundaries: tuple


@dataclass
class SyncerStatus:
    """What the syncer's last HEARTBEAT said this island's rounds wait for (docs/protocol.md, "Membership"):
    ``rounds`` [fragment, version, answered, quorum] of the open rounds this island answered, ``missing`` the
    islands they wait for (a "(down Ns)" suffix marks one that is not up), ``unfinished`` (after this island's
    FINAL) the islands still training, ``pace`` the fleet's pace in steps/s (0: unknown), ``rhythm``
    [fragment, eta_s, period_s] of the fragments whose next push by the island the fleet keeps its rhythm with is
    due in ``eta_s`` seconds, every ``period_s`` (empty: no rhythm, or this island is it), ``at`` the island's
    monotonic clock when it arrived (0: never), ``opened`` [fragment, age_s] of the open rounds that the rhythm
    island's push (arrived ``age_s`` before) is in and this island has not answered (it follows them)."""
    rounds: list
    missing: list
    unfinished: Optional[list] = None
    pace: float = 0.0
    rhythm: list = field(default_factory=list)
    at: float = 0.0
    opened: list = field(default_factory=list)   # [fragment, age_s]: open rounds the rhythm island's push is in

    def describe(self) -> str:
        parts = []
        if self.rounds:
            parts.append("open rounds " + ", ".join(f"fragment {f} on v{v} ({a} answered, quorum {q})"
                                                    for f, v, a, q in self.rounds[:8]))
        if self.missing:
            parts.append("waiting for islands " + ", ".join(self.missing))
        if self.unfinished:
            parts.append("the final cut waits for islands " + ", ".join(self.unfinished) + " to finish")
        return "; ".join(parts) or "no round of this island is open"


_COMPOSE_PIECE = 1 << 18


@dataclass
class Base:
    fragment: int
    version: int
    dtype: str
    values: Optional[np.ndarray]
    final: bool = False
    deltas: tuple = ()              # ((codec, block, encoded body), ...) when values is None
    start: Optional[int] = None     # the base version the first delta applies to
    size: int = 0                   # values of the fragment (when values is None)
    held: bool = False              # start from the weights the island holds (they equal the base of `start`)
    merge: Optional[dict] = None    # the syncer's figures of the merge that made this version (merge_info)

    @property
    def relative(self) -> bool:
        return self.values is None

    def delta_range(self, i: int, start: int, count: int) -> np.ndarray:
        codec, block, body = self.deltas[i]
        return codecs.decode_range(codec, body, self.numel, start, count, block)

    @property
    def numel(self) -> int:
        if self.values is not None:
            return int(self.values.size)
        return int(self.size)

    def then(self, nxt: "Base") -> "Base":
        """This base followed by ``nxt``: a full base replaces it; an update must start at this version and is
        added (a full base + updates becomes the full newer base, float32 additions in order, exactly as the
        syncer computed it; updates to updates are chained)."""
        if not nxt.relative or nxt.held:
            return nxt
        merge = nxt.merge
        if nxt.start != self.version:
            raise ProtocolError(f"base update of fragment {nxt.fragment} applies to v{nxt.start}, but the base "
                                f"held is v{self.version}")
        if self.relative:
            return Base(self.fragment, nxt.version, nxt.dtype, None, nxt.final, self.deltas + nxt.deltas, self.start,
                        self.size, self.held, merge)
        vals = self.values if self.values.flags.writeable else self.values.copy()
        n = vals.size
        for i in range(len(nxt.deltas)):
            for a in range(0, n, _COMPOSE_PIECE):
                k = min(_COMPOSE_PIECE, n - a)
                vals[a:a + k] += nxt.delta_range(i, a, k)
        if not np.isfinite(vals).all():
            raise ProtocolError(f"base update of fragment {nxt.fragment} to v{nxt.version} makes it non-finite")
        return Base(self.fragment, nxt.version, "f32", vals, nxt.final, merge=merge)


_MERGE_FIELDS = {"weight": (0.0, 1.0), "outer_lr": (-1e6, 1e6), "outer_grad_norm": (0.0, 1e30),
                 "lag": (0, 1 << 20), "islands": (0, 1 << 20)}


def merge_info(meta: dict) -> Optional[dict]:
    """The BASE message's ``merge`` figures (this island's weight and lag in the merge that made the version,
    the pushes merged, the outer learning rate and gradient norm), each checked and bounded; None when absent or
    malformed (figures only: a bad one never fails the link)."""
    m = meta.get("merge")
    if not isinstance(m, dict) or len(m) > 16:
        return None
    out = {}
    for k, (lo, hi) in _MERGE_FIELDS.items():
        v = m.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:   # (refuses nan)
            return None
        if isinstance(lo, int) and not isinstance(v, int):
            return None
        out[k] = v
    return out or None


@dataclass
class PushReply:
    fragment: int
    base_version: int
    status: str
    lag: int = 0
    version: Optional[int] = None
    message: str = ""
    rhythm: Optional[tuple] = None   # (eta_s, period_s) of the rhythm island's next push of the fragment


TRANSIENT_CODES = ("integrity", "island-taken")   # a frame altered on the path; an id held by a live connection


def recoverable(e: BaseException) -> bool:
    """Whether ``e`` means the link to the syncer is gone (reconnecting may help) rather than a refusal: lost
    or stalled connections, corrupt frames, connection refused while the syncer restarts, and anything in a
    handshake that nothing authenticated (``transient``: a clear refusal, a CHALLENGE that cannot be answered,
    a first protected frame that fails) or that names another run.  Authenticated refusals (auth, manifest,
    too-many-islands), refused pushes and codec errors are final, except ``integrity`` and ``island-taken``."""
    if getattr(e, "transient", False):
        return True
    if isinstance(e, PeerError) and e.code in TRANSIENT_CODES:
        return True
    if isinstance(e, (PeerError, AuthError, CodecError)):
        return False
    return isinstance(e, (ProtocolError, OSError, EOFError))
