"""The island's side of the authenticated handshake (protocol 3), the resumption secrets of this process's
sessions, and :func:`probe` (a handshake without joining a run).  See :mod:`.client` and docs/protocol.md
("Handshake", "Authentication").

CHALLENGE (the syncer's nonce, ephemeral X25519 key and frame protection) -> HELLO (the island's id, incarnation,
nonce, ephemeral key, manifest digest, optional resumption proof, and a MAC under the key over the transcript) ->
HELLO_OK (the syncer's first protected frame, under session keys that need the key AND an ephemeral private key:
it proves the syncer; it names the run) -> MANIFEST -> WELCOME. A PROBE takes the place of the HELLO and is
answered by a protected WELCOME.

What is final: until the syncer's first protected frame verified, nothing the island received is authenticated.
A clear ERROR (:class:`~.frames.UnverifiedRefusal`), a CHALLENGE this island cannot answer, or a first protected
frame that does not verify (:class:`~.frames.UnverifiedHandshake`) look the same whether the key is wrong or a
relay tampered, so they are transient: the island's link tries again until its timeout. Once verified, the
syncer's refusals come protected and are final (:func:`.values.recoverable` names the exceptions), and a syncer of
another run than the one the island joined is refused (:class:`~.frames.RunMismatch`).
"""
from __future__ import annotations

import secrets
import threading
from typing import Optional

from . import auth, secure
from .frames import (MAX_PAYLOAD, AuthError, FrameAuthError, MsgType, PeerError, ProtocolError, RunMismatch,
                     UnverifiedHandshake, UnverifiedRefusal)
from .text import printable
from .transport import Connection, connect

__all__ = ["IslandHello", "probe", "PROTOCOL", "UNVERIFIED_MAX"]

#: What the island reads from a syncer that has not proved its key yet: a CHALLENGE, a clear ERROR, the HELLO_OK
#: (all small); anything announcing more is refused from its header or first chunk, so a rogue syncer (or a relay)
#: cannot make the island reserve memory for a message it never authenticated. Raised for the WELCOME once the
#: HELLO_OK verified, and for bases once the WELCOME gave the layout (client.py).
UNVERIFIED_MAX = {t: 64 << 10 for t in MsgType if t != MsgType.CHUNK}


_RESUME: dict = {}   # (syncer address, island id) -> resumption secret of this process's last session
_RESUME_LOCK = threading.Lock()


PROTOCOL = 3   # handshake protocol: 3 = ephemeral X25519 session keys, the run named in HELLO_OK (2: keys from the
#                shared key and the nonces alone; 1: the manifest inside the HELLO)


class IslandHello:
    """The island's half of one handshake answering ``challenge``: its ephemeral key, its HELLO (or PROBE) meta
    (``meta``, MAC included) and the session keys both sides derive. ``resume``: the previous session's
    resumption secret (its proof goes into the HELLO). ``fields``: HELLO fields to add or override before the MAC
    is made (for tests and fuzzers building hostile HELLOs)."""

    def __init__(self, challenge: dict, key: Optional[bytes], island_id: str, incarnation: int, digest: bytes, *,
                 resume: Optional[bytes] = None, **fields):
        self.challenge, self.key = challenge, key
        self.server_nonce, self.mode, self.server_ephemeral = _check_challenge(challenge, key)
        self.nonce = auth.new_nonce()
        self._ephemeral = secure.Ephemeral() if key is not None else None
        own = self._ephemeral.public if self._ephemeral is not None else b""
        meta = {"island_id": island_id, "incarnation": incarnation, "nonce": self.nonce.hex(), "protocol": PROTOCOL,
                "manifest_digest": digest.hex(), "ephemeral": own.hex(), "insecure": key is None}
        if resume is not None and key is not None:
            meta["resume"] = secure.resumption_proof(resume, self.server_nonce, self.nonce, self.server_ephemeral,
                                                     own, island_id).hex()
        meta.update(fields)
        self.meta = self.sign(meta)

    def sign(self, meta: dict) -> dict:
        """``meta`` with its ``mac`` (HMAC under the key over the transcript; empty without a key)."""
        meta = {k: v for k, v in meta.items() if k != "mac"}
        th = secure.transcript(self.challenge, meta)
        meta["mac"] = secure.hello_mac(self.key, th).hex() if self.key is not None else ""
        return meta

    def session(self) -> Optional[secure.SessionKeys]:
        """The session keys (None without a key): frame keys both ways and the resumption secret."""
        if self.key is None:
            return None
        dh = self._ephemeral.shared(self.server_ephemeral)
        return secure.SessionKeys(self.key, dh, self.mode, secure.transcript(self.challenge, self.meta))


