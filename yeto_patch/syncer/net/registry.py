"""The server's registry of island connections: every open connection (in its handshake or joined) and, per island
id, the joined one. The server owns it; the handshake and the reader change it only through these methods."""
from __future__ import annotations

import threading
from typing import Optional

from .session import Session

__all__ = ["Registry"]


class Registry:
    def __init__(self):
        self._lock = threading.Lock()
        self._open: set = set()                  # every connection not yet closed by the server
        self._joined: dict[str, Session] = {}    # island id -> its joined connection

    def add(self, s: Session) -> None:
        with self._lock:
            self._open.add(s)

    def join(self, s: Session) -> Optional[Session]:
        """``s`` joined as its island: it replaces (and returns) that island's previous connection, if any."""
        with self._lock:
            old = self._joined.get(s.island)
            self._joined[s.island] = s
            return old

    def remove(self, s: Session) -> bool:
        """``s`` closed: forget it; True when it was its island's joined connection."""
        with self._lock:
            self._open.discard(s)
            if s.joined and self._joined.get(s.island) is s:
                del self._joined[s.island]
                return True
            return False

    def get(self, island: str) -> Optional[Session]:
        with self._lock:
            return self._joined.get(island)

    def joined(self) -> dict:
        """A copy of island id -> its joined connection."""
        with self._lock:
            return dict(self._joined)

    def connections(self) -> list:
        """Every open connection (a copy)."""
        with self._lock:
            return list(self._open)

    def count(self) -> int:
        with self._lock:
            return len(self._joined)
