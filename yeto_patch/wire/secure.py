"""Frame protection after the handshake: every frame authenticated (and optionally encrypted) with AES-256-GCM
from ``cryptography``, keys derived from the handshake, one implicit sequence number per direction.

Keys: HKDF-SHA256 (RFC 5869) with the shared key as input keying material, ``server_nonce | client_nonce`` as
salt and ``b"yeto-patch frames v1\\0" | mode | b"\\0" | transcript`` as info, 64 bytes: the first 32 protect
island -> syncer frames, the last 32 syncer -> island frames. ``transcript`` is the SHA-256 of the canonical
JSON of the CHALLENGE and of the HELLO (without its ``mac``), so a relay that altered any handshake field
(the offered mode included) leaves the two sides with different keys and the first protected frame fails.

Per frame (flags bit 0 ``FLAG_AUTH``, bit 1 ``FLAG_ENC``; the header's digest field is 0, its length counts the
payload without the tag), with ``nonce = u32 0 | u64 seq`` (``seq`` counts the frames of that direction from
0, never sent):

- ``mac`` (integrity): tag = GMAC: AES-256-GCM with no plaintext and associated data ``header | payload``;
- ``aead`` (confidentiality too): AES-256-GCM, associated data ``header`` (and for CHUNK frames the 28-byte
  envelope, which stays readable), the rest of the payload encrypted in place of the plaintext;

the 16-byte tag follows the payload. A frame that was altered, injected, replayed, reordered or dropped makes
the receiver's sequence number or data differ, so its tag does not verify: the connection fails.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["FLAG_AUTH", "FLAG_ENC", "TAG_SIZE", "MODES", "transcript", "derive_keys", "Sealer", "Opener",
           "InvalidTag", "derive_resumption", "resumption_proof"]

FLAG_AUTH = 1
FLAG_ENC = 2
TAG_SIZE = 16
MODES = ("mac", "aead")
INFO = b"yeto-patch frames v1\0"
_NONCE = struct.Struct("<IQ")


def _canon(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def transcript(challenge: dict, hello: dict) -> bytes:
    """SHA-256 over the canonical JSON (sorted keys, ASCII) of the CHALLENGE and of the HELLO without "mac"."""
    h = hashlib.sha256()
    h.update(_canon(challenge))
    h.update(b"\0")
    h.update(_canon({k: v for k, v in hello.items() if k != "mac"}))
    return h.digest()


def derive_keys(key: bytes, server_nonce: bytes, client_nonce: bytes, mode: str, th: bytes) -> tuple:
    """(island -> syncer key, syncer -> island key), 32 bytes each."""
    if mode not in MODES:
        raise ValueError(f"frame protection mode must be one of {MODES}, got {mode!r}")
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=bytes(server_nonce) + bytes(client_nonce),
               info=INFO + mode.encode() + b"\0" + th).derive(key)
    return okm[:32], okm[32:]


class _Dir:
    def __init__(self, key: bytes, encrypt: bool):
        self.alg = algorithms.AES(key)
        self.encrypt = encrypt
        self.flags = FLAG_AUTH | (FLAG_ENC if encrypt else 0)
        self.seq = 0

    def _nonce(self) -> bytes:
        return _NONCE.pack(0, self.seq)


class Sealer(_Dir):
    """One direction's sending side; call :meth:`seal` under the connection's send lock (frame order)."""

    def seal(self, header: bytes, parts: list, clear: int = 0) -> tuple[list, bytes]:
        """(parts to send after the header, tag). ``clear``: leading parts that stay readable in ``aead`` mode
        (the CHUNK envelope)."""
        enc = Cipher(self.alg, modes.GCM(self._nonce())).encryptor()
        self.seq += 1
        enc.authenticate_additional_data(header)
        if not self.encrypt:
            for p in parts:
                enc.authenticate_additional_data(p)
            enc.finalize()
            return parts, enc.tag
        for p in parts[:clear]:
            enc.authenticate_additional_data(p)
        out = list(parts[:clear]) + [enc.update(p) for p in parts[clear:]]
        enc.finalize()
        return out, enc.tag


class Opener(_Dir):
    """One direction's receiving side; call :meth:`open` under the connection's receive lock."""

    def open(self, header, clear: Optional[memoryview], body: memoryview, tag: bytes) -> None:
        """Verify (and in ``aead`` mode decrypt ``body`` in place) one frame; InvalidTag if it is not the next
        frame the peer sealed."""
        dec = Cipher(self.alg, modes.GCM(self._nonce(), bytes(tag))).decryptor()
        self.seq += 1
        dec.authenticate_additional_data(bytes(header))
        if clear is not None:
            dec.authenticate_additional_data(clear)
        if not self.encrypt:
            if len(body):
                dec.authenticate_additional_data(body)
            dec.finalize()
            return
        plain = dec.update(body)
        dec.finalize()   # raises InvalidTag before anything is written
        body[:] = plain


RESUME_INFO = b"yeto-patch resume v1\0"
PROOF_LABEL = b"yeto-patch resume proof v1\0"


def derive_resumption(key: bytes, server_nonce: bytes, client_nonce: bytes, th: bytes) -> bytes:
    """The session's resumption secret (32 bytes): both sides derive it from the handshake, it never travels.
    A later HELLO of the same island proves the session with :func:`resumption_proof`."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=bytes(server_nonce) + bytes(client_nonce),
                info=RESUME_INFO + th).derive(key)


def resumption_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes, island_id: str) -> bytes:
    """HMAC-SHA256 under the previous session's resumption secret over this handshake's nonces and the id."""
    import hmac
    iid = island_id.encode("utf-8")
    return hmac.new(secret, PROOF_LABEL + bytes(server_nonce) + bytes(client_nonce) + struct.pack("<I", len(iid))
                    + iid, hashlib.sha256).digest()
