"""Structured message payloads: ``u32`` meta length + UTF-8 JSON object (the meta) + binary body.

No pickle: the meta is plain JSON (no NaN/Infinity, no duplicate keys, an object at the top level).
"""
from __future__ import annotations

import json
import struct

from .frames import FrameError

META_LEN = struct.Struct("<I")
MAX_META = 16 << 20  # bytes of JSON

__all__ = ["META_LEN", "MAX_META", "pack_meta", "unpack", "encode_meta", "decode_meta"]


def encode_meta(meta: dict) -> bytes:
    if not isinstance(meta, dict):
        raise FrameError(f"message meta must be a dict, got {type(meta).__name__}")
    try:
        raw = json.dumps(meta, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise FrameError(f"message meta is not plain JSON: {e}") from None
    if len(raw) > MAX_META:
        raise FrameError(f"message meta of {len(raw)} bytes exceeds {MAX_META}")
    return raw


def pack_meta(meta: dict, body_len: int = 0) -> bytes:
    """The payload prefix (meta length + JSON); the payload is this followed by ``body_len`` body bytes."""
    if body_len < 0:
        raise FrameError(f"negative body length {body_len}")
    raw = encode_meta(meta)
    return META_LEN.pack(len(raw)) + raw


def _no_dupes(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise FrameError(f"message meta has a duplicate key {k!r}")
        d[k] = v
    return d


def _no_constant(name):
    raise FrameError(f"message meta contains {name}, which is not JSON")


def decode_meta(raw) -> dict:
    try:
        text = bytes(raw).decode("utf-8")
        meta = json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_no_constant)
    except FrameError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FrameError(f"message meta is not valid UTF-8 JSON: {e}") from None
    if not isinstance(meta, dict):
        raise FrameError(f"message meta must be a JSON object, got {type(meta).__name__}")
    return meta


def unpack(payload) -> tuple[dict, memoryview]:
    """Split a payload into (meta, body view). Raises FrameError on any malformation."""
    mv = memoryview(payload)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if len(mv) < META_LEN.size:
        raise FrameError(f"truncated message: {len(mv)} bytes, no meta length")
    (n,) = META_LEN.unpack(mv[: META_LEN.size])
    if n > MAX_META:
        raise FrameError(f"message meta length {n} exceeds {MAX_META}")
    end = META_LEN.size + n
    if end > len(mv):
        raise FrameError(f"truncated message: meta of {n} bytes, only {len(mv) - META_LEN.size} present")
    return decode_meta(mv[META_LEN.size: end]), mv[end:]
