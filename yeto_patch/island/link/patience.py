"""How long an island waits for its syncer, and what it says meanwhile (torch-free, rank 0).

An island waits for the syncer at its tau bound (a push's answer), at start (the initial bases) and at its end (the
final model). Two situations differ:

* **the syncer is unreachable** (no connection, or nothing heard for a lease): the wait fails after
  ``YETO_DILOCO_TIMEOUT`` of it, naming what it waited for (a reconnect is tried meanwhile, ``SyncerLink``);
* **the syncer is alive** (its heartbeats arrive) and the island's round waits for other islands: the island keeps
  waiting, however long, and logs every ``LOG_EVERY_S`` what it waits for and which islands the syncer says are
  missing (the syncer's HEARTBEAT, ``wire.values.SyncerStatus``). A healthy island never stops because another one
  failed; with the elastic defaults a round never waits for an island that is down, so such waits are short.

``StepClock`` is rank 0's view of its own steps (told by the engine after every optimizer step): the step the
heartbeats carry and the compute rate (steps per second of training, from the median step time, so waits and
pauses barely move it) that the syncer's pace and the patience of pushes are made of.
"""
from __future__ import annotations

import collections
import logging
import statistics
import time
from typing import Callable, Optional

from yeto_patch.island.errors import EngineError

__all__ = ["Patience", "StepClock", "LOG_EVERY_S"]

log = logging.getLogger("yeto_patch")
LOG_EVERY_S = 60.0
STEP_SAMPLES = 32
RATE_SAMPLES = 8   # the rate is said once this many step times are known (the first steps' warm-up is not a pace)


class Patience:
    """One wait for the syncer. `link`: anything with ``reachable()`` and ``waiting_on()`` (a SyncerLink or
    ShardedLink). ``check()`` raises an EngineError once the syncer has been unreachable for `timeout` seconds and
    logs every `log_every` seconds while it is alive."""

    def __init__(self, timeout: float, link, what: str, source: str, step: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic, log_every: float = LOG_EVERY_S,
                 since: Optional[float] = None):
        self.timeout, self.link, self.what, self.source, self.step = float(timeout), link, what, source, step
        self.clock, self.log_every = clock, float(log_every)
        self.t0 = clock() if since is None else since
        self.heard = self.t0
        self.next_log = self.t0 + self.log_every

    def unreachable_for(self) -> float:
        return max(0.0, self.clock() - self.heard)

    def check(self) -> None:
        now = self.clock()
        alive = bool(self.link.reachable())
        if alive:
            self.heard = now
        elif now - self.heard >= self.timeout:
            raise EngineError(f"yeto-patch: timed out after {self.timeout:.0f}s (YETO_DILOCO_TIMEOUT) waiting for "
                              f"{self.what} from {self.source}: the syncer was unreachable for "
                              f"{now - self.heard:.0f}s")
        if now >= self.next_log:
            self.next_log = now + self.log_every
            if alive:
                log.warning("yeto-patch: step %d: still waiting for %s (%.0fs so far); the syncer is alive: %s",
                            self.step(), self.what, now - self.t0, self.link.waiting_on())
            else:
                log.warning("yeto-patch: step %d: still waiting for %s (%.0fs so far); the syncer has been "
                            "unreachable for %.0fs (giving up after %.0fs: YETO_DILOCO_TIMEOUT)", self.step(),
                            self.what, now - self.t0, now - self.heard, self.timeout)


class StepClock:
    """Rank 0's step and compute rate: ``stepped(step)`` after every optimizer step, ``resumed()`` once the
    island's own work after it (installs, pushes handed over, waits at the tau bound) is done: a step's time runs
    from there, so a wait for other islands is not compute (an island that pushes every step or two waits at most
    steps, and the median of its step times was its wait: 0.8 steps/s said for an island training 4)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.step = 0
        self._last: Optional[tuple] = None
        self._resumed: Optional[float] = None   # when the work after the last step ended (None: not said)
        self._times: collections.deque = collections.deque(maxlen=STEP_SAMPLES)

    def stepped(self, step: int) -> None:
        now = self.clock()
        if self._last is not None and step > self._last[0]:
            start = self._last[1] if self._resumed is None else self._resumed
            per = (now - start) / (step - self._last[0])
            self._times.extend([per] * min(step - self._last[0], STEP_SAMPLES))
        self._last = (int(step), now)
        self._resumed = None
        self.step = int(step)

    def resumed(self) -> None:
        """The island's work after its last step ended: training resumes now."""
        if self._last is not None:
            self._resumed = self.clock()

    @property
    def step_s(self) -> Optional[float]:
        """The median step time (s) of the last steps (None before the second step)."""
        if not self._times:
            return None
        return statistics.median(self._times)

    @property
    def rate(self) -> float:
        """Steps per second from the median step time, once RATE_SAMPLES step times are known (0 before: a rate
        from the first steps, which compile and warm up, made a Megatron-LM island look 2-3x slower than it is,
        and the fleet's rhythm stretched the others' H to match)."""
        s = self.step_s
        return 1.0 / s if s and len(self._times) >= RATE_SAMPLES else 0.0
