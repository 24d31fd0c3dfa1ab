"""The syncer's side of the handshake (protocol 3): CHALLENGE (with the syncer's ephemeral X25519 key), HELLO (or
PROBE) checked (its MAC under the key over the transcript), session keys from the ephemeral key exchange and the
key (wire/secure.py), HELLO_OK (protected: it proves the syncer, and names the run), the MANIFEST read
(protected) and checked, the island joined, WELCOME. Nothing larger than a HELLO (64 KiB) is read from a peer that
has not proved its key; every refusal after the HELLO verified is protected (the island treats it as final, and a
clear one as transient).

``accept_handshake(server, session)`` runs on the connection's reader thread before anything else; it returns
True when the island joined the run (the session then reads messages), False when the connection is to be
closed (a refusal was sent, or a PROBE was answered). See docs/protocol.md ("Handshake", "Authentication").
"""
from __future__ import annotations

import hmac
import logging
import math
import threading
import time

from ...wire import auth, secure
from ...wire.frames import MAX_PAYLOAD, AuthError, FrameAuthError, MsgType, PeerError, ProtocolError, WireTimeout
from ...wire.schema import welcome_meta
from ...wire.text import EscapeArgs, check_island_id, printable
from ...wire.values import Welcome
from ..model.layout import first_difference, normalize_manifest
from ..model.limits import default_max_model_bytes, model_size_error
from ..rounds.pushes import PushRefused

__all__ = ["accept_handshake", "HandshakeMemory"]

log = logging.getLogger("yeto.syncer")
if not any(isinstance(f, EscapeArgs) for f in log.filters):
    # every argument of every syncer log line is escaped and bounded: island ids, peers' ERROR texts, fields
    # echoed in refusals can neither forge lines (newlines, CR) nor drive a terminal (ANSI) nor break a handler
    log.addFilter(EscapeArgs(2000))

STRANGER_TEXT = 200   # characters of a stranger's text that reach the log


class StrangerLog:
    """Log lines caused by peers that have not authenticated: each argument cut to ``STRANGER_TEXT`` characters,
    at most ``burst`` lines per ``period`` seconds (the rest counted and reported with the next line allowed),
    so strangers cannot make the syncer write more than a few KB a minute however many connect."""

    def __init__(self, burst: int = 10, period: float = 10.0):
        self.burst, self.period = burst, period
        self._lock = threading.Lock()
        self._window = 0.0
        self._count = 0
        self._suppressed = 0

    def warning(self, fmt: str, *args) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._window >= self.period:
                self._window, self._count = now, 0
            if self._count >= self.burst:
                self._suppressed += 1
                return False
            self._count += 1
            dropped, self._suppressed = self._suppressed, 0
        args = tuple(printable(a, STRANGER_TEXT) for a in args)
        if dropped:
            fmt += " (%d more lines about unauthenticated peers suppressed)"
            args += (dropped,)
        log.warning(fmt, *args)
        return True


class HandshakeMemory:
    """What the handshakes of one syncer remember between connections (the server owns one): the log budget for
    strangers, and each island id's resumption secret (its next connection proves the session it replaces)."""

    def __init__(self):
        self.strangers = StrangerLog()
        self._lock = threading.Lock()
        self._secrets: dict[str, bytes] = {}

    def secret(self, island: str):
        with self._lock:
            return self._secrets.get(island)

    def remember(self, island: str, secret: bytes) -> None:
        with self._lock:
            self._secrets[island] = secret


def strangers(server) -> StrangerLog:
    return server.handshakes.strangers


def _refuse(s, code: str, message: str, stranger=None) -> None:
    """Send ERROR ``code`` and log it; ``stranger``: the syncer, when the peer has not authenticated yet (the
    line then counts against its budget for strangers)."""
    who = s.island or s.conn.peer
    if stranger is not None:
        strangers(stranger).warning("refusing %s (%s): %s", who, code, message)
    else:
        log.warning("refusing %s (%s): %s", who, code, message)
    try:
        s.conn.send_error(code, message)
    except ProtocolError:
        pass


PROTOCOL = 3   # handshake protocol (CHALLENGE "protocol", HELLO "protocol"); see wire/handshake.py


