"""A PUSH from the wire to the coordinator and its PUSH_REPLY back: the fields a peer sent, checked and bounded.

Every number of a PUSH is an integer in a documented range before it reaches the coordinator (docs/protocol.md,
"Pushes"), and a reply echoes only values that are valid JSON and bounded (the ``fragment`` and ``base_version``
the push gave when they are such integers, else null), so refusing a hostile push never breaks the reply that
carries the refusal and the connection stays open.
"""
from __future__ import annotations

import logging

from ...wire import codecs
from .coordinator import Coordinator
from .settings import INT64_MAX, Push, PushRefused, bounded_int, shown

__all__ = ["parse_push", "echo", "accept_push", "MAX_CODEC_NAME"]

log = logging.getLogger("yeto.syncer")
MAX_CODEC_NAME = 32
MAX_REPLY_MESSAGE = 1000


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
                patience=patience if isinstance(patience, (int, float)) and not isinstance(patience, bool) else None)


def refusal(fragment, base_version, code: str, message: str) -> dict:
    return {**echo(fragment, base_version), "status": "refused", "code": code,
            "message": message[:MAX_REPLY_MESSAGE]}


def accept_push(coord: Coordinator, p: Push, island: str) -> dict:
    """Hand ``p`` to the coordinator; the PUSH_REPLY that answers it."""
    reply = echo(p.fragment, p.base_version)
    try:
        status, lag = coord.accept(p)
        reply.update(status=status, lag=lag)
        if status == "closed":
            reply["message"] = "this fragment takes no more pushes (final cut / total rounds reached)"
    except PushRefused as e:
        log.warning("refused push of fragment %s (base v%s) from island %s [%s]: %s", shown(p.fragment),
                    shown(p.base_version), island, e.code, e.message[:MAX_REPLY_MESSAGE])
        reply = refusal(p.fragment, p.base_version, e.code, e.message)
    if bounded_int(p.fragment, len(coord.frags) - 1):
        reply["version"] = coord.frags[p.fragment].version
    return reply
