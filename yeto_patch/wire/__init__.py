"""Wire layer: frames, chunks, codecs, digests, authentication, transport, background sender.

Bytes only: stdlib, numpy, xxhash and cryptography (frame protection). No torch, no Megatron, nothing else
of ours, no pickle.
"""
from .frames import (MAGIC, VERSION, MAX_PAYLOAD, AuthError, CodecError, DigestError, FrameError, MsgType,
                     PeerError, ProtocolError, WireTimeout, decode_header, encode_header)
from .chunks import DEFAULT_CHUNK, Reassembler
from .codecs import CODECS, DEFAULT_BLOCK, decode, decode_accumulate, encode, encoded_nbytes, residual
from .transport import ConnectError, Connection, connect, listen, parse_address
from .sender import BackgroundSender

__all__ = [
    "MAGIC", "VERSION", "MAX_PAYLOAD", "MsgType", "ProtocolError", "FrameError", "DigestError", "AuthError",
    "CodecError", "PeerError", "WireTimeout", "ConnectError", "encode_header", "decode_header", "DEFAULT_CHUNK",
    "Reassembler", "CODECS", "DEFAULT_BLOCK", "encode", "decode", "decode_accumulate", "encoded_nbytes",
    "residual", "Connection", "connect", "listen", "parse_address", "BackgroundSender",
]