class _Hello:
    """A parsed HELLO/PROBE; ValueError/KeyError/TypeError when malformed."""

    def __init__(self, meta: dict):
        if meta.get("protocol") != PROTOCOL:
            raise ValueError(f"the island speaks handshake protocol {printable(meta.get('protocol', 1), 20)}, this "
                             f"syncer speaks {PROTOCOL} (session keys from an ephemeral key exchange; protocol 1 sent "
                             "the manifest inside the HELLO, which now follows in its own MANIFEST frame): run the "
                             "same yeto-patch version on the syncer and the islands")
        if "manifest" in meta or "held" in meta:
            raise ValueError("a HELLO carries no manifest (it follows in the MANIFEST frame)")
        self.island = meta["island_id"]
        self.incarnation = meta["incarnation"]
        self.nonce = bytes.fromhex(meta["nonce"])
        self.digest = bytes.fromhex(meta["manifest_digest"])
        self.mac = bytes.fromhex(meta.get("mac", ""))
        self.ephemeral = bytes.fromhex(meta.get("ephemeral") or "")
        check_island_id(self.island)   # printable, encodable, 1..256 characters (no forged log lines)
        if isinstance(self.incarnation, bool) or not isinstance(self.incarnation, int) \
                or not 0 <= self.incarnation < 1 << 64:
            raise ValueError(f"incarnation must be an integer in [0, 2**64), got {printable(self.incarnation, 40)}")
        for what, v in (("nonce", self.nonce), ("manifest_digest", self.digest)):
            if len(v) != auth.NONCE_SIZE:
                raise ValueError(f"{what} must be {auth.NONCE_SIZE} bytes")


def accept_handshake(server, s) -> bool:
    try:
        return _handshake(server, s)
    except (ProtocolError, OSError) as e:
        if s.joined:   # authenticated and joined: the session's own error handling reports it
            raise
        if isinstance(e, PeerError):
            strangers(server).warning("unauthenticated peer %s sent an error [%s]: %s", s.conn.peer, e.code,
                                      e.message)
            return False
        strangers(server).warning("handshake with %s failed: %s", s.conn.peer, e)
        if isinstance(e, ProtocolError) and not isinstance(e, WireTimeout):
            try:   # a framing error: tell the peer why before closing (best effort)
                s.conn.send_error("integrity" if isinstance(e, FrameAuthError) else "protocol", str(e)[:1000])
            except (ProtocolError, OSError):
                pass
        return False


def _key_for(cfg, island: str):
    """The key island ``island`` must prove: its own (--island-keys) if it has one, else the shared key."""
    own = (getattr(cfg, "island_keys", None) or {}).get(island)
    return own if own is not None else cfg.key


def _keyed(cfg) -> bool:
    return cfg.key is not None or bool(getattr(cfg, "island_keys", None))


def _handshake(server, s) -> bool:
    cfg = server.cfg
    server_nonce = auth.new_nonce()
    mode = "aead" if _keyed(cfg) and getattr(cfg, "encrypt", False) else "mac" if _keyed(cfg) else "none"
    ephemeral = secure.Ephemeral() if _keyed(cfg) else None
    challenge = {"nonce": server_nonce.hex(), "protocol": PROTOCOL, "auth": _keyed(cfg), "frames": mode,
                 "ephemeral": ephemeral.public.hex() if ephemeral is not None else ""}
    s.conn.send(MsgType.CHALLENGE, challenge)
    # the whole HELLO within the handshake timeout: a peer trickling bytes cannot hold the connection
    t, meta, _ = s.conn.recv(timeout=cfg.handshake_timeout_s, within=cfg.handshake_timeout_s)
    if t not in (MsgType.HELLO, MsgType.PROBE):
        _refuse(s, "protocol", f"expected HELLO or PROBE, got {t.name}", stranger=server)
        return False
    try:
        hello = _Hello(meta)
    except (KeyError, ValueError, TypeError) as e:
        _refuse(s, "protocol", f"malformed {t.name}: {e}", stranger=server)
        return False
    s.named(hello.island)
    key = _key_for(cfg, hello.island)
    th = secure.transcript(challenge, meta)
    try:
        _check_mac(cfg, key, t, meta, hello, th)
        sess = _Keys(key, mode, ephemeral, challenge, hello, meta, th)
    except AuthError as e:
        _refuse(s, "auth", str(e), stranger=server)
        return False
    s.authenticate()   # a key holder: its slot gives way only when idle (net/admission.py)
    server.slots.one_per_id(s, server.registry.connections())
    _protect(s, sess)   # from here on every frame both ways is authenticated (aead: and encrypted)
    if t == MsgType.PROBE:
        s.conn.send(MsgType.WELCOME, {"probe": True, **server.status()})
        return False
    s.conn.send(MsgType.HELLO_OK, {"run_id": server.run_id})
    manifest = _read_manifest(server, s, hello.digest)
    if manifest is None:
        return False
    return _join(server, s, hello.island, hello.incarnation, manifest, hello.digest, sess)


