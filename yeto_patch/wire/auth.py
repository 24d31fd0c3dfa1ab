"""Authentication: shared key, challenge-response HMAC-SHA256, manifest digest, keyless policy.

Handshake (see docs/protocol.md, "Authentication"): the server sends CHALLENGE with a fresh 32-byte server
nonce; the client answers HELLO with its own fresh nonce and ``client_mac``; the server verifies it and
answers WELCOME with ``server_mac``, which the client verifies. Both MACs cover both nonces, the protocol
version, the island id, the incarnation and the manifest digest, under different labels, so a recorded
handshake cannot be replayed (the server nonce is new on every connection) nor reflected.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import struct
from typing import Iterable, Optional

from .frames import VERSION, AuthError

NONCE_SIZE = 32
DIGEST_SIZE = 32
MIN_KEY_BYTES = 16
CLIENT_LABEL = b"yeto-patch client v1\0"
SERVER_LABEL = b"yeto-patch server v1\0"

__all__ = ["NONCE_SIZE", "load_key", "load_island_keys", "manifest_digest", "new_nonce", "client_mac", "server_mac",
           "verify", "check_insecure", "is_loopback", "mac_message"]


def load_key(path: Optional[str] = None, env: str = "YETO_KEY") -> Optional[bytes]:
    """The shared key: the contents of ``path`` (surrounding whitespace stripped) if given, else the value of
    the environment variable ``env``; None when neither is set.

    The key file must be a regular file that is not readable or writable by group or others (chmod 600)."""
    if path:
        try:
            st = os.stat(path)
        except OSError as e:
            raise AuthError(f"cannot read key file {path}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"key file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise AuthError(f"key file {path} is accessible by group/others (mode {stat.S_IMODE(st.st_mode):04o}); "
                            f"run: chmod 600 {path}")
        try:
            with open(path, "rb") as f:
                key = f.read(1 << 20).strip()
        except OSError as e:
            raise AuthError(f"cannot read key file {path}: {e.strerror}") from None
        source = f"key file {path}"
    else:
        val = os.environ.get(env)
        if val is None or val.strip() == "":
            return None
        key = val.strip().encode("utf-8")
        source = f"environment variable {env}"
    if len(key) < MIN_KEY_BYTES:
        raise AuthError(f"{source} holds a key of {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                        "(e.g. the output of: python -c 'import secrets; print(secrets.token_hex(32))')")
    return key


def load_island_keys(directory: str) -> dict:
    """Per-island keys: every ``<island id>.key`` file in ``directory`` (each checked like :func:`load_key`:
    chmod 600, at least 16 bytes) -> {island id: key}. The id must be a valid island id."""
    from .text import check_island_id
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise AuthError(f"cannot read the island key directory {directory}: {e.strerror}") from None
    keys = {}
    for name in names:
        if not name.endswith(".key") or name.startswith("."):
            continue
        island = name[:-4]
        try:
            check_island_id(island)
        except ValueError as e:
            raise AuthError(f"island key file {name} in {directory}: {e}") from None
        keys[island] = load_key(os.path.join(directory, name))
    if not keys:
        raise AuthError(f"the island key directory {directory} holds no <island id>.key file")
    return keys


def manifest_digest(manifest: Iterable[tuple[str, tuple[int, ...], str]]) -> bytes:
    """SHA-256 over the canonical encoding of (name, shape, dtype) entries, in order.

    Encoding: u32 entry count, then per entry: u32 len + UTF-8 name, u32 ndim, ndim x u64 dims,
    u32 len + UTF-8 dtype string (all little-endian)."""
    entries = list(manifest)
    h = hashlib.sha256()
    h.update(b"yeto-manifest v1\0")
    h.update(struct.pack("<I", len(entries)))
    for i, e in enumerate(entries):
        try:
            name, shape, dtype = e
            nb, db = str(name).encode("utf-8"), str(dtype).encode("utf-8")
            dims = [int(d) for d in shape]
        except (TypeError, ValueError):
            raise AuthError(f"manifest entry {i} is not (name, shape, dtype): {e!r}") from None
        if any(d < 0 for d in dims):
            raise AuthError(f"manifest entry {i} ({name}) has a negative dimension {tuple(dims)}")
        h.update(struct.pack("<I", len(nb)) + nb + struct.pack("<I", len(dims)))
        h.update(struct.pack(f"<{len(dims)}Q", *dims))
        h.update(struct.pack("<I", len(db)) + db)
    return h.digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def mac_message(label: bytes, server_nonce: bytes, client_nonce: bytes, island_id: str, incarnation: int,
                manifest_digest: bytes) -> bytes:
    """The exact bytes that are MACed (documented in docs/protocol.md)."""
    for what, v, n in (("server nonce", server_nonce, NONCE_SIZE), ("client nonce", client_nonce, NONCE_SIZE),
                       ("manifest digest", manifest_digest, DIGEST_SIZE)):
        if not isinstance(v, (bytes, bytearray)) or len(v) != n:
            raise AuthError(f"{what} must be {n} bytes")
    if not isinstance(incarnation, int) or not 0 <= incarnation < 1 << 64:
        raise AuthError(f"incarnation must be an integer in [0, 2**64), got {incarnation!r}")
    try:
        iid = str(island_id).encode("utf-8")
    except UnicodeEncodeError:
        raise AuthError("island id is not encodable as UTF-8 (an unpaired surrogate?)") from None
    return b"".join([label, struct.pack("<H", VERSION), bytes(server_nonce), bytes(client_nonce),
                     struct.pack("<I", len(iid)), iid, struct.pack("<Q", incarnation), bytes(manifest_digest)])


def _mac(key: Optional[bytes], msg: bytes) -> bytes:
    return hmac.new(key or b"", msg, hashlib.sha256).digest()


def client_mac(key, server_nonce, client_nonce, island_id, incarnation, manifest_digest) -> bytes:
    return _mac(key, mac_message(CLIENT_LABEL, server_nonce, client_nonce, island_id, incarnation, manifest_digest))


def server_mac(key, server_nonce, client_nonce, island_id, incarnation, manifest_digest) -> bytes:
    return _mac(key, mac_message(SERVER_LABEL, server_nonce, client_nonce, island_id, incarnation, manifest_digest))


def verify(expected: bytes, got, what: str = "handshake") -> None:
    """Constant-time comparison; raises AuthError on mismatch."""
    if not isinstance(got, (bytes, bytearray)) or not hmac.compare_digest(expected, bytes(got)):
        raise AuthError(f"{what} refused: authentication code mismatch (wrong key, or an altered or "
                        "replayed handshake)")


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost, with or without ":port" ("[::1]:port" for IPv6)."""
    address = address.strip()
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        pass
    host = address.rsplit(":", 1)[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_insecure(address: str, insecure: bool) -> None:
    """Called when no key is configured: allowed only with explicit ``insecure`` AND a loopback address."""
    if not insecure:
        raise AuthError(f"no key configured for {address}: set YETO_KEY or a key file (chmod 600); running "
                        "without a key needs the explicit insecure option and a loopback address")
    if not is_loopback(address):
        raise AuthError(f"refusing to run without a key on non-loopback address {address}: insecure mode is "
                        "only allowed on 127.0.0.1/::1/localhost")
