"""A PUSH from the wire to the coordinator and its PUSH_REPLY back: the fields a peer sent, checked."""
from __future__ import annotations

import logging

from ..wire import codecs
from .rounds import Coordinator
from .settings import Push, PushRefused

__all__ = ["parse_push", "refusal", "accept_push"]

log = logging.getLogger("yeto.syncer")


def _count(meta: dict, name: str) -> int:
    v = meta.get(name, 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise PushRefused("bad-push", f"malformed PUSH: missing or bad field {name}={v!r} (need an integer >= 0)")
    return v


def parse_push(island: str, incarnation, meta: dict, body) -> Push:
    """The push ``meta`` + ``body`` describe; raises PushRefused("bad-push") naming the bad field."""
    for name in ("fragment", "base_version", "codec"):
        if name not in meta:
            raise PushRefused("bad-push", f"malformed PUSH: missing or bad field {name!r}")
    return Push(island=island, fragment=meta["fragment"], base_version=meta["base_version"],
                codec=str(meta["codec"]), block=_count(meta, "block") or codecs.DEFAULT_BLOCK, body=body,
                local_step=_count(meta, "local_step"), steps=_count(meta, "steps"), tokens=_count(meta, "tokens"),
                final=bool(meta.get("final", False)), incarnation=str(incarnation))


def refusal(fragment, base_version, code: str, message: str) -> dict:
    return {"fragment": fragment, "base_version": base_version, "status": "refused", "code": code,
            "message": message}


def accept_push(coord: Coordinator, p: Push, island: str) -> dict:
    """Hand ``p`` to the coordinator; the PUSH_REPLY that answers it."""
    reply = {"fragment": p.fragment, "base_version": p.base_version}
    try:
        status, lag = coord.accept(p)
        reply.update(status=status, lag=lag)
        if status == "closed":
            reply["message"] = "this fragment takes no more pushes (final cut / total rounds reached)"
    except PushRefused as e:
        log.warning("refused push of fragment %s (base v%s) from island %s: %s", p.fragment, p.base_version,
                    island, e.message)
        reply = refusal(p.fragment, p.base_version, e.code, e.message)
    if p.fragment is not None and isinstance(p.fragment, int) and 0 <= p.fragment < len(coord.frags):
        reply["version"] = coord.frags[p.fragment].version
    return reply
