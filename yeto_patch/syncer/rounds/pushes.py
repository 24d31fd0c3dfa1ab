"""A push as the syncer holds it, its reply, and the checks a push passes before a round takes it (holding no
state).

A PUSH's meta is read and bounded by its schema (wire/schema.py: every number an integer in its documented range,
docs/protocol.md "Pushes"); its reply echoes only bounded values, so refusing a hostile push never breaks the reply
that carries the refusal and the connection stays open. The checks here raise ``PushRefused`` naming what is
wrong: its fragment, base and codec against the layout; its standing against the fragment's state now (lag,
duplicate).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from ...wire import codecs
from ...wire.frames import CodecError
from ...wire.schema import (INT64_MAX, MAX_PATIENCE_S, MAX_PUSH_STEPS, MAX_PUSH_TOKENS, SchemaError, bounded_int,
                            bounded_number, read_push, refusal_meta, reply_meta, shown)

__all__ = ["ReceivedPush", "PushRefused", "parse_push", "refusal", "reply_for", "check_counters", "push_target",
           "push_standing"]

log = logging.getLogger("yeto.syncer")


class PushRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class ReceivedPush:
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
    rate: Optional[float] = None       # the island's compute rate, steps/s, as the push says it (None: not said)
    pinned: bool = False               # the island pinned H (the push says so)
    pretrained: bool = False           # the island's run started from pretrained weights (the outer lr auto rule)
    arrived: Optional[float] = None    # the coordinator's clock when it was accepted


def parse_push(island: str, incarnation, meta: dict, body) -> ReceivedPush:
    """The push ``meta`` + ``body`` describe (wire/schema.read_push); raises PushRefused naming the bad field."""
    try:
        h = read_push(meta, codecs.CODECS)
    except SchemaError as e:
        raise PushRefused(e.code, e.message) from None
    return ReceivedPush(island=island, fragment=h.fragment, base_version=h.base_version, codec=h.codec,
                block=h.block or codecs.DEFAULT_BLOCK, body=body, local_step=h.local_step, steps=h.steps,
                tokens=h.tokens, final=h.final, incarnation=str(incarnation), blend=h.blend, patience=h.patience,
                rate=h.rate, pinned=h.pinned, pretrained=h.pretrained)


def refusal(fragment, base_version, code: str, message: str) -> dict:
    return refusal_meta(fragment, base_version, code, message)


def reply_for(coord, p: ReceivedPush) -> dict:
    """Hand ``p`` to the coordinator (rounds/coordinator.py); the PUSH_REPLY that answers it."""
    try:
        status, lag = coord.accept(p)
    except PushRefused as e:
        log.warning("refused push of fragment %s (base v%s) from island %s [%s]: %s", shown(p.fragment),
                    shown(p.base_version), p.island, e.code, e.message[:1000])
        return refusal_meta(p.fragment, p.base_version, e.code, e.message, version=_version(coord, p))
    message = ""
    if status == "closed":
        message = "this fragment takes no more pushes (final cut / total rounds reached)"
        log.info("push of fragment %s (base v%s) from island %s came after the fragment closed: the final model "
                 "answers it", shown(p.fragment), shown(p.base_version), p.island)
    rhythm = coord.rhythm_after(p) if status in ("accepted", "carried") else None
    return reply_meta(p.fragment, p.base_version, status, lag, _version(coord, p), message, rhythm)


def _version(coord, p: ReceivedPush) -> Optional[int]:
    return coord.frags[p.fragment].version if bounded_int(p.fragment, len(coord.frags) - 1) else None


def check_counters(p: ReceivedPush) -> None:
    """Refuse a push whose step and token counters are out of range (exact in float64: rounds/weights.py); a
    patience that is not a number in range becomes None (unknown)."""
    for name, hi in (("local_step", INT64_MAX), ("steps", MAX_PUSH_STEPS), ("tokens", MAX_PUSH_TOKENS)):
        v = getattr(p, name)
        if not bounded_int(v, hi):
            raise PushRefused("bad-push", f"push reports {name} = {shown(v)}; need an integer in [0, {hi}]")
    if not bounded_number(p.patience, MAX_PATIENCE_S):
        p.patience = None


def push_target(p: ReceivedPush, initialized: bool, frags: list,
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


def push_standing(p: ReceivedPush, f, merging: bool, seen: set, max_base_lag: int) -> tuple[Optional[str], int]:
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
