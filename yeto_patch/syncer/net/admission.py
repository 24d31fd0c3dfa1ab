"""Which connections may start a handshake with the syncer: bounded slots, so that squatters (connections that
never authenticate) can neither exhaust the syncer nor keep honest islands out (docs/protocol.md, Limits)."""
from __future__ import annotations

import collections
import logging
import time

from ...wire.text import printable

__all__ = ["HandshakeSlots", "EVICT_AFTER_S", "host_of"]

log = logging.getLogger("yeto.syncer")
EVICT_AFTER_S = 5.0   # a handshake still unauthenticated this long may give way to a new one when all slots are taken


def host_of(sock) -> str:
    """The address a connection comes from (what the per-host slots count; "?" when the socket cannot say)."""
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


class HandshakeSlots:
    """The server's handshake slots: at most ``total`` connections in their handshake, ``per_host`` from one
    address; it owns only when it last said that the slots are full."""

    def __init__(self, total: int, per_host: int):
        self.total = int(total)
        self.per_host = int(per_host)
        self._next_flood_log = 0.0

    def admit(self, host: str, sessions) -> bool:
        """Whether a new connection from ``host`` may start its handshake (``sessions``: the server's open
        connections; the victim, if one gives way, is closed here). At most --max-handshakes-per-host
        connections in their handshake per address (a squatter only hurts itself there) and --max-handshakes in
        all; when all are taken, the oldest unauthenticated handshake of the address holding the most gives way if
        that address holds more than the newcomer's would, else the oldest handshake still unauthenticated after
        EVICT_AFTER_S (an honest handshake is two round trips and a manifest), so squatters from many addresses
        cannot keep honest islands out. A handshake whose HELLO verified (a key holder sending its manifest, which
        may take longer than EVICT_AFTER_S on a slow link) never gives way (docs/protocol.md, Limits)."""
        waiting = [x for x in list(sessions) if not x.joined and not x.closed]
        mine = sum(1 for x in waiting if x.host == host)
        if mine >= self.per_host:
            self._log_full(len(waiting), host, mine, evicted=None)
            return False
        if len(waiting) < self.total:
            return True
        strangers = [x for x in waiting if not x.authenticated]
        per_host = collections.Counter(x.host for x in strangers)
        victim = None
        if per_host:
            top, most = per_host.most_common(1)[0]
            if most > mine + 1:
                victim = min((x for x in strangers if x.host == top), key=lambda x: x.since)
            else:
                oldest = min(strangers, key=lambda x: x.since)
                victim = oldest if time.monotonic() - oldest.since >= EVICT_AFTER_S else None
        if victim is None:
            self._log_full(len(waiting), host, mine, evicted=None)
            return False
        victim.close()
        self._log_full(len(waiting), host, mine, evicted=victim.host)
        return True

    def _log_full(self, pending: int, host: str, mine: int, evicted) -> None:
        """Say (at most every 10 s) that the handshake slots are full, and what gave way."""
        now = time.monotonic()
        if now >= self._next_flood_log:
            self._next_flood_log = now + 10.0
            log.warning("%d connections (from %s: %d) are still in their handshake (--max-handshakes); %s",
                        pending, printable(host), mine, "closing new ones until they finish" if evicted is None
                        else f"the oldest from {printable(evicted)} gives way")
