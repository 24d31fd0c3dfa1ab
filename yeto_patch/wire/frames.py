"""Frame header and wire errors.

Every frame on the wire is a fixed 28-byte little-endian header followed by ``length`` payload bytes:

    struct "<4sHHIQQ": magic b"YETO", version u16, message type u16, flags u32, payload length u64,
                       xxh3_64 digest of the payload u64

The per-type maximum payload length is checked by :func:`decode_header`, i.e. before a receiver allocates
anything for the payload.
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import xxhash

MAGIC = b"YETO"
VERSION = 1
HEADER = struct.Struct("<4sHHIQQ")
HEADER_SIZE = HEADER.size  # 28

__all__ = [
    "MAGIC", "VERSION", "HEADER", "HEADER_SIZE", "MsgType", "MAX_PAYLOAD", "Header",
    "ProtocolError", "FrameError", "DigestError", "FrameAuthError", "AuthError", "CodecError", "PeerError",
    "WireTimeout", "BrokenHere", "UnverifiedHandshake", "UnverifiedRefusal", "RunMismatch",
    "encode_header", "decode_header", "digest", "type_name",
]


class ProtocolError(Exception):
    """Base class of every error raised by the wire layer."""


class FrameError(ProtocolError):
    """Malformed header, envelope or message (bad magic/version/type, oversized, truncated, bad meta)."""


class DigestError(FrameError):
    """The xxh3_64 digest of a payload does not match its header."""


class FrameAuthError(FrameError):
    """A frame after the handshake failed authentication (altered, injected, replayed, reordered or dropped),
    or arrived unprotected where protection was agreed. The link cannot be trusted; reconnecting may help."""


class AuthError(ProtocolError):
    """Handshake refused: wrong key, altered or replayed handshake, unusable key file, keyless non-loopback."""


class CodecError(ProtocolError):
    """Codec misuse or bad encoded data (non-finite input, bad length, bad scales). ``code`` says which kind:
    ``"nonfinite"`` (a NaN/Inf value, an invalid scale, a non-finite weight) or ``"bad-data"`` (anything else)."""

    def __init__(self, message: str, code: str = "bad-data"):
        super().__init__(message)
        self.code = code


class PeerError(ProtocolError):
    """The peer sent an ERROR message (``sealed``: in a frame that passed frame authentication)."""

    def __init__(self, code: str, message: str, sealed: bool = False):
        super().__init__(f"peer error [{code}]: {message}")
        self.code = code
        self.message = message
        self.sealed = sealed


_UNVERIFIED = ("nothing authenticated it: a wrong key on either side, or a handshake altered on the way; "
               "trying again")


class UnverifiedHandshake(AuthError):
    """An island's handshake failed before anything from the syncer was authenticated (a CHALLENGE it cannot
    answer, a first protected frame that does not verify). A wrong key and an on-path tamper look the same, so it
    is transient: the island tries again until its timeout (``transient``)."""

    transient = True

    def __init__(self, message: str):
        super().__init__(f"{message} ({_UNVERIFIED})")


class UnverifiedRefusal(PeerError):
    """A refusal (ERROR) that came in the clear, before the syncer's keys were verified: anyone on the path could
    have written it, so it is transient (``transient``); only a refusal in a protected frame is final."""

    transient = True

    def __init__(self, code: str, message: str):
        super().__init__(code, f"{message} ({_UNVERIFIED})")


class RunMismatch(ProtocolError):
    """The syncer (authenticated) belongs to another run than the one this island joined. Transient for the
    island's dialing (another syncer may answer at that address, or the connection was redirected), named when
    it gives up."""

    transient = True


class WireTimeout(ProtocolError, TimeoutError):
    """A socket operation did not complete in time."""


class BrokenHere(ProtocolError):
    """A receive found the connection broken by another thread of this side (a send that stalled or failed
    shut the socket down); the message is that thread's cause, not something the peer did."""