def _check_mac(cfg, key, t, meta, hello: "_Hello", th: bytes) -> None:
    """Raise AuthError unless the HELLO/PROBE proves ``key`` (its MAC over the transcript) or, without any key,
    says it is insecure too."""
    if key is not None:
        auth.verify(secure.hello_mac(key, th), hello.mac, what=f"{t.name} from island {hello.island!r}")
    elif _keyed(cfg):
        raise AuthError(f"no key for island {hello.island!r}: it has no key file in --island-keys and the syncer "
                        "has no shared key")
    elif not meta.get("insecure"):
        raise AuthError("this syncer runs without a key (insecure, loopback only); the island must be "
                        "configured insecure too")


def _read_manifest(server, s, digest: bytes):
    """The island's MANIFEST after its HELLO was accepted: frame authentication is checked before its JSON is
    parsed (wire/transport.py), the manifest against the digest the HELLO's MAC covered. None when refused."""
    cfg = server.cfg
    s.conn.set_limits({MsgType.MANIFEST: MAX_PAYLOAD[MsgType.MANIFEST]}, MAX_PAYLOAD[MsgType.MANIFEST])
    t, meta, _ = s.conn.recv(timeout=cfg.handshake_timeout_s, within=cfg.handshake_timeout_s)
    if t != MsgType.MANIFEST:
        _refuse(s, "protocol", f"expected MANIFEST after HELLO_OK, got {t.name}")
        return None
    try:
        manifest = normalize_manifest(meta.get("manifest"))
    except (ValueError, TypeError) as e:
        _refuse(s, "manifest", f"bad manifest: {e}")
        return None
    held = meta.get("held")
    if held is not None:
        if not (isinstance(held, list) and len(held) == len(manifest) and all(
                isinstance(h, str) and len(h) == 16 and all(c in "0123456789abcdef" for c in h) for h in held)):
            _refuse(s, "protocol", "malformed MANIFEST: 'held' must hold one 16-hex-digit digest per tensor")
            return None
    init = meta.get("initializer", False)
    if not isinstance(init, bool):
        _refuse(s, "protocol", "malformed MANIFEST: 'initializer' must be true or false")
        return None
    s.declare(held, init)
    if auth.manifest_digest(manifest) != digest:
        _refuse(s, "auth", "the manifest does not match the authenticated manifest digest")
        return None
    return manifest


class _Keys:
    """What one authenticated handshake derives (wire/secure.py): frame keys and the session's resumption secret
    from the ephemeral key exchange and the key, and whether the HELLO proved the previous session of its island
    id (all None without a key). AuthError for an ephemeral key that cannot be used (malformed, low order)."""

    def __init__(self, key, mode, ephemeral, challenge, hello: "_Hello", meta: dict, th: bytes):
        self.session = None
        self.mode = mode
        self.challenge, self.hello, self.meta = challenge, hello, meta
        if key is not None:
            try:
                dh = ephemeral.shared(hello.ephemeral)
            except ValueError as e:
                raise AuthError(f"the HELLO's ephemeral key cannot be used: {e}") from None
            self.session = secure.SessionKeys(key, dh, mode, th)

    @property
    def resumption(self):
        return None if self.session is None else self.session.resumption

    def proves(self, previous: "bytes | None", island: str) -> bool:
        proof = self.meta.get("resume")
        if previous is None or not isinstance(proof, str):
            return False
        try:
            got = bytes.fromhex(proof)
        except ValueError:
            return False
        want = secure.resumption_proof(previous, bytes.fromhex(self.challenge["nonce"]), self.hello.nonce,
                                       bytes.fromhex(self.challenge["ephemeral"]), self.hello.ephemeral, island)
        return hmac.compare_digest(want, got)


