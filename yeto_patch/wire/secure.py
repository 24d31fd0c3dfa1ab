"""Session keys and frame protection.

Session keys (handshake protocol 3, docs/protocol.md "Authentication"): both sides contribute a fresh X25519
ephemeral key (``cryptography``) to every handshake; ``dh = X25519(own ephemeral, peer's ephemeral)``, and every
session secret is HKDF-SHA256 (RFC 5869) with ``dh`` as input keying material and the shared (or per-island) key as
salt, so it needs BOTH the key and one side's ephemeral private key: a recording of the handshake plus the key
yields nothing (forward secrecy), and the resumption secret of one island's session is known to that island and
the syncer only. ``info`` binds each secret to its use and to the transcript (the SHA-256 of the canonical JSON of
the CHALLENGE and of the HELLO without its ``mac``), so a relay that altered any handshake field leaves the two
sides with different keys. The pattern is Noise's NNpsk2 (ephemeral-ephemeral DH, a pre-shared key mixed in;
the syncer sends the first ephemeral) written out with ``cryptography``'s X25519, HKDF and HMAC (not the Noise
framework's own key schedule: the derivations below are the whole of it).

Frame keys: ``HKDF(dh, salt=key, info=b"yeto-patch frames v3\\0" | mode | b"\\0" | transcript)``, 64 bytes: the
first 32 protect island -> syncer frames, the last 32 syncer -> island frames.

Per frame (flags bit 0 ``FLAG_AUTH``, bit 1 ``FLAG_ENC``; the header's digest field is 0, its length counts the
payload without the tag), with ``nonce = u32 0 | u64 seq`` (``seq`` counts the frames of that direction from
0, never sent):

- ``mac`` (integrity): tag = GMAC: AES-256-GCM with no plaintext and associated data ``header | payload``;
- ``aead`` (confidentiality too): AES-256-GCM, associated data ``header`` (and for CHUNK frames the 28-byte
  envelope, which stays readable), the rest of the payload encrypted in place of the plaintext;

the 16-byte tag follows the payload. A frame that was altered, injected, replayed, reordered or dropped makes
the receiver's sequence number or data differ, so its tag does not verify: the connection fails.

Streaming (the wire bytes are the same as sealing a frame at once): a frame larger than one piece
(:data:`PIECE` bytes) is sealed piece by piece in one GCM context and each piece is written as soon as it is
sealed, so the peer copies piece k out of the socket while piece k+1 is sealed; the receiver authenticates
(decrypts) each piece as it arrives, while it is in the cache, and checks the tag once the frame is complete. In
``aead`` mode the ciphertext passes through one reused scratch piece on each side (wire/scratch.py): no
allocation or copy per frame. Nothing of a frame is used before its tag verified: a receiver that gets
:class:`InvalidTag` from :meth:`OpenStream.finish` discards what it decrypted.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import scratch
from .scratch import PIECE

__all__ = ["FLAG_AUTH", "FLAG_ENC", "TAG_SIZE", "MODES", "EPHEMERAL_SIZE", "PIECE", "Ephemeral", "SessionKeys",
           "transcript", "hello_mac", "derive_keys", "derive_resumption", "resumption_proof", "Sealer", "Opener",
           "OpenStream", "InvalidTag"]

FLAG_AUTH = 1
FLAG_ENC = 2
TAG_SIZE = 16
MODES = ("mac", "aead")
EPHEMERAL_SIZE = 32
INFO = b"yeto-patch frames v3\0"
RESUME_INFO = b"yeto-patch resume v3\0"
PROOF_LABEL = b"yeto-patch resume proof v3\0"
HELLO_LABEL = b"yeto-patch hello v3\0"
_NONCE = struct.Struct("<IQ")


class Ephemeral:
    """One side's X25519 key pair for one handshake (never reused, never stored)."""

    def __init__(self):
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()

    def shared(self, peer_public: bytes) -> bytes:
        """``dh`` with the peer's public key (32 bytes); ValueError for a malformed or low-order key (an all-zero
        result, which cryptography/OpenSSL refuses)."""
        if not isinstance(peer_public, (bytes, bytearray)) or len(peer_public) != EPHEMERAL_SIZE:
            raise ValueError(f"an ephemeral key must be {EPHEMERAL_SIZE} bytes")
        return self._private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))


