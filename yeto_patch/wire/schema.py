"""One schema per message of the syncer protocol: how its meta is built, read and bounded, used by the island
(wire/client.py) and the syncer (yeto_patch/syncer) alike (docs/protocol.md, "Syncer protocol"). This module is
large because the protocol is: one section per message, each with its builder and its reader.

For each message a ``*_meta(...)`` builds the meta its sender sends and a ``read_*(meta)`` reads what a receiver
got: every field of a peer's message is a value of the documented type and range before anything else reads it,
and an echo or a text is cut to a bounded length. ``SchemaError`` names the field (its ``code`` is the refusal
code a syncer answers it with). A base's body is checked by ``read_base`` against the layout; a push's body by the syncer's codecs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import numpy as np

from . import codec_names, codecs
from .frames import CodecError, MsgType, ProtocolError
from .message import encode_meta
from .values import Base, PushReply, Schedule, SyncerStatus, Welcome, merge_info, shard_fields

__all__ = ["SchemaError", "INT64_MAX", "MAX_PUSH_STEPS", "MAX_PUSH_TOKENS", "MAX_PATIENCE_S", "MAX_RATE",
           "MAX_RHYTHM", "MAX_RHYTHM_S", "MAX_CODEC_NAME", "MAX_REPLY_MESSAGE", "bounded_int", "bounded_number", "shown", "aligned",
           "PushHeader", "push_meta", "read_push", "reply_meta", "refusal_meta", "echo", "read_reply",
           "island_beat_meta", "IslandBeat", "read_island_beat", "final_meta", "read_final", "ack_meta", "read_ack", "welcome_meta",
           "base_meta", "syncer_beat_meta", "read_syncer_beat", "read_welcome", "session_limits", "read_base",
           "manifest_entries", "init_pieces", "push_size", "init_meta", "SEND_PIECE"]

SEND_PIECE = 4 << 20   # bytes per buffer of a streamed INIT body

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
#: Most [fragment, eta, period] entries of a syncer HEARTBEAT's rhythm, and their largest fragment and seconds.
MAX_RHYTHM = 4096
MAX_RHYTHM_S = 1e6
MAX_CODEC_NAME = 32
MAX_REPLY_MESSAGE = 1000


class SchemaError(ProtocolError):
    """A message whose meta does not follow its schema; ``code``: what a syncer refuses it with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# ------------------------------------------------------------------------------------------------ values
def bounded_int(v, hi: int = INT64_MAX, lo: int = 0) -> bool:
    """Whether ``v`` is an integer (not a bool) in ``[lo, hi]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def bounded_number(v, hi: float, lo: float = 0.0) -> bool:
    """Whether ``v`` is an int or float (not a bool, not nan) in ``[lo, hi]``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi


def shown(v, limit: int = 40) -> str:
    """A peer's value for a message: its repr, cut to ``limit`` characters (an integer of thousands of digits
    or a long string must not end up in replies and logs whole)."""
    if isinstance(v, int) and v.bit_length() > 128:
        return f"<an integer of {v.bit_length()} bits>"
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def aligned(meta: dict, align: int = 64) -> dict:
    """A copy of ``meta`` padded (field ``_pad``) so that the body after the message's meta starts at a multiple
    of ``align`` bytes (the receiver can then view float32 bodies in place)."""
    m = dict(meta)
    m["_pad"] = ""
    n = 4 + len(encode_meta(m))
    m["_pad"] = " " * ((-n) % align)
    return m


# ------------------------------------------------------------------------------------------------- PUSH
@dataclass(frozen=True)
class PushHeader:
    """A PUSH's meta as read: every field bounded (the fragment and base against the layout are the syncer's)."""
    fragment: object       # (as sent: the syncer checks it against its layout and echoes it bounded)
    base_version: object
    codec: str
    block: int
    local_step: int
    steps: int
    tokens: int
    final: bool
    blend: bool
    patience: Optional[float]   # None: unknown (absent, or not a number in range)
    rate: Optional[float] = None   # the island's compute rate, steps/s (None: not said, or out of range)
    pinned: bool = False           # the island pinned H (it keeps the fleet's rhythm)
    pretrained: bool = False       # the island started from pretrained weights (a fine-tune; the outer lr auto rule)


