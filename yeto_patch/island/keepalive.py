"""Keep-alive calls while the island waits: a launcher's hang detector must not take a waiting island for a hung one.

A launcher may watch its ranks for hangs (NVIDIA's ``ft_launcher`` with Megatron-LM's ``--enable-ft-package``
kills a rank whose FT ``step`` section stays open longer than its timeout). An island's waits (a base at the tau
bound, the syncer during an outage, the initial bases at start, its own background work) block the training
thread inside such a step for as long as YETO_DILOCO_TIMEOUT allows, and are bounded by it: they are not hangs.

The interface (one owner, ``KEEPALIVE``):

- a hook module that knows the launcher's detector ``register(name, callback, every_s)``\\ s a callable (no
  arguments) that tells the detector "alive", and ``unregister(name)``\\ s it when the detector goes away; the
  callback belongs to the thread that registered it (the training thread) and is only called while THAT thread
  waits;
- the island's functions that block run as waits (decorated ``@waiting``; nestable).

While a callback's thread is inside a wait, a daemon thread calls the callback once the wait has lasted
``every_s`` seconds, then every ``every_s`` seconds until the wait ends; a wait that ends sooner costs no call. The
calls come from a thread of their own because an island's ranks other than 0 wait inside gloo collectives. A wait
does not return while one of its callbacks runs (so the detector's client is never used by two threads at once;
bounded by ``EXIT_WAIT_S``). A callback that raises is logged once and not called again: a keep-alive never
breaks training. With nothing registered, a wait costs one dictionary check.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

log = logging.getLogger("yeto_patch")

EXIT_WAIT_S = 10.0   # longest the end of a wait waits for a keep-alive call in flight


@dataclass
class _Callback:
    """One registered keep-alive: its function and period, the thread whose waits it covers, when it is due
    next (None: that thread is not waiting), how often it ran, whether it failed."""
    fn: Callable[[], None]
    every_s: float
    thread: int
    due: Optional[float] = None
    calls: int = 0
    failed: bool = False


class KeepAlive:
    """The keep-alive callbacks and the waits that trigger them (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cv = threading.Condition()
        self._calling = threading.Lock()          # held while callbacks run (the end of a wait waits for it)
        self._callbacks: Dict[str, _Callback] = {}
        self._depth: Dict[int, int] = {}          # thread id -> nesting depth of its open wait
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------- callbacks
    def register(self, name: str, fn: Callable[[], None], every_s: float) -> None:
        """Call `fn()` every `every_s` seconds (> 0) of the calling thread's waits (replaces `name`)."""
        if not every_s > 0:
            raise ValueError(f"keep-alive {name}: every_s must be > 0, not {every_s!r}")
        me = threading.get_ident()
        with self._cv:
            cb = _Callback(fn, float(every_s), me)
            if self._depth.get(me):
                cb.due = self._clock() + cb.every_s
            self._callbacks[name] = cb
            self._cv.notify_all()

    def unregister(self, name: str) -> None:
        """Stop calling `name` (returns after a call in flight ended)."""
        with self._cv:
            self._callbacks.pop(name, None)
        if self._calling.acquire(timeout=EXIT_WAIT_S):
            self._calling.release()

    def registered(self) -> List[str]:
        with self._cv:
            return sorted(self._callbacks)

    def calls(self, name: str) -> int:
        """How often `name` was called (0 when it is not registered)."""
        with self._cv:
            cb = self._callbacks.get(name)
            return 0 if cb is None else cb.calls

    # ------------------------------------------------------------------------------------- waits
    def enter(self) -> None:
        """The calling thread starts waiting (nestable)."""
        if not self._callbacks:   # (the common case: nothing to keep alive)
            return
        me = threading.get_ident()
        with self._cv:
            depth = self._depth.get(me, 0)
            self._depth[me] = depth + 1
            if depth:
                return
            now = self._clock()
            for cb in self._callbacks.values():
                if cb.thread == me:
                    cb.due = now + cb.every_s
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="yeto-keepalive", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def exit(self) -> None:
        """The calling thread's wait ends; returns once a keep-alive call in flight ended."""
        if not self._depth:   # (nothing registered when it began)
            return
        me = threading.get_ident()
        with self._cv:
            depth = self._depth.get(me)
            if depth is None:
                return
            if depth > 1:
                self._depth[me] = depth - 1
                return
            del self._depth[me]
            for cb in self._callbacks.values():
                if cb.thread == me:
                    cb.due = None
        if self._calling.acquire(timeout=EXIT_WAIT_S):
            self._calling.release()
        else:
            log.warning("yeto-patch: a keep-alive call is still running after %.0fs; training goes on",
                        EXIT_WAIT_S)

    def waiting(self, fn):
        """Decorator: `fn` is a wait (runs between ``enter()`` and ``exit()``)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()
        return wrapper

    # ------------------------------------------------------------------------------------- the calling thread
    def _take_due(self) -> tuple:
        """(callbacks due now, seconds to the next due one or None); advances the due ones (under the lock)."""
        now = self._clock()
        due, nxt = [], None
        for name, cb in self._callbacks.items():
            if cb.due is None or cb.failed:
                continue
            if cb.due <= now:
                due.append((name, cb))
                cb.due = now + cb.every_s
            nxt = cb.due - now if nxt is None else min(nxt, cb.due - now)
        return due, nxt

    def _run(self) -> None:
        while True:
            with self._cv:
                due, nxt = self._take_due()
                while not due:
                    self._cv.wait(None if nxt is None else max(0.01, nxt))
                    due, nxt = self._take_due()
                self._calling.acquire()   # (before the lock goes: a wait that ends now waits for these calls)
            try:
                for name, cb in due:
                    self._call(name, cb)
            finally:
                self._calling.release()

    def _call(self, name: str, cb: _Callback) -> None:
        try:
            cb.fn()
        except Exception as e:  # noqa: BLE001 - a keep-alive never breaks training
            cb.failed = True
            log.warning("yeto-patch: keep-alive %s failed (%s: %s); it is not called again, so the launcher's hang "
                        "detector may take this rank's long waits for hangs", name, type(e).__name__, e)
            return
        with self._cv:
            cb.calls += 1


KEEPALIVE = KeepAlive()
waiting = KEEPALIVE.waiting