def _canon(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def transcript(challenge: dict, hello: dict) -> bytes:
    """SHA-256 over the canonical JSON (sorted keys, ASCII) of the CHALLENGE and of the HELLO without "mac"."""
    h = hashlib.sha256()
    h.update(_canon(challenge))
    h.update(b"\0")
    h.update(_canon({k: v for k, v in hello.items() if k != "mac"}))
    return h.digest()


def hello_mac(key: bytes, th: bytes) -> bytes:
    """The HELLO's (or PROBE's) ``mac``: HMAC-SHA256 under the key over a label and the transcript, so the syncer
    checks that the island holds the key, and that nothing of the handshake so far was altered or replayed, before
    it reads anything more than the HELLO."""
    return hmac.new(key, HELLO_LABEL + th, hashlib.sha256).digest()


def _hkdf(key: bytes, dh: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=bytes(key), info=info).derive(bytes(dh))


def derive_keys(key: bytes, dh: bytes, mode: str, th: bytes) -> tuple:
    """(island -> syncer key, syncer -> island key), 32 bytes each."""
    if mode not in MODES:
        raise ValueError(f"frame protection mode must be one of {MODES}, got {mode!r}")
    okm = _hkdf(key, dh, INFO + mode.encode() + b"\0" + th, 64)
    return okm[:32], okm[32:]


class SessionKeys:
    """What one authenticated handshake gives both sides: the frame keys of each direction and the session's
    resumption secret (never sent)."""

    def __init__(self, key: bytes, dh: bytes, mode: str, th: bytes):
        self.mode = mode
        self.c2s, self.s2c = derive_keys(key, dh, mode, th)
        self.resumption = derive_resumption(key, dh, th)

    @property
    def encrypt(self) -> bool:
        return self.mode == "aead"


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

    def stream(self, header: bytes, parts: list, write, clear: int = 0) -> None:
        """Seal one frame and write it with ``write(list of buffers)`` as it is sealed: the header and the
        ``clear`` leading parts with the first piece, then piece by piece (:data:`PIECE` bytes), then the tag,
        so the socket drains one piece while the next is sealed. Same bytes on the wire as ``[header] +
        seal(header, parts, clear)``. ``write`` must have handed every byte to the socket before it returns
        (``aead`` reuses one scratch piece)."""
        pieces = [q for p in parts[clear:] for q in _pieces(p)]
        if len(pieces) <= 1:   # one piece: nothing to overlap, one write
            out, tag = self.seal(header, parts, clear)
            write([header] + out + [tag])
            return
        enc = Cipher(self.alg, modes.GCM(self._nonce())).encryptor()
        self.seq += 1
        enc.authenticate_additional_data(header)
        out = [header]
        for p in parts[:clear]:
            enc.authenticate_additional_data(p)
            out.append(p)
        with scratch.piece() as buf:
            for q in pieces:
                if self.encrypt:
                    s = buf[:len(q)]
                    enc.update_into(q, s)
                    q = s
                else:
                    enc.authenticate_additional_data(q)
                write(out + [q])
                out = []
        enc.finalize()
        write([enc.tag])


def _pieces(p) -> list:
    p = memoryview(p).cast("B")
    return [p[o:o + PIECE] for o in range(0, len(p), PIECE)]


class Opener(_Dir):
    """One direction's receiving side; call :meth:`begin` under the connection's receive lock (frame order)."""

    def begin(self, header, clear=None) -> "OpenStream":
        """Start opening the next frame piece by piece (:class:`OpenStream`); its sequence number is taken now."""
        dec = Cipher(self.alg, modes.GCM(self._nonce())).decryptor()
        self.seq += 1
        dec.authenticate_additional_data(bytes(header))
        if clear is not None:
            dec.authenticate_additional_data(clear)
        return OpenStream(dec, self.encrypt)


class OpenStream:
    """One frame being opened as its payload arrives: :meth:`authenticate` (``mac``) or :meth:`decrypt_into`
    (``aead``) every piece in order, then :meth:`finish` with the tag (InvalidTag if the frame is not the one the
    peer sealed; whatever was decrypted must then be discarded unused)."""

    __slots__ = ("_dec", "encrypt")

    def __init__(self, dec, encrypt: bool):
        self._dec = dec
        self.encrypt = encrypt

    def authenticate(self, piece) -> None:
        if len(piece):
            self._dec.authenticate_additional_data(piece)

    def decrypt_into(self, cipher, plain) -> None:
        """Decrypt ``cipher`` into ``plain`` (same length, not overlapping)."""
        if self._dec.update_into(cipher, plain) != len(cipher):
            raise InvalidTag()

    def finish(self, tag) -> None:
        self._dec.finalize_with_tag(bytes(tag))


def derive_resumption(key: bytes, dh: bytes, th: bytes) -> bytes:
    """The session's resumption secret (32 bytes): both sides derive it from the handshake (it needs ``dh``, so no
    other key holder can), it never travels. A later HELLO of the same island proves the session with
    :func:`resumption_proof`."""
    return _hkdf(key, dh, RESUME_INFO + th, 32)


def resumption_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes, server_ephemeral: bytes,
                     client_ephemeral: bytes, island_id: str) -> bytes:
    """HMAC-SHA256 under the previous session's resumption secret over this handshake's nonces, ephemeral public
    keys and the island id."""
    iid = island_id.encode("utf-8")
    return hmac.new(secret, PROOF_LABEL + bytes(server_nonce) + bytes(client_nonce) + bytes(server_ephemeral)
                    + bytes(client_ephemeral) + struct.pack("<I", len(iid)) + iid, hashlib.sha256).digest()
