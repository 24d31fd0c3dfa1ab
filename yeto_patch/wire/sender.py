"""Background sender: runs submitted send jobs in order on one thread, bounded by queued bytes.

``submit`` blocks while the jobs queued or running hold more than ``max_queued_bytes`` (back-pressure, so a
slow link cannot make memory grow without bound). The first failure of a job is kept and re-raised by the
caller's next ``submit``/``check``/``drain``/``close`` (and every call after: a failed sender stays failed);
jobs queued behind a failure are not run.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from .frames import ProtocolError, WireTimeout

__all__ = ["BackgroundSender", "SenderClosed"]


class SenderClosed(ProtocolError):
    """submit() after close()."""


class BackgroundSender:
    def __init__(self, max_queued_bytes: int, name: str = "yeto-sender"):
        if max_queued_bytes <= 0:
            raise ValueError("max_queued_bytes must be > 0")
        self.max_queued_bytes = int(max_queued_bytes)
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._bytes = 0  # queued + running
        self._running = False
        self._running_nbytes = 0
        self._error: Optional[BaseException] = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        with self._cv:
            return self._bytes

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def check(self) -> None:
        """Re-raise the first failure of a background job, if any."""
        with self._cv:
            self._raise_if_failed()

    def submit(self, fn: Callable[[], object], nbytes: int, timeout: Optional[float] = None) -> None:
        """Queue ``fn`` (run later on the sender thread). Blocks while more than ``max_queued_bytes`` would be
        held (a job larger than the bound waits until the sender is idle). ``timeout``: WireTimeout if the
        space does not free up in time."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                self._raise_if_failed()
                if self._closing:
                    raise SenderClosed("background sender is closed")
                if self._bytes == 0 or self._bytes + nbytes <= self.max_queued_bytes:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WireTimeout(f"background sender still holds {self._bytes} bytes after {timeout}s "
                                      f"(limit {self.max_queued_bytes}); the link is too slow")
                self._cv.wait(left)
            self._q.append((fn, nbytes))
            self._bytes += nbytes
            self._cv.notify_all()

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued job has run; re-raises a failure; WireTimeout if not done in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._q or self._running) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WireTimeout(f"background sender did not drain within {timeout}s "
                                      f"({len(self._q)} jobs, {self._bytes} bytes pending)")
                self._cv.wait(left)
            self._raise_if_failed()

    def close(self, timeout: Optional[float] = None) -> None:
        """Run what is queued, stop the thread, and re-raise a failure if one happened."""
        try:
            self.drain(timeout)
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join(timeout)
        self.check()

    def abort(self, timeout: float = 5.0) -> None:
        """Drop the queued jobs and stop (the link they were for is gone; the caller sends them again on a new
        one); waits up to ``timeout`` for a running job, whose failure is not re-raised."""
        with self._cv:
            self._q.clear()
            self._bytes = self._running_nbytes if self._running else 0
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closing:
                    self._cv.wait()
                if not self._q:
                    return
                fn, nbytes = self._q.popleft()
                self._running = True
                self._running_nbytes = nbytes
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller, never swallowed
                with self._cv:
                    if self._error is None:
                        self._error = e
                    dropped = len(self._q)
                    self._q.clear()
                    self._bytes = 0
                    self._running = False
                    if dropped:
                        e.add_note(f"yeto-patch: {dropped} queued background send(s) were not run") \
                            if hasattr(e, "add_note") else None
                    self._cv.notify_all()
                continue
            with self._cv:
                self._bytes -= nbytes
                self._running = False
                self._cv.notify_all()
