"""The island's side of the authenticated handshake (CHALLENGE -> HELLO -> HELLO_OK -> MANIFEST -> WELCOME;
CHALLENGE -> PROBE -> WELCOME), the resumption secrets of this process's sessions, and :func:`probe` (a
handshake without joining a run).  See :mod:`.client` and docs/protocol.md ("Handshake").
"""
from __future__ import annotations

import random
import threading
from typing import Optional

from . import auth, secure
from .frames import AuthError, FrameAuthError, MsgType, ProtocolError
from .text import printable
from .transport import Connection, connect

__all__ = ["probe"]


_RESUME: dict = {}   # (syncer address, island id) -> resumption secret of this process's last session
_RESUME_LOCK = threading.Lock()


PROTOCOL = 2   # handshake protocol: 2 = small HELLO, the manifest in its own MANIFEST frame after HELLO_OK


def _handshake(conn: Connection, key: Optional[bytes], insecure: bool, msg_type: MsgType, island_id: str,
               incarnation: int, digest: bytes, manifest: Optional[dict], timeout: float, resume_slot=None,
               first_timeout: Optional[float] = None) -> dict:
    """The island's handshake: CHALLENGE, HELLO (or PROBE), [HELLO_OK, MANIFEST,] WELCOME. ``manifest``: the
    MANIFEST meta (``manifest``, optional ``held``) of a HELLO, None for a PROBE; it goes out only once the
    syncer accepted the HELLO (so a stranger never makes the syncer read it, and a refusal arrives before it).
    ``resume_slot`` (address, island id): prove the previous session of this id in this process (its
    resumption secret), so a reconnect may take over a connection the syncer still holds."""
    t, challenge, _ = conn.recv(timeout=timeout if first_timeout is None else first_timeout)
    if t != MsgType.CHALLENGE:
        raise ProtocolError(f"expected CHALLENGE from the syncer, got {t.name}")
    server_nonce, mode = _check_challenge(challenge, key)
    nonce = auth.new_nonce()
    mac = auth.client_mac(key, server_nonce, nonce, island_id, incarnation, digest).hex() if key else ""
    hello = {"island_id": island_id, "incarnation": incarnation, "nonce": nonce.hex(), "protocol": PROTOCOL,
             "manifest_digest": digest.hex(), "mac": mac, "insecure": key is None}
    with _RESUME_LOCK:
        previous = _RESUME.get(resume_slot) if key is not None and resume_slot is not None else None
    if previous is not None:
        hello["resume"] = secure.resumption_proof(previous, server_nonce, nonce, island_id).hex()
    conn.send(msg_type, hello)
    if key is not None:   # every later frame is authenticated (and in "aead" mode encrypted) both ways
        c2s, s2c = secure.derive_keys(key, server_nonce, nonce, mode, secure.transcript(challenge, hello))
        conn.protect(c2s, s2c, mode == "aead", clear_error_first=True)
    if msg_type == MsgType.HELLO:
        _expect(conn, MsgType.HELLO_OK, timeout)
        conn.send(MsgType.MANIFEST, manifest or {})
    meta = _expect(conn, MsgType.WELCOME, timeout)
    if key is not None:
        want = auth.server_mac(key, server_nonce, nonce, island_id, incarnation, digest)
        try:
            got = bytes.fromhex(meta.get("server_mac", ""))
        except ValueError:
            got = b""
        auth.verify(want, got, what="the syncer's WELCOME")
        if resume_slot is not None and msg_type == MsgType.HELLO:
            th = secure.transcript(challenge, hello)
            with _RESUME_LOCK:
                _RESUME[resume_slot] = secure.derive_resumption(key, server_nonce, nonce, th)
    return meta


def _check_challenge(challenge: dict, key: Optional[bytes]) -> tuple:
    """(server nonce, frame protection mode) of a CHALLENGE this island can answer; raises otherwise."""
    try:
        server_nonce = bytes.fromhex(challenge["nonce"])
    except (KeyError, ValueError, TypeError):
        raise ProtocolError("malformed CHALLENGE from the syncer") from None
    if challenge.get("protocol") != PROTOCOL:
        raise ProtocolError(f"the syncer speaks handshake protocol {printable(challenge.get('protocol'), 20)}, this "
                            f"island speaks {PROTOCOL} (the manifest travels in its own MANIFEST frame): run the "
                            "same yeto-patch version on the syncer and the islands")
    if challenge.get("auth") and key is None:
        raise AuthError("the syncer requires a key and this island has none (set YETO_KEY or a key file)")
    if not challenge.get("auth") and key is not None:
        raise AuthError("the syncer runs without a key (insecure) but this island has one; refusing to talk "
                        "to an unauthenticated syncer")
    mode = challenge.get("frames")
    if key is not None and mode not in secure.MODES:
        raise AuthError(f"the syncer offers frame protection {printable(mode, 40)!r}, not one of {secure.MODES}: "
                        "refusing a link whose frames are not authenticated")
    return server_nonce, mode


def _expect(conn: Connection, want: MsgType, timeout: float) -> dict:
    """The meta of the syncer's next message, which must be ``want`` (its ERROR is raised as PeerError)."""
    try:
        t, meta, _ = conn.recv(timeout=timeout)
    except FrameAuthError as e:   # the first protected frame: the keys differ (wrong key, tampered handshake)
        raise AuthError(f"the syncer's {want.name} failed authentication (wrong key, or a handshake altered on the "
                        f"way): {e}") from None
    if t != want:
        raise ProtocolError(f"expected {want.name} from the syncer, got {t.name}")
    return meta


def probe(address: str, key: Optional[bytes], *, timeout: float = 10.0, insecure: bool = False,
          island_id: str = "doctor") -> dict:
    """Authenticated handshake with the syncer without joining its run; returns its status."""
    if key is None:
        auth.check_insecure(address, insecure)
    conn = connect(address, timeout=timeout, retries=0)
    try:
        meta = _handshake(conn, key, insecure, MsgType.PROBE, island_id, random.getrandbits(63), bytes(32), None,
                          timeout)
    finally:
        conn.close()
    meta.pop("server_mac", None)
    return meta
