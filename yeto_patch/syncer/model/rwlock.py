"""A readers-writer lock: many readers (broadcasts streaming a base) or one writer (a merge committing)."""
from __future__ import annotations

import threading

__all__ = ["RWLock"]


class RWLock:
    """Many readers or one writer; writers preferred (a waiting writer holds new readers back)."""

    def __init__(self):
        self._c = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    def acquire_read(self):
        with self._c:
            while self._writer or self._waiting_writers:
                self._c.wait()
            self._readers += 1

    def release_read(self):
        with self._c:
            self._readers -= 1
            if not self._readers:
                self._c.notify_all()

    def try_acquire_write(self) -> bool:
        """Take the write lock only if nobody holds the lock now (never waits)."""
        with self._c:
            if self._writer or self._readers:
                return False
            self._writer = True
            return True

    def acquire_write(self):
        with self._c:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._c.wait()
            self._waiting_writers -= 1
            self._writer = True

    def release_write(self):
        with self._c:
            self._writer = False
            self._c.notify_all()