def push_meta(fragment: int, numel: int, *, base_version: int, local_step: int, steps: int, tokens: int,
              codec: str, block: int, final: bool, blend: bool, patience: Optional[float], rate: float = 0.0,
              pinned: bool = False, pretrained: bool = False) -> dict:
    """The PUSH meta (aligned; docs/protocol.md, "Pushes")."""
    return aligned({"fragment": fragment, "base_version": int(base_version), "local_step": int(local_step),
                    "steps": int(steps), "tokens": int(tokens), "codec": codec, "block": int(block),
                    "numel": numel, "final": bool(final), "blend": bool(blend),
                    **({} if patience is None else {"patience": round(max(0.0, float(patience)), 3)}),
                    **({"rate": round(float(rate), 6)} if rate and rate > 0 else {}),
                    **({"pinned": True} if pinned else {}),
                    **({"pretrained": True} if pretrained else {})})


def _count(meta: dict, name: str, hi: int = INT64_MAX) -> int:
    v = meta.get(name, 0)
    if not bounded_int(v, hi):
        raise SchemaError("bad-push", f"malformed PUSH: {name}={shown(v)} (need an integer in [0, {hi}])")
    return v


def read_push(meta: dict, known_codecs) -> PushHeader:
    """A PUSH's meta, bounded; SchemaError ("bad-push" / "bad-codec") naming the bad field. ``known_codecs``: the
    codec names, for the message."""
    for name in ("fragment", "base_version", "codec"):
        if name not in meta:
            raise SchemaError("bad-push", f"malformed PUSH: missing or bad field {name!r}")
    codec = meta["codec"]
    if not isinstance(codec, str) or len(codec) > MAX_CODEC_NAME:
        raise SchemaError("bad-codec", f"unknown codec {shown(codec)} (known: {', '.join(known_codecs)})")
    blend = meta.get("blend", False)
    if not isinstance(blend, bool):
        raise SchemaError("bad-push", f"malformed PUSH: blend={shown(blend)} (need true or false)")
    patience = meta.get("patience")
    return PushHeader(fragment=meta["fragment"], base_version=meta["base_version"], codec=codec,
                      block=_count(meta, "block"), local_step=_count(meta, "local_step"),
                      steps=_count(meta, "steps", MAX_PUSH_STEPS), tokens=_count(meta, "tokens", MAX_PUSH_TOKENS),
                      final=bool(meta.get("final", False)), blend=blend,
                      patience=float(patience) if bounded_number(patience, MAX_PATIENCE_S) else None,
                      rate=float(meta["rate"]) if bounded_number(meta.get("rate"), MAX_RATE) else None,
                      pinned=meta.get("pinned") is True, pretrained=meta.get("pretrained") is True)


# ------------------------------------------------------------------------------------------- PUSH_REPLY
def echo(fragment, base_version) -> dict:
    """``fragment`` / ``base_version`` as a reply may carry them: integers in int64 range, else None."""
    return {"fragment": fragment if bounded_int(fragment, INT64_MAX, -INT64_MAX - 1) else None,
            "base_version": base_version if bounded_int(base_version, INT64_MAX, -INT64_MAX - 1) else None}


def reply_meta(fragment, base_version, status: str, lag: int = 0, version: Optional[int] = None,
               message: str = "", rhythm: Optional[list] = None) -> dict:
    """A PUSH_REPLY that takes the push (``status``: accepted, carried, closed); ``rhythm`` [eta_s, period_s]:
    when the island the fleet keeps its rhythm with pushes this fragment next, counted from the push's arrival."""
    out = {**echo(fragment, base_version), "status": status, "lag": int(lag)}
    if rhythm is not None:
        out["rhythm"] = [round(float(rhythm[0]), 3), round(float(rhythm[1]), 3)]
    if version is not None:
        out["version"] = int(version)
    if message:
        out["message"] = message[:MAX_REPLY_MESSAGE]
    return out