def _taken(server, s, island: str, sess: _Keys) -> bool:
    """Whether ``island`` is held by another live connection that this HELLO may not take over: with keys, a
    connected id whose lease has not expired can only be claimed again by its own session (resumption proof);
    called under the coordinator's lock."""
    if sess.resumption is None:
        return False   # insecure (keyless loopback): as before, the newest connection wins
    old = server.registry.get(island)
    if old is None or old is s or old.closed or island not in server.coord.alive_members():
        return False
    return not sess.proves(server.handshakes.secret(island), island)


def _protect(s, sess: _Keys) -> None:
    k = sess.session
    if k is not None:   # from HELLO_OK on, every frame both ways is authenticated (aead: and encrypted)
        s.conn.protect(k.s2c, k.c2s, k.encrypt)


def _join(server, s, island, incarnation, manifest, digest, sess) -> bool:
    cfg = server.cfg
    coord = server.coord
    with coord.lock:
        if coord.manifest is None:
            if len(manifest) < cfg.fragments:
                _refuse(s, "manifest", f"the manifest has {len(manifest)} tensors, fewer than "
                                       f"--fragments {cfg.fragments}")
                return False
            too_big = model_size_error(sum(math.prod(e[1]) for e in manifest),
                                       cfg.max_model_bytes or default_max_model_bytes())
            if too_big:
                _refuse(s, "manifest", too_big)
                return False
            coord.set_manifest(manifest, cfg.fragments)
            log.info("manifest fixed by island %s: %d tensors, %d parameters, digest %s%s", island,
                     len(manifest), sum(f.numel for f in coord.frags), digest.hex()[:16],
                     f"; shard {cfg.shard} owns fragments {coord.owned} ({sum(f.numel for f in coord.mine())} "
                     f"parameters)" if cfg.shard.sharded else "")
        elif manifest != coord.manifest:
            _refuse(s, "manifest", "this island's parameter manifest differs from the run's: "
                    + first_difference(coord.manifest, manifest))
            return False
        if _taken(server, s, island, sess):
            _refuse(s, "island-taken", f"island id {island!r} is held by a live connection; only that session "
                    f"(its resumption proof) can reconnect before its lease of {cfg.rounds.lease_s:g}s expires")
            return False
        why = server.init.choice.conflict(s, list(server.registry.joined().values()), coord.initialized,
                                          server.init.session)
        if why is not None:
            _refuse(s, "init", why)
            return False
        try:
            coord.join(island, str(incarnation))
        except PushRefused as e:
            _refuse(s, e.code, e.message)
            return False
        s.join(incarnation)
        server.close_lapsed(island)
        old = server.registry.join(s)
        server.init.choice.joined()
        needs_init = server.pick_initializer(s) if not coord.initialized else []
        welcome = welcome_meta(Welcome(
            island_id=island, run_id=server.run_id, layout=coord.layout, numels=[f.numel for f in coord.frags],
            fragments=len(coord.frags), versions=coord.versions() if coord.initialized else None,
            needs_init=needs_init, base_wire=cfg.base_wire, heartbeat_s=server.heartbeat_s,
            lease_s=cfg.rounds.lease_s, islands=cfg.islands, quorum=cfg.rounds.k,
            total_rounds=cfg.rounds.total_rounds, final=server.final_started, shard=tuple(cfg.shard.as_json()),
            owned=list(coord.owned), shard_addresses=tuple(cfg.shard_addresses)), digest.hex())
        if coord.initialized:  # queued now (the writer starts after WELCOME went out)
            for f in coord.owned:
                s.post_base(f, "check" if s.declared and not server.final_done else "f32", final=server.final_done)
        if sess.resumption is not None:
            server.handshakes.remember(island, sess.resumption)   # its next connection proves this session
    s.conn.send(MsgType.WELCOME, welcome)  # outside the central lock: a slow reader blocks only itself
    if old is not None and old is not s:
        log.info("island %s reconnected (incarnation %s); closing its previous connection", island, incarnation)
        old.close()
    log.info("island %s joined (incarnation %s)%s", island, incarnation, " and will send INIT" if needs_init else "")
    server.metrics.connections.set(server.registry.count())
    return True
