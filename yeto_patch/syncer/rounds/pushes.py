"""A PUSH from the wire to the coordinator and its PUSH_REPLY back: the fields a peer sent, checked and bounded, and
the checks a push passes before a round takes it (holding no state).

Every number of a PUSH is an integer in a documented range before it reaches the coordinator (docs/protocol.md,
"Pushes"; syncer/bounds.py), and a reply echoes only values that are valid JSON and bounded (the ``fragment`` and
``base_version`` the push gave when they are such integers, else null), so refusing a hostile push never breaks the
reply that carries the refusal and the connection stays open. The checks raise ``PushRefused`` naming what is
wrong: its counters; its fragment, base and codec against the layout; its standing against the fragment's state
now (lag, duplicate).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from ...wire import codecs
from ...wire.frames import CodecError
from ..bounds import INT64_MAX, MAX_PATIENCE_S, MAX_PUSH_STEPS, MAX_PUSH_TOKENS, bounded_int, bounded_number, shown

__all__ = ["Push", "PushRefused", "parse_push", "echo", "refusal", "reply_for", "check_counters", "push_target",
           "push_standing", "MAX_CODEC_NAME"]

log = logging.getLogger("yeto.syncer")
MAX_CODEC_NAME = 32
MAX_REPLY_MESSAGE = 1000


class PushRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Push:
    island: str
    fragment: int
    base_version: int
    codec: str
    block: int
    body: object  # bytes-like, encoded
    local_step: int = 0
    steps: int = 0
    tokens: int = 0
    final: bool = False
    incarnation: str = ""
    blend: bool = False   # the island blends merged bases in (tau > 0): the outer lr "auto" rule depends on it
    nbytes: int = 0
    patience: Optional[float] = None   # seconds from sending until the island blocks for the answer (None: unknown)
    arrived: Optional[float] = None    # the coordinator's clock when it was accepted


def echo(fragment, base_version) -> dict:
    """``fragment`` / ``base_version`` as a reply may carry them: integers in int64 range, else None."""
    return {"fragment": fragment if bounded_int(fragment, INT64_MAX, -INT64_MAX - 1) else None,
            "base_version": base_version if bounded_int(base_version, INT64_MAX, -INT64_MAX - 1) else None}


def _count(meta: dict, name: str) -> int:
    v = meta.get(name, 0)
    if not bounded_int(v):
        raise PushRefused("bad-push", f"malformed PUSH: {name}={shown(v)} (need an integer in [0, 2^63-1])")
    return v


def parse_push(island: str, incarnation, meta: dict, body) -> Push:
    """The push ``meta`` + ``body`` describe; raises PushRefused("bad-push") naming the bad field."""
    for name in ("fragment", "base_version", "codec"):
        if name not in meta:
            raise PushRefused("bad-push", f"malformed PUSH: missing or bad field {name!r}")
    codec = meta["codec"]
    if not isinstance(codec, str) or len(codec) > MAX_CODEC_NAME:
        raise PushRefused("bad-codec", f"unknown codec {shown(codec)} (known: {', '.join(codecs.CODECS)})")
    blend = meta.get("blend", False)
    if not isinstance(blend, bool):
        raise PushRefused("bad-push", f"malformed PUSH: blend={shown(blend)} (need true or false)")
    patience = meta.get("patience")   # (optional; anything but a number in range is read as unknown)
    return Push(island=island, fragment=meta["fragment"], base_version=meta["base_version"], codec=codec,
                block=_count(meta, "block") or codecs.DEFAULT_BLOCK, body=body, local_step=_count(meta, "local_step"),
                steps=_count(meta, "steps"), tokens=_count(meta, "tokens"), final=bool(meta.get("final", False)),
                incarnation=str(incarnation), blend=blend,
                patience=patience if bounded_number(patience, MAX_PATIENCE_S) else None)


def refusal(fragment, base_version, code: str, message: str) -> dict:
    return {**echo(fragment, base_version), "status": "refused", "code": code,
            "message": message[:MAX_REPLY_MESSAGE]}


def reply_for(coord, p: Push) -> dict:
    """Hand ``p`` to the coordinator (rounds/coordinator.py); the PUSH_REPLY that answers it."""
    reply = echo(p.fragment, p.base_version)
    try:
        status, lag = coord.accept(p)
        reply.update(status=status, lag=lag)
        if status == "closed":
            reply["message"] = "this fragment takes no more pushes (final cut / total rounds reached)"
    except PushRefused as e:
        log.warning("refused push of fragment %s (base v%s) from island %s [%s]: %s", shown(p.fragment),
                    shown(p.base_version), p.island, e.code, e.message[:MAX_REPLY_MESSAGE])
        reply = refusal(p.fragment, p.base_version, e.code, e.message)
    if bounded_int(p.fragment, len(coord.frags) - 1):
        reply["version"] = coord.frags[p.fragment].version
    return reply


def check_counters(p: Push) -> None:
    """Refuse a push whose step and token counters are out of range (exact in float64: rounds/weights.py); a
    patience that is not a number in range becomes None (unknown)."""
    for name, hi in (("local_step", INT64_MAX), ("steps", MAX_PUSH_STEPS), ("tokens", MAX_PUSH_TOKENS)):
        v = getattr(p, name)
        if not bounded_int(v, hi):
            raise PushRefused("bad-push", f"push reports {name} = {shown(v)}; need an integer in [0, {hi}]")
    if not bounded_number(p.patience, MAX_PATIENCE_S):
        p.patience = None


def push_target(p: Push, initialized: bool, frags: list,
                owner_refusal: Callable[[int, str], Optional[PushRefused]]):
    """The fragment ``p`` is for, after checking that the run is initialized, that the fragment exists and this
    shard owns it (``owner_refusal``: Coordinator.owner_refusal), that its base exists and its codec is known."""
    if not initialized:
        raise PushRefused("not-initialized", "the run has no base yet (waiting for INIT); push refused")
    if not bounded_int(p.fragment, len(frags) - 1):
        raise PushRefused("bad-fragment", f"push for fragment {shown(p.fragment)}; the layout has "
                                          f"{len(frags)} fragments")
    wrong = owner_refusal(p.fragment, "push")
    if wrong is not None:
        raise wrong
    f = frags[p.fragment]
    if not bounded_int(p.base_version, f.version):
        raise PushRefused("bad-base", f"push of fragment {f.index} relative to base v{shown(p.base_version)}, "
                                      f"but the syncer's newest is v{f.version}")
    try:
        codecs.check_codec(p.codec, p.block)
    except CodecError as e:
        raise PushRefused("bad-codec", str(e)) from None
    return f


def push_standing(p: Push, f, merging: bool, seen: set, max_base_lag: int) -> tuple[Optional[str], int]:
    """The checks of a push against the fragment's state now (``merging``: its open round is being merged):
    ("closed", 0) when the fragment takes no more pushes, else (None, lag); raises PushRefused for a stale push or
    a duplicate (``seen``: accepted (island, fragment, base_version))."""
    if f.closed:
        return "closed", 0
    lag = f.version - p.base_version + (1 if merging else 0)
    if lag > max_base_lag:
        raise PushRefused("stale", f"push of fragment {f.index} is relative to base v{p.base_version} but the "
                                   f"syncer is at v{f.version} (lag {lag} > max-base-lag "
                                   f"{max_base_lag}); pull the current base and push again")
    if (p.island, f.index, p.base_version) in seen:
        raise PushRefused("duplicate", f"island {p.island!r} already pushed fragment {f.index} relative to "
                                       f"base v{p.base_version}; duplicate refused")
    return None, lag