def refusal_meta(fragment, base_version, code: str, message: str, version: Optional[int] = None) -> dict:
    """A PUSH_REPLY that refuses the push with ``code``."""
    out = {**echo(fragment, base_version), "status": "refused", "code": code, "message": message[:MAX_REPLY_MESSAGE]}
    if version is not None:
        out["version"] = int(version)
    return out


def read_reply(meta: dict) -> PushReply:
    """A PUSH_REPLY's meta, bounded (a malformed field is read as absent)."""
    e = echo(meta.get("fragment"), meta.get("base_version"))
    status = meta.get("status")
    lag = meta.get("lag", 0)
    version = meta.get("version")
    message = meta.get("message", "")
    rhythm = meta.get("rhythm")
    rhythm = (float(rhythm[0]), float(rhythm[1])) if isinstance(rhythm, list) and len(rhythm) == 2 and \
        bounded_number(rhythm[0], MAX_RHYTHM_S, -MAX_RHYTHM_S) and bounded_number(rhythm[1], MAX_RHYTHM_S) and \
        rhythm[1] > 0 else None
    return PushReply(e["fragment"], e["base_version"], status[:32] if isinstance(status, str) else "?",
                     lag if bounded_int(lag) else 0, version if bounded_int(version) else None,
                     message[:MAX_REPLY_MESSAGE] if isinstance(message, str) else "", rhythm)


# --------------------------------------------------------------------------------- HEARTBEAT (island's)
def island_beat_meta(step: int, rate: float, pinned: bool = False, schedule: Optional[Schedule] = None) -> dict:
    """An island's HEARTBEAT: its step, its compute rate (steps/s) when known, whether it pinned H (it then
    keeps the fleet's rhythm, rounds/roster.Roster.rhythm), and its schedule when known: its H now and the step of
    each fragment's next boundary (so that the syncer knows when its pushes are due before it has pushed twice)."""
    beat = {"step": int(step)}
    if rate > 0:
        beat["rate"] = round(float(rate), 6)
    if pinned:
        beat["pinned"] = True
    if schedule is not None:
        beat["h"] = int(schedule.sync_every)
        beat["next"] = [int(s) for s in schedule.next_boundaries]
    return beat


@dataclass(frozen=True)
class IslandBeat:
    """An island's HEARTBEAT as read, every field bounded (None: not said, or out of range)."""
    step: Optional[int]
    rate: Optional[float]
    pinned: bool = False
    schedule: Optional[Schedule] = None   # its H (1 .. MAX_PUSH_STEPS) and each fragment's next boundary step


def read_island_beat(meta: dict) -> IslandBeat:
    """An island's HEARTBEAT, bounded: step and rate None when absent or out of range, pinned only when it is
    ``true``; the schedule (``h`` and ``next``, at most MAX_RHYTHM fragments) only when all of it is in range."""
    step, rate, h, nxt = meta.get("step"), meta.get("rate"), meta.get("h"), meta.get("next")
    schedule_ok = (bounded_int(h, MAX_PUSH_STEPS, 1) and isinstance(nxt, list) and 0 < len(nxt) <= MAX_RHYTHM
                   and all(bounded_int(s) for s in nxt))
    return IslandBeat(step if bounded_int(step) else None,
                      float(rate) if bounded_number(rate, MAX_RATE) else None, meta.get("pinned") is True,
                      Schedule(h, tuple(nxt)) if schedule_ok else None)


# -------------------------------------------------------------------------------------------- FINAL, ACK
def final_meta(last_step: int) -> dict:
    return {"last_step": int(last_step)}


def read_final(meta: dict) -> int:
    """FINAL's ``last_step``; SchemaError("protocol") when it is not an integer in [0, 2^63 - 1]."""
    last = meta.get("last_step", 0)
    if not bounded_int(last):
        raise SchemaError("protocol", f"malformed FINAL: last_step={shown(last)} (need an integer in [0, 2^63-1])")
    return last


