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
IDLE_AUTH_S = 5.0     # an authenticated handshake idle this long (no MANIFEST yet) may give way too


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

    def admit(self, host: str, sessions, member=lambda island: False) -> bool:
        """Whether a new connection from ``host`` may start its handshake (``sessions``: the server's open
        connections; the victim, if one gives way, is closed here; ``member(id)``: whether an island id is in the
        run's roster). At most --max-handshakes-per-host connections in their handshake per address (a squatter
        only hurts itself there) and --max-handshakes in all; when all are taken, the oldest unauthenticated
        handshake of the address holding the most gives way if that address holds more than the newcomer's would,
        else the oldest handshake still unauthenticated after EVICT_AFTER_S (an honest handshake is two round trips
        and a manifest), so squatters from many addresses cannot keep honest islands out. With no stranger to
        evict, an authenticated handshake idle for IDLE_AUTH_S gives way: first one whose id holds another
        handshake or is not in the run's roster, the oldest first (issue 35: 64 authenticated handshakes left idle
        kept an honest island out). A key holder's second handshake of one id replaces its first
        (``one_per_id``)."""
        waiting = [x for x in list(sessions) if not x.joined and not x.closed]
        mine = sum(1 for x in waiting if x.host == host)
        if mine >= self.per_host:
            self._log_full(len(waiting), host, mine, evicted=None)
            return False
        if len(waiting) < self.total:
            return True
        victim = self._stranger_victim(waiting, mine) or self._idle_victim(waiting, member)
        if victim is None:
            self._log_full(len(waiting), host, mine, evicted=None)
            return False
        victim.close()
        self._log_full(len(waiting), host, mine, evicted=victim.host)
        return True

    @staticmethod
    def _stranger_victim(waiting: list, mine: int):
        strangers = [x for x in waiting if not x.authenticated]
        per_host = collections.Counter(x.host for x in strangers)
        if not per_host:
            return None
        top, most = per_host.most_common(1)[0]
        if most > mine + 1:
            return min((x for x in strangers if x.host == top), key=lambda x: x.since)
        oldest = min(strangers, key=lambda x: x.since)
        return oldest if time.monotonic() - oldest.since >= EVICT_AFTER_S else None

    @staticmethod
    def _idle_victim(waiting: list, member):
        now = time.monotonic()
        idle = [x for x in waiting if x.authenticated and now - x.since >= IDLE_AUTH_S]
        if not idle:
            return None
        ids = collections.Counter(x.island for x in idle)
        return min(idle, key=lambda x: (ids[x.island] < 2 and member(x.island), x.since))

    @staticmethod
    def one_per_id(s, sessions) -> None:
        """``s``'s HELLO verified for its island id: an older handshake of the same id still in progress is closed
        (a key holder cannot hold many slots with one id)."""
        for x in list(sessions):
            if x is not s and not x.joined and not x.closed and x.authenticated and x.island == s.island:
                x.close()

    def _log_full(self, pending: int, host: str, mine: int, evicted) -> None:
        """Say (at most every 10 s) that the handshake slots are full, and what gave way."""
        now = time.monotonic()
        if now >= self._next_flood_log:
            self._next_flood_log = now + 10.0
            log.warning("%d connections (from %s: %d) are still in their handshake (--max-handshakes); %s",
                        pending, printable(host), mine, "closing new ones until they finish" if evicted is None
                        else f"the oldest from {printable(evicted)} gives way")
