"""The syncer's side of the handshake: CHALLENGE, HELLO (or PROBE) checked, the island joined, WELCOME.

``accept_handshake(server, session)`` runs on the connection's reader thread before anything else; it returns
True when the island joined the run (the session then reads messages), False when the connection is to be
closed (a refusal was sent, or a PROBE was answered). See docs/protocol.md ("Handshake", "Authentication").
"""
from __future__ import annotations

import logging

from ..wire import auth
from ..wire.frames import AuthError, MsgType, ProtocolError
from ..wire.text import check_island_id
from .layout import first_difference, normalize_manifest
from .rounds import PushRefused

__all__ = ["accept_handshake"]

log = logging.getLogger("yeto.syncer")


def _refuse(s, code: str, message: str) -> None:
    log.warning("refusing %s (%s): %s", s.island or s.conn.peer, code, message)
    try:
        s.conn.send_error(code, message)
    except ProtocolError:
        pass


def _parse_hello(t, meta) -> tuple:
    """(island, incarnation, client nonce, manifest digest, mac) of a HELLO/PROBE; ValueError/KeyError/
    TypeError when malformed."""
    island = meta["island_id"]
    incarnation = meta["incarnation"]
    client_nonce = bytes.fromhex(meta["nonce"])
    digest = bytes.fromhex(meta["manifest_digest"])
    mac = bytes.fromhex(meta.get("mac", ""))
    check_island_id(island)   # printable, encodable, 1..256 characters (no forged log lines, no MAC crash)
    if isinstance(incarnation, bool) or not isinstance(incarnation, int) or not 0 <= incarnation < 1 << 64:
        raise ValueError("incarnation must be an integer in [0, 2**64)")
    return island, incarnation, client_nonce, digest, mac


def accept_handshake(server, s) -> bool:
    cfg = server.cfg
    server_nonce = auth.new_nonce()
    s.conn.send(MsgType.CHALLENGE, {"nonce": server_nonce.hex(), "protocol": 1, "auth": cfg.key is not None})
    # the whole HELLO within the handshake timeout: a peer trickling bytes cannot hold the connection
    t, meta, _ = s.conn.recv(timeout=cfg.handshake_timeout_s, within=cfg.handshake_timeout_s)
    if t not in (MsgType.HELLO, MsgType.PROBE):
        _refuse(s, "protocol", f"expected HELLO or PROBE, got {t.name}")
        return False
    try:
        island, incarnation, client_nonce, digest, mac = _parse_hello(t, meta)
    except (KeyError, ValueError, TypeError) as e:
        _refuse(s, "protocol", f"malformed {t.name}: {e}")
        return False
    s.island = island
    try:
        if cfg.key is not None:
            auth.verify(auth.client_mac(cfg.key, server_nonce, client_nonce, island, incarnation, digest), mac,
                        what=f"{t.name} from island {island!r}")
        elif not meta.get("insecure"):
            raise AuthError("this syncer runs without a key (insecure, loopback only); the island must be "
                            "configured insecure too")
    except AuthError as e:
        _refuse(s, "auth", str(e))
        return False
    smac = auth.server_mac(cfg.key, server_nonce, client_nonce, island, incarnation, digest).hex() \
        if cfg.key is not None else ""
    if t == MsgType.PROBE:
        s.conn.send(MsgType.WELCOME, {"probe": True, "server_mac": smac, **server.status()})
        return False
    try:
        manifest = normalize_manifest(meta.get("manifest"))
    except (ValueError, TypeError) as e:
        _refuse(s, "manifest", f"bad manifest: {e}")
        return False
    held = meta.get("held")
    if held is not None:
        if not (isinstance(held, list) and len(held) == len(manifest) and all(
                isinstance(h, str) and len(h) == 16 and all(c in "0123456789abcdef" for c in h) for h in held)):
            _refuse(s, "protocol", "malformed HELLO: 'held' must hold one 16-hex-digit digest per tensor")
            return False
        s.declared = held
    if auth.manifest_digest(manifest) != digest:
        _refuse(s, "auth", "the manifest does not match the authenticated manifest digest")
        return False
    return _join(server, s, island, incarnation, manifest, digest, smac)


def _join(server, s, island, incarnation, manifest, digest, smac) -> bool:
    cfg = server.cfg
    coord = server.coord
    with coord.lock:
        if coord.manifest is None:
            if len(manifest) < cfg.fragments:
                _refuse(s, "manifest", f"the manifest has {len(manifest)} tensors, fewer than "
                                       f"--fragments {cfg.fragments}")
                return False
            coord.set_manifest(manifest, cfg.fragments)
            log.info("manifest fixed by island %s: %d tensors, %d parameters, digest %s", island,
                     len(manifest), sum(f.numel for f in coord.frags), digest.hex()[:16])
        elif manifest != coord.manifest:
            _refuse(s, "manifest", "this island's parameter manifest differs from the run's: "
                    + first_difference(coord.manifest, manifest))
            return False
        try:
            coord.join(island, str(incarnation))
        except PushRefused as e:
            _refuse(s, e.code, e.message)
            return False
        s.incarnation = incarnation
        old = server.sessions.get(island)
        server.sessions[island] = s
        s.joined = True
        needs_init: list = []
        if not coord.initialized:
            if server.initializer is None or server.initializer.closed:
                server.initializer = s
                needs_init = coord.missing_init()
        welcome = {"island_id": island, "server_mac": smac, "layout": coord.layout,
                   "numels": [f.numel for f in coord.frags], "fragments": len(coord.frags),
                   "versions": coord.versions() if coord.initialized else None, "needs_init": needs_init,
                   "base_wire": cfg.base_wire, "heartbeat_s": server.heartbeat_s,
                   "lease_s": cfg.rounds.lease_s, "islands": cfg.islands, "quorum": cfg.rounds.k,
                   "total_rounds": cfg.rounds.total_rounds, "manifest_digest": digest.hex(),
                   "final": server.final_started}
        if coord.initialized:  # queued now (the writer starts after WELCOME went out)
            for f in range(len(coord.frags)):
                s.post_base(f, "check" if s.declared and not server.final_done else "f32", final=server.final_done)
    s.conn.send(MsgType.WELCOME, welcome)  # outside the central lock: a slow reader blocks only itself
    if old is not None and old is not s:
        log.info("island %s reconnected (incarnation %s); closing its previous connection", island, incarnation)
        old.close()
    log.info("island %s joined (incarnation %s)%s", island, incarnation, " and will send INIT" if needs_init else "")
    server.metrics.connections.set(len(server.sessions))
    return True