def ack_meta(versions: list) -> dict:
    return {"versions": [None if v is None else int(v) for v in versions]}


def read_ack(meta: dict, fragments: int) -> Optional[list]:
    """ACK's ``versions`` (None when absent); ``["invalid"]`` when it cannot be what a final cut sent (more
    entries than fragments, or an entry that is neither null nor a bounded integer)."""
    v = meta.get("versions")
    if v is None:
        return None
    if isinstance(v, list) and len(v) <= fragments and all(x is None or bounded_int(x) for x in v):
        return v
    return ["invalid"]


# --------------------------------------------------------------------------------------------- WELCOME
def welcome_meta(w: Welcome, manifest_digest: str) -> dict:
    """The syncer's WELCOME (docs/protocol.md, "Handshake"): what ``read_welcome`` gives the island back."""
    return {"island_id": w.island_id, "run_id": w.run_id, "layout": w.layout, "numels": list(w.numels),
            "fragments": w.fragments, "versions": w.versions, "needs_init": list(w.needs_init),
            "base_wire": w.base_wire, "heartbeat_s": w.heartbeat_s, "lease_s": w.lease_s, "islands": w.islands,
            "quorum": w.quorum, "total_rounds": w.total_rounds, "manifest_digest": manifest_digest,
            "final": w.final, "shard": list(w.shard), "owned": list(w.owned),
            "shard_addresses": list(w.shard_addresses)}


# ------------------------------------------------------------------------------------- BASE, FINAL_BASE
def base_meta(fragment: int, version: int, dtype: str, numel: int, final: bool, merge: Optional[dict] = None,
              delta_from: Optional[int] = None, block: Optional[int] = None) -> dict:
    """A BASE / FINAL_BASE meta (aligned): a full base in ``dtype`` (f32, bf16, or "held": the weights the island
    declared), or with ``delta_from`` an update of the previous version in ``dtype`` (int8/int4/topk:F+intB, ``block``);
    ``merge``: this island's figures of the merge that made the version."""
    meta = {"fragment": fragment, "version": version, "dtype": dtype, "numel": numel, "final": final}
    if merge is not None:
        meta["merge"] = merge
    if delta_from is not None:
        meta.update(delta_from=delta_from, block=block)
    return aligned(meta)


# --------------------------------------------------------------------------------- HEARTBEAT (syncer's)
def syncer_beat_meta(t: float, st: SyncerStatus) -> dict:
    """The syncer's HEARTBEAT to one island: the time and what its rounds wait for (``read_syncer_beat``)."""
    out = {"t": t, "rounds": st.rounds, "missing": st.missing}
    if st.unfinished is not None:
        out["unfinished"] = st.unfinished
    if st.pace:
        out["pace"] = st.pace
    if st.rhythm:
        out["rhythm"] = st.rhythm
    if st.opened:
        out["opened"] = st.opened
    return out


def _opened(v) -> list:
    """A HEARTBEAT's opened entries, bounded: [fragment, age_s] with an integer fragment and an age in
    [0, MAX_RHYTHM_S]; anything else is left out."""
    out = []
    for e in v[:MAX_RHYTHM] if isinstance(v, list) else []:
        if isinstance(e, list) and len(e) == 2 and bounded_int(e[0], MAX_RHYTHM) and bounded_number(e[1], MAX_RHYTHM_S):
            out.append([int(e[0]), float(e[1])])
    return out


def _rhythm(v) -> list:
    """A HEARTBEAT's rhythm entries, bounded: [fragment, eta_s, period_s] with an integer fragment, a finite eta
    and a positive period within MAX_RHYTHM_S; anything else is left out."""
    out = []
    for e in v[:MAX_RHYTHM] if isinstance(v, list) else []:
        if isinstance(e, list) and len(e) == 3 and bounded_int(e[0], MAX_RHYTHM) and \
                bounded_number(e[1], MAX_RHYTHM_S, -MAX_RHYTHM_S) and bounded_number(e[2], MAX_RHYTHM_S) and e[2] > 0:
            out.append([int(e[0]), float(e[1]), float(e[2])])
    return out