class MsgType(enum.IntEnum):
    CHUNK = 1
    ERROR = 2
    CHALLENGE = 10
    HELLO = 11
    WELCOME = 12
    MANIFEST = 13   # island -> syncer, after HELLO_OK: the parameter manifest (and 'held'), protected with a key
    HELLO_OK = 14   # syncer -> island: the HELLO passed its checks (MAC); send the MANIFEST
    INIT = 20
    BASE = 21
    PUSH = 22
    PUSH_REPLY = 23
    HEARTBEAT = 24
    FINAL = 25
    FINAL_BASE = 26
    ACK = 27
    BYE = 28
    PROBE = 29


_KIB, _MIB = 1 << 10, 1 << 20
_TENSOR_MAX = 1 << 40
#: Largest payload accepted per message type. For CHUNK this bounds one chunk frame (envelope + data); the
#: reassembled message is bounded by its inner type's entry.
MAX_PAYLOAD: dict[MsgType, int] = {
    MsgType.CHUNK: 64 * _MIB,
    MsgType.ERROR: 64 * _KIB,
    MsgType.CHALLENGE: 64 * _KIB,
    # HELLO and PROBE are small (ids, nonce, digests, MAC): a stranger cannot make the syncer read and parse
    # more than 64 KiB before it checked the MAC; the manifest (a 120B MoE's is ~13 MiB) follows in MANIFEST
    MsgType.HELLO: 64 * _KIB,
    MsgType.MANIFEST: 16 * _MIB,
    MsgType.HELLO_OK: 64 * _KIB,
    MsgType.WELCOME: 16 * _MIB,
    MsgType.INIT: _TENSOR_MAX,
    MsgType.BASE: _TENSOR_MAX,
    MsgType.PUSH: _TENSOR_MAX,
    MsgType.PUSH_REPLY: 1 * _MIB,
    MsgType.HEARTBEAT: 64 * _KIB,
    MsgType.FINAL: _TENSOR_MAX,
    MsgType.FINAL_BASE: _TENSOR_MAX,
    MsgType.ACK: 1 * _MIB,
    MsgType.BYE: 64 * _KIB,
    MsgType.PROBE: 64 * _KIB,
}


class Header(NamedTuple):
    msg_type: MsgType
    flags: int
    length: int
    digest: int


def type_name(t: int) -> str:
    try:
        return MsgType(t).name
    except ValueError:
        return f"type {t}"


def digest(*buffers) -> int:
    """xxh3_64 (seed 0) of the concatenation of ``buffers`` (no copy is made)."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


def encode_header(msg_type: int, payload_len: int, digest: int, flags: int = 0) -> bytes:
    try:
        t = MsgType(msg_type)
    except ValueError:
        raise FrameError(f"cannot send unknown message type {msg_type}") from None
    if not 0 <= payload_len <= MAX_PAYLOAD[t]:
        raise FrameError(f"{t.name} payload of {payload_len} bytes exceeds the maximum {MAX_PAYLOAD[t]}")
    if not 0 <= flags < 1 << 32:
        raise FrameError(f"flags {flags} out of range")
    return HEADER.pack(MAGIC, VERSION, t, flags, payload_len, digest & 0xFFFFFFFFFFFFFFFF)


def decode_header(buf) -> Header:
    """Parse and validate one header (magic, version, known type, length within the type's maximum)."""
    if len(buf) != HEADER_SIZE:
        raise FrameError(f"truncated frame header: {len(buf)} of {HEADER_SIZE} bytes")
    magic, version, t, flags, length, dig = HEADER.unpack(buf)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a yeto-patch peer")
    if version != VERSION:
        raise FrameError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    try:
        mt = MsgType(t)
    except ValueError:
        raise FrameError(f"unknown message type {t}") from None
    if length > MAX_PAYLOAD[mt]:
        raise FrameError(f"{mt.name} frame announces {length} bytes, above the maximum {MAX_PAYLOAD[mt]}")
    return Header(mt, flags, length, dig)
