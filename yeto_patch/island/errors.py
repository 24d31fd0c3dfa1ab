"""The island's one error type (raised on every rank of the island with rank 0's message)."""
from __future__ import annotations


class EngineError(RuntimeError):
    """A DiLoCo boundary failed; raised on every rank of the island with the cause."""


def describe(e: BaseException, what: str) -> str:
    """A one-line message for an error met while trying to `what`, with the hint that helps (recognised by
    class, never by name)."""
    from yeto_patch.wire.client import SyncerRefusal
    from yeto_patch.wire.frames import AuthError, PeerError
    from yeto_patch.wire.transport import ConnectError
    text = str(e) or type(e).__name__
    if isinstance(e, SyncerRefusal):
        code = getattr(e, "code", "refused")
        hint = " (the island's base is too old: it must pull the current base)" if code == "stale" else ""
        return f"yeto-patch: the syncer refused a push ({code}): {text}{hint}"
    if isinstance(e, AuthError):
        return f"yeto-patch: authentication with the syncer failed: {text} (check YETO_DILOCO_KEY_FILE / YETO_KEY)"
    if isinstance(e, PeerError):
        return f"yeto-patch: the syncer reported an error while trying to {what}: {text}"
    if isinstance(e, ConnectError):
        return f"yeto-patch: cannot {what}: {text} (is the syncer running? check YETO_DILOCO_SYNCER)"
    if text.startswith("yeto-patch"):
        return text
    return f"yeto-patch: failed to {what}: {type(e).__name__}: {text}"
