"""What an island sends the syncer, built and checked before it goes out: the manifest as its HELLO carries it, a
message meta padded so that its body starts aligned, an INIT body in pieces, a PUSH's meta checked against the
syncer's layout, and a heartbeat. The counterpart of inbox.py; nothing here keeps state or touches a socket:
``SyncerClient`` owns the connection and sends them."""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from . import codecs
from .frames import ProtocolError
from .message import encode_meta

__all__ = ["SEND_PIECE", "aligned", "manifest_entries", "init_pieces", "push_size", "push_meta", "heartbeat_meta"]

SEND_PIECE = 4 << 20   # bytes per buffer of a streamed INIT body


def aligned(meta: dict, align: int = 64) -> dict:
    """A copy of ``meta`` padded (field ``_pad``) so that the body after the message's meta starts at a multiple
    of ``align`` bytes."""
    m = dict(meta)
    m["_pad"] = ""
    n = 4 + len(encode_meta(m))
    m["_pad"] = " " * ((-n) % align)
    return m


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


def push_meta(fragment: int, numel: int, *, base_version: int, local_step: int, steps: int, tokens: int,
              codec: str, block: int, final: bool, blend: bool, patience: Optional[float]) -> dict:
    """The PUSH meta (aligned; docs/protocol.md, "Pushes")."""
    return aligned({"fragment": fragment, "base_version": int(base_version), "local_step": int(local_step),
                    "steps": int(steps), "tokens": int(tokens), "codec": codec, "block": int(block),
                    "numel": numel, "final": bool(final), "blend": bool(blend),
                    **({} if patience is None else {"patience": round(max(0.0, float(patience)), 3)})})


def heartbeat_meta(step: int, rate: float) -> dict:
    """An island's HEARTBEAT: its step, and its compute rate (steps/s) when known."""
    beat = {"step": int(step)}
    if rate > 0:
        beat["rate"] = round(float(rate), 6)
    return beat
