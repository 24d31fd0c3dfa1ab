"""Chunk envelopes and reassembly of large messages.

A message whose payload is larger than the chunk size travels as a sequence of CHUNK frames. Each CHUNK
payload is a 28-byte envelope ``struct "<QHHQQ"`` = message id u64, inner message type u16, reserved u16 (0),
total payload length u64, offset u64, followed by the data. Chunks of one message are sent in increasing
offset order without gaps; chunks of different messages may interleave.
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Optional

import numpy as np

from .frames import MAX_PAYLOAD, FrameError, MsgType, type_name

DEFAULT_CHUNK = 4 << 20
ENVELOPE = struct.Struct("<QHHQQ")
ENVELOPE_SIZE = ENVELOPE.size  # 28
MAX_CHUNK = MAX_PAYLOAD[MsgType.CHUNK] - ENVELOPE_SIZE  # largest data part of one chunk

__all__ = ["DEFAULT_CHUNK", "ENVELOPE", "ENVELOPE_SIZE", "MAX_CHUNK", "Envelope", "pack_envelope",
           "unpack_envelope", "Reassembler"]


class Envelope(NamedTuple):
    msg_id: int
    inner_type: int
    total: int
    offset: int


def pack_envelope(msg_id: int, inner_type: int, total: int, offset: int) -> bytes:
    return ENVELOPE.pack(msg_id, inner_type, 0, total, offset)


def unpack_envelope(payload) -> tuple[Envelope, memoryview]:
    """Split a CHUNK payload into its envelope and data (a view, no copy)."""
    mv = memoryview(payload)
    if len(mv) < ENVELOPE_SIZE:
        raise FrameError(f"truncated chunk envelope: {len(mv)} of {ENVELOPE_SIZE} bytes")
    return parse_envelope(mv[:ENVELOPE_SIZE]), mv[ENVELOPE_SIZE:]


def parse_envelope(buf) -> Envelope:
    msg_id, inner, reserved, total, offset = ENVELOPE.unpack(buf)
    if reserved != 0:
        raise FrameError(f"chunk envelope of message {msg_id} has reserved field {reserved} (must be 0)")
    return Envelope(msg_id, inner, total, offset)


def _label(env: Envelope) -> str:
    return f"{type_name(env.inner_type)} message {env.msg_id}"


class _Partial:
    __slots__ = ("inner_type", "total", "buf", "received")

    def __init__(self, inner_type: int, total: int):
        self.inner_type = inner_type
        self.total = total
        # np.empty: pages are only committed as data arrives (a bytearray would be zero-filled up front)
        self.buf = np.empty(total, np.uint8)
        self.received = 0


class Reassembler:
    """Reassemble chunked messages, each into one buffer of its announced size.

    Rejects (with :class:`FrameError` naming the message id and type): an unknown or CHUNK inner type, a total
    above the inner type's maximum (or ``max_total``), a changed total, empty chunks, data past the total
    (overflow), data at an offset already received (overlap), data after a gap, and more than ``max_partial``
    messages open at once. ``max_bytes`` optionally bounds the sum of the totals of open messages.
    """

    def __init__(self, max_partial: int = 4, max_bytes: Optional[int] = None,
                 max_payload: Optional[dict] = None):
        if max_partial < 1:
            raise ValueError("max_partial must be >= 1")
        self.max_partial = max_partial
        self.max_bytes = max_bytes
        self.max_payload = dict(MAX_PAYLOAD if max_payload is None else max_payload)
        self._open: dict[int, _Partial] = {}

    @property
    def open_messages(self) -> int:
        return len(self._open)

    def reserve(self, env: Envelope, length: int) -> memoryview:
        """Validate a chunk of ``length`` data bytes and return the slice of the message buffer it fills.

        Call :meth:`commit` once the data is in place (and its digest verified)."""
        p = self._open.get(env.msg_id)
        if p is None:
            try:
                inner = MsgType(env.inner_type)
            except ValueError:
                raise FrameError(f"chunk of message {env.msg_id} has unknown inner type {env.inner_type}") from None
            if inner == MsgType.CHUNK:
                raise FrameError(f"chunk of message {env.msg_id} nests another CHUNK")
            limit = self.max_payload.get(inner, 0)
            if env.total > limit:
                raise FrameError(f"{_label(env)} announces {env.total} bytes, above the maximum {limit}")
            if env.total == 0:
                raise FrameError(f"{_label(env)} announces an empty chunked message")
            if len(self._open) >= self.max_partial:
                raise FrameError(f"{_label(env)}: too many partial messages open "
                                 f"({len(self._open)}, max {self.max_partial})")
            if self.max_bytes is not None:
                used = sum(q.total for q in self._open.values())
                if used + env.total > self.max_bytes:
                    raise FrameError(f"{_label(env)} of {env.total} bytes exceeds the reassembly budget "
                                     f"({used} of {self.max_bytes} bytes in use)")
            if env.offset != 0:
                raise FrameError(f"{_label(env)}: first chunk at offset {env.offset} (gap: bytes 0..{env.offset})")
            try:
                p = _Partial(inner, env.total)
            except MemoryError:
                raise FrameError(f"{_label(env)}: cannot allocate {env.total} bytes to reassemble it") from None
            self._open[env.msg_id] = p
        else:
            if env.inner_type != p.inner_type or env.total != p.total:
                raise FrameError(f"{_label(env)}: chunk changes the message's type/total "
                                 f"({type_name(p.inner_type)}/{p.total} -> {type_name(env.inner_type)}/{env.total})")
        if length <= 0:
            raise FrameError(f"{_label(env)}: empty chunk at offset {env.offset}")
        if env.offset + length > env.total:
            raise FrameError(f"{_label(env)}: chunk [{env.offset}, {env.offset + length}) overflows the total "
                             f"{env.total}")
        if env.offset < p.received:
            raise FrameError(f"{_label(env)}: chunk at offset {env.offset} overlaps data already received "
                             f"(up to {p.received})")
        if env.offset > p.received:
            raise FrameError(f"{_label(env)}: gap: chunk at offset {env.offset}, expected {p.received}")
        return memoryview(p.buf)[env.offset: env.offset + length]

    def commit(self, env: Envelope, length: int) -> Optional[tuple[MsgType, np.ndarray]]:
        """Mark ``length`` bytes at ``env.offset`` received; returns ``(inner_type, buffer)`` when complete."""
        p = self._open[env.msg_id]
        p.received += length
        if p.received == p.total:
            del self._open[env.msg_id]
            return MsgType(p.inner_type), p.buf
        return None

    def feed(self, env: Envelope, data) -> Optional[tuple[MsgType, np.ndarray]]:
        """Add one chunk (copying ``data`` into the message buffer). Returns ``(inner_type, buffer)`` (a uint8
        numpy array of the total size) when the message is complete, else None."""
        if not isinstance(env, Envelope):
            env = parse_envelope(env)
        data = memoryview(data).cast("B")
        dst = self.reserve(env, len(data))
        dst[:] = data
        return self.commit(env, len(data))

    def drop(self, msg_id: int) -> None:
        self._open.pop(msg_id, None)

    def clear(self) -> None:
        self._open.clear()