def _ids(v, limit: int = 16) -> list:
    if not isinstance(v, list):
        return []
    return ["".join(c if c.isprintable() else "?" for c in x[:300]) for x in v[:limit] if isinstance(x, str)]


def read_syncer_beat(meta: dict) -> SyncerStatus:
    """A syncer HEARTBEAT's status fields, bounded and checked (anything malformed is left out)."""
    rounds = []
    for r in meta.get("rounds") or []:
        if isinstance(r, list) and len(r) == 4 and all(isinstance(x, int) and not isinstance(x, bool) for x in r):
            rounds.append(r)
        if len(rounds) >= 64:
            break
    pace = meta.get("pace", 0.0)
    pace = float(pace) if isinstance(pace, (int, float)) and not isinstance(pace, bool) and 0 <= pace <= 1e6 else 0.0
    unfinished = meta.get("unfinished")
    return SyncerStatus(rounds, _ids(meta.get("missing")), _ids(unfinished) if unfinished is not None else None,
                        pace, _rhythm(meta.get("rhythm")), opened=_opened(meta.get("opened")))


# ---------------------------------------------------------------------------------------------- INIT, HELLO
def manifest_entries(manifest) -> list:
    """The manifest as ``[(name, shape tuple, dtype)]`` of str, ints and str."""
    out = []
    for e in manifest:
        name, shape, dtype = e
        out.append((str(name), tuple(int(d) for d in shape), str(dtype)))
    return out


def init_pieces(fragment: int, arrays: Iterable[np.ndarray]):
    """The INIT body of ``fragment``: the bytes of its float32 arrays (C order) in buffers of at most SEND_PIECE;
    ProtocolError at an array that is not a float32 numpy array."""
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise ProtocolError(f"INIT of fragment {fragment}: arrays must be float32 numpy arrays")
        a = np.ascontiguousarray(a).reshape(-1)
        mv = memoryview(a).cast("B")
        for o in range(0, mv.nbytes, SEND_PIECE):
            yield mv[o:o + SEND_PIECE]


def push_size(welcome, fragment, codec: str, block: int, body, body_len: Optional[int],
              body_iter: Optional[Iterable]) -> tuple[int, int]:
    """(numel, body length) of a push of ``fragment``, checked against the welcome's layout: the fragment exists
    and the body (``body``, or ``body_iter`` of ``body_len`` bytes) is ``codec``'s exact size. ProtocolError."""
    if isinstance(fragment, bool) or not (isinstance(fragment, int) and 0 <= fragment < welcome.fragments):
        raise ProtocolError(f"push of fragment {fragment!r}: the syncer's layout has fragments "
                            f"0..{welcome.fragments - 1}")
    numel = welcome.numels[fragment]
    want = codecs.encoded_nbytes(codec, numel, block)
    if body_iter is None:
        if body is None:
            raise ProtocolError("push needs body or body_iter")
        body_len = memoryview(body).nbytes
    if body_len != want:
        raise ProtocolError(f"push of fragment {fragment}: {codec} (block {block}) of {numel} values is {want} "
                            f"bytes, got {body_len}")
    return numel, body_len


def init_meta(fragment: int, numel: int) -> dict:
    """An INIT meta (aligned): the fragment's float32 values follow (``init_pieces``)."""
    return aligned({"fragment": fragment, "numel": numel, "dtype": "f32"})


# --------------------------------------------------------------------------- WELCOME, BASE (the island reads)
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
    """A BASE that carries the change from the previous base (``--base-wire int8/int4/topk:F+intB``), validated:
    the client composes it with a base not yet polled, or the island applies it to its anchors."""
    start = meta["delta_from"]
    block = meta.get("block", codecs.DEFAULT_BLOCK)
    if t != MsgType.BASE or meta.get("final"):
        raise ProtocolError("a final base must be a full float32 base, not an update")
    if not codec_names.is_base_update(dtype) or isinstance(start, bool) or not isinstance(start, int) \
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
