"""Wire layer: frames, chunks, codecs, digests, authentication, transport, background sender.

Bytes only: stdlib, numpy, xxhash and cryptography (frame protection). No torch, no Megatron, nothing else
of ours, no pickle.

The names below load on first use (PEP 562), so that importing one light module of this package
(``yeto_patch.wire.codec_names``, which ``yeto_patch.config`` uses) does not import numpy and the transport.
"""
from __future__ import annotations

import importlib

_FROM = {
    "frames": ("MAGIC", "VERSION", "MAX_PAYLOAD", "AuthError", "CodecError", "DigestError", "FrameError", "MsgType",
               "PeerError", "ProtocolError", "WireTimeout", "decode_header", "encode_header"),
    "chunks": ("DEFAULT_CHUNK", "Reassembler"),
    "codecs": ("CODECS", "DEFAULT_BLOCK", "decode", "decode_accumulate", "encode", "encoded_nbytes", "residual"),
    "transport": ("ConnectError", "Connection", "connect", "listen", "parse_address"),
    "sender": ("BackgroundSender",),
}
_WHERE = {name: mod for mod, names in _FROM.items() for name in names}

__all__ = [
    "MAGIC", "VERSION", "MAX_PAYLOAD", "MsgType", "ProtocolError", "FrameError", "DigestError", "AuthError",
    "CodecError", "PeerError", "WireTimeout", "ConnectError", "encode_header", "decode_header", "DEFAULT_CHUNK",
    "Reassembler", "CODECS", "DEFAULT_BLOCK", "encode", "decode", "decode_accumulate", "encoded_nbytes",
    "residual", "Connection", "connect", "listen", "parse_address", "BackgroundSender",
]


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
