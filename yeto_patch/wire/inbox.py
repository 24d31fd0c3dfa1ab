"""What the syncer sends an island, read and checked before the client keeps it: its WELCOME and the limits of a
session after it, every PUSH_REPLY, and every BASE / FINAL_BASE (a full float32 base, a coded one, the weights the
island declared it holds, or an update of the previous base). Nothing here keeps state: ``SyncerClient`` owns what
it received; what it sends is built in outbox.py."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from . import codecs
from .frames import CodecError, MsgType, ProtocolError
from .values import DELTA_CODECS, Base, PushReply, Welcome, merge_info, shard_fields

__all__ = ["read_welcome", "session_limits", "read_base", "read_reply"]


def read_welcome(meta: dict) -> Welcome:
    """The WELCOME's meta as a Welcome (defaults for the fields an older syncer does not send; shard fields
    checked)."""
    return Welcome(island_id=meta["island_id"], layout=meta["layout"], numels=meta["numels"],
                   fragments=meta["fragments"], versions=meta.get("versions"),
                   needs_init=list(meta.get("needs_init") or []), base_wire=meta.get("base_wire", "f32"),
                   heartbeat_s=float(meta.get("heartbeat_s", 5.0)), lease_s=float(meta.get("lease_s", 60.0)),
                   islands=meta.get("islands", 1), quorum=meta.get("quorum", 1),
                   total_rounds=meta.get("total_rounds"), final=bool(meta.get("final")),
                   run_id=meta.get("run_id"), **shard_fields(meta))


def read_reply(meta: dict) -> PushReply:
    """A PUSH_REPLY's meta as a PushReply."""
    return PushReply(meta.get("fragment"), meta.get("base_version"), meta.get("status", "?"),
                     int(meta.get("lag", 0) or 0), meta.get("version"), meta.get("message", ""))


def session_limits(w: Welcome) -> tuple:
    """(per-type maxima, reassembly budget) of what the syncer may send after its WELCOME: a base is at most the
    largest fragment in float32 plus room for its meta, everything else 1 MiB."""
    numels = [int(n) for n in w.numels]
    if not numels or min(numels) < 0:
        raise ProtocolError("malformed WELCOME: no fragment sizes")
    bulk = 4 * max(numels) + (1 << 20)
    limits = {**{t: 1 << 20 for t in MsgType if t != MsgType.CHUNK}, MsgType.BASE: bulk, MsgType.FINAL_BASE: bulk}
    return limits, bulk + (2 << 20)


def read_base(t: MsgType, meta: dict, body, welcome, declared: bool, last: Mapping[int, int]) -> Base:
    """The BASE or FINAL_BASE message (t, meta, body) as a Base, checked against the welcome's layout (None: not
    checked). ``declared``: this island declared digests of the weights it holds (a ``held`` base may answer
    them); ``last``: fragment -> version of the last base received on this connection. A base update comes back
    with ``values`` None and its encoded change in ``deltas``. ProtocolError naming what is wrong."""
    frag, version, dtype, numel = int(meta["fragment"]), int(meta["version"]), meta["dtype"], int(meta["numel"])
    if welcome is not None and not (0 <= frag < welcome.fragments and numel == welcome.numels[frag]):
        raise ProtocolError(f"base for fragment {frag} of {numel} values does not match the layout")
    if meta.get("delta_from") is not None:
        return _base_update(t, meta, body, frag, version, dtype, numel, last)
    if dtype == "held":   # the base is what this island declared it holds (digests in its MANIFEST)
        if not declared or t != MsgType.BASE or meta.get("final") or len(memoryview(body)) or frag in last:
            raise ProtocolError(f"unexpected 'held' base for fragment {frag} (this island declared no "
                                f"digests, or it is not the first base of the fragment, or it has a body)")
        return Base(frag, version, "held", None, False, (), version, numel, held=True, merge=merge_info(meta))
    if dtype == "f32":
        mv = memoryview(body).cast("B")
        if mv.nbytes != 4 * numel:
            raise ProtocolError(f"f32 base of fragment {frag}: {mv.nbytes} bytes for {numel} values")
        values = np.frombuffer(mv, np.float32)
        if values.ctypes.data % 4 or not values.flags.writeable:
            values = values.copy()
        for a in range(0, numel, 1 << 18):  # chunked: no full-size temporary
            if not np.isfinite(values[a:a + (1 << 18)]).all():
                raise ProtocolError(f"base of fragment {frag} has non-finite values")
    else:
        values = codecs.decode(dtype, body, numel)
    return Base(frag, version, dtype, values, final=(t == MsgType.FINAL_BASE) or bool(meta.get("final")),
                merge=merge_info(meta))


def _base_update(t, meta, body, frag, version, dtype, numel, last) -> Base:
    """A BASE that carries the change from the previous base (``--base-wire int8/int4``), validated: the client
    composes it with a base not yet polled, or the island applies it to its anchors."""
    start = meta["delta_from"]
    block = meta.get("block", codecs.DEFAULT_BLOCK)
    if t != MsgType.BASE or meta.get("final"):
        raise ProtocolError("a final base must be a full float32 base, not an update")
    if dtype not in DELTA_CODECS or isinstance(start, bool) or not isinstance(start, int) \
            or isinstance(block, bool) or not isinstance(block, int):
        raise ProtocolError(f"base update of fragment {frag}: bad dtype/delta_from/block "
                            f"{dtype!r}/{start!r}/{block!r}")
    if start != version - 1 or last.get(frag) != start:
        raise ProtocolError(f"base update of fragment {frag} from v{start} to v{version}, but the last base "
                            f"received for it is v{last.get(frag)}")
    try:
        codecs.check_encoded(dtype, body, numel, block)
    except CodecError as e:
        raise ProtocolError(f"base update of fragment {frag} to v{version}: {e}") from None
    return Base(frag, version, dtype, None, False, ((dtype, block, np.frombuffer(body, np.uint8)),), start, numel,
                merge=merge_info(meta))