def _handshake(conn: Connection, key: Optional[bytes], insecure: bool, msg_type: MsgType, island_id: str,
               incarnation: int, digest: bytes, manifest: Optional[dict], timeout: float, resume_slot=None,
               first_timeout: Optional[float] = None, run_id: Optional[str] = None) -> dict:
    """The island's handshake; returns the WELCOME meta (with ``run_id``). ``manifest``: the MANIFEST meta
    (``manifest``, optional ``held``) of a HELLO, None for a PROBE; it goes out only once the syncer accepted
    the HELLO (so a stranger never makes the syncer read it, and a refusal arrives before it). ``resume_slot``
    (address, island id): prove the previous session of this id in this process, so a reconnect may take over a
    connection the syncer still holds. ``run_id``: the run this island belongs to (None on its first join): a
    syncer of another run is refused."""
    try:
        hello, sess = _say_hello(conn, key, msg_type, island_id, incarnation, digest, timeout, resume_slot,
                                 first_timeout)
        first = _expect(conn, MsgType.HELLO_OK if msg_type == MsgType.HELLO else MsgType.WELCOME, timeout,
                        first=sess is not None)
    except PeerError as e:
        if key is not None and not e.sealed and not isinstance(e, UnverifiedRefusal):
            raise UnverifiedRefusal(e.code, e.message) from None
        raise
    except AuthError as e:
        if key is not None and not isinstance(e, UnverifiedHandshake):
            raise UnverifiedHandshake(str(e)) from None
        raise
    # from here on everything from the syncer is authenticated (with a key): its WELCOME may be large
    conn.set_limits({MsgType.WELCOME: MAX_PAYLOAD[MsgType.WELCOME]}, MAX_PAYLOAD[MsgType.WELCOME])
    run = first.get("run_id")
    if run_id is not None and run != run_id:
        raise RunMismatch(f"the syncer at {conn.peer} belongs to run {printable(run, 140)!r}, not to run "
                          f"{printable(run_id, 140)!r} that this island joined (another syncer answers at that "
                          f"address, or the connection was redirected): refusing it")
    if msg_type == MsgType.HELLO:
        conn.send(MsgType.MANIFEST, manifest or {})
        meta = _expect(conn, MsgType.WELCOME, timeout)
        if sess is not None and resume_slot is not None:
            with _RESUME_LOCK:
                _RESUME[resume_slot] = sess.resumption
    else:
        meta = first
    meta["run_id"] = run
    return meta


def _say_hello(conn, key, msg_type, island_id, incarnation, digest, timeout, resume_slot, first_timeout) -> tuple:
    """Receive the CHALLENGE, send the HELLO (or PROBE) and turn frame protection on: (IslandHello, SessionKeys
    or None)."""
    t, challenge, _ = conn.recv(timeout=timeout if first_timeout is None else first_timeout)
    if t != MsgType.CHALLENGE:
        raise ProtocolError(f"expected CHALLENGE from the syncer, got {t.name}")
    with _RESUME_LOCK:
        previous = _RESUME.get(resume_slot) if key is not None and resume_slot is not None else None
    hello = IslandHello(challenge, key, island_id, incarnation, digest, resume=previous)
    conn.send(msg_type, hello.meta)
    sess = hello.session()
    if sess is not None:   # every later frame is authenticated (and in "aead" mode encrypted) both ways
        conn.protect(sess.c2s, sess.s2c, sess.encrypt, clear_error_first=True)
    return hello, sess


def _check_challenge(challenge: dict, key: Optional[bytes]) -> tuple:
    """(server nonce, frame protection mode, server ephemeral key) of a CHALLENGE this island can answer; raises
    otherwise."""
    try:
        server_nonce = bytes.fromhex(challenge["nonce"])
        server_ephemeral = bytes.fromhex(challenge.get("ephemeral") or "")
    except (KeyError, ValueError, TypeError, AttributeError):
        raise ProtocolError("malformed CHALLENGE from the syncer") from None
    if challenge.get("protocol") != PROTOCOL:
        raise ProtocolError(f"the syncer speaks handshake protocol {printable(challenge.get('protocol'), 20)}, this "
                            f"island speaks {PROTOCOL} (ephemeral session keys): run the same yeto-patch version on "
                            "the syncer and the islands")
    if len(server_nonce) != auth.NONCE_SIZE:
        raise ProtocolError("malformed CHALLENGE from the syncer (its nonce is not 32 bytes)")
    if challenge.get("auth") and key is None:
        raise AuthError("the syncer requires a key and this island has none (set YETO_KEY or a key file)")
    if not challenge.get("auth") and key is not None:
        raise AuthError("the syncer runs without a key (insecure) but this island has one; refusing to talk "
                        "to an unauthenticated syncer")
    mode = challenge.get("frames")
    if key is not None and mode not in secure.MODES:
        raise AuthError(f"the syncer offers frame protection {printable(mode, 40)!r}, not one of {secure.MODES}: "
                        "refusing a link whose frames are not authenticated")
    if key is not None and len(server_ephemeral) != secure.EPHEMERAL_SIZE:
        raise AuthError("the syncer's CHALLENGE carries no ephemeral key of 32 bytes")
    return server_nonce, mode, server_ephemeral


def _expect(conn: Connection, want: MsgType, timeout: float, first: bool = False) -> dict:
    """The meta of the syncer's next message, which must be ``want`` (its ERROR is raised as PeerError).
    ``first``: the syncer's first protected frame, whose failure means the two sides' keys differ (a later one
    failing is a frame altered on the path: FrameAuthError, a lost link)."""
    try:
        t, meta, _ = conn.recv(timeout=timeout)
    except FrameAuthError as e:
        if not first:
            raise
        raise AuthError(f"the syncer's {want.name} failed authentication: {e}") from None
    if t != want:
        raise ProtocolError(f"expected {want.name} from the syncer, got {t.name}")
    return meta


def probe(address: str, key: Optional[bytes], *, timeout: float = 10.0, insecure: bool = False,
          island_id: str = "doctor") -> dict:
    """Authenticated handshake with the syncer without joining its run; returns its status."""
    if key is None:
        auth.check_insecure(address, insecure)
    conn = connect(address, timeout=timeout, retries=0, max_payload=UNVERIFIED_MAX,
                   max_reassembly_bytes=UNVERIFIED_MAX[MsgType.HELLO_OK])
    try:
        return _handshake(conn, key, insecure, MsgType.PROBE, island_id, secrets.randbits(63), bytes(32), None,
                          timeout)
    finally:
        conn.close()
