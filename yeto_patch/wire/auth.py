"""Authentication: the shared and per-island keys, nonces, the manifest digest, the keyless policy.

The handshake itself (ephemeral key exchange, the HELLO's MAC, session keys, resumption) is in :mod:`.secure`
(derivations) and :mod:`.handshake` (the island's side); see docs/protocol.md, "Authentication".
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

from .frames import AuthError

NONCE_SIZE = 32
DIGEST_SIZE = 32
MIN_KEY_BYTES = 16

__all__ = ["NONCE_SIZE", "load_key", "load_island_keys", "manifest_digest", "new_nonce", "verify", "check_insecure",
           "is_loopback"]


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
