"""One background stage of an island's sync: a worker thread per rank that runs jobs in submission order on a
gloo group of its own (never a group the training loop uses), and the rules for its failures.

Every rank submits the same jobs in the same order (rank 0's plan), so the collectives inside the jobs pair up
across ranks. A failure inside a job on any rank reaches every rank's worker through the job's own agreement (or
the group's timeout, YETO_DILOCO_TIMEOUT). Rank 0 raises it on the training thread at its next step inside the
island's plan (``check``), so every rank fails with that stage's message; another rank raising alone from
``check`` would leave the others waiting in a collective, so it only logs. A rank that waits for its own job
(``_wait``) raises the failure itself: it does so only where every rank waits for the same job.

Subclasses: ``push_lane.PushLane`` (a push's gather and encoding) and ``base_lane.BaseLane`` (a merged base
scattered to the holders' staging buffers).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable, Optional

from yeto_patch.island.errors import EngineError
from yeto_patch.island.keepalive import waiting

log = logging.getLogger("yeto_patch")


class BackgroundLane:
    """Jobs keyed by fragment, run one at a time by a worker thread. A job has ``result`` (None until its work
    ended: then the work's result), ``t_submit``, ``t_start``, ``work_s`` and ``cpu_s`` (set here). ``kind``:
    the lane's name in messages ("push", "base")."""

    kind = "background"

    def __init__(self, comm, rank: int, timeout_s: float, thread_name: str):
        self.comm, self.rank, self.timeout_s = comm, rank, timeout_s
        self.jobs: "collections.OrderedDict[int, object]" = collections.OrderedDict()   # fragment -> job
        self.error: Optional[BaseException] = None
        self._said = False
        self._q: "queue.Queue" = queue.Queue()
        self._cv = threading.Condition()
        self._t = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._t.start()

    # ------------------------------------------------------------------------------------- training thread
    def _enqueue(self, key: int, job) -> None:
        with self._cv:
            self.jobs[key] = job
        self._q.put(job)

    def finished(self, f: int) -> bool:
        """Fragment f's job exists and its work ended."""
        job = self.jobs.get(f)
        return job is not None and job.result is not None

    def take_finished(self) -> list:
        """Jobs whose work ended, in submission order, up to the first one still running; raises a failure of
        the stage (rank 0)."""
        self.check()
        out = []
        with self._cv:
            for f, job in list(self.jobs.items()):
                if job.result is None:
                    break
                out.append(self.jobs.pop(f))
        return out

    def wait_all(self, what: str) -> None:
        """Wait (bounded by the timeout) until every queued job ended."""
        self._wait(lambda: all(j.result is not None for j in self.jobs.values()), what)

    @waiting   # (keep-alive calls while it lasts, island/keepalive.py)
    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while not ready() and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"yeto-patch: {what}: the background {self.kind} stage did not finish "
                                      f"within {self.timeout_s:g}s (YETO_DILOCO_TIMEOUT)")
                self._cv.wait(min(left, 0.5))
        self.check()

    def failure(self) -> EngineError:
        return EngineError(f"yeto-patch: the background {self.kind} stage failed: {self.error}")

    def check(self) -> None:
        """Raise the stage's failure on rank 0 (inside the island's plan: every rank fails with it); log it once
        on the other ranks (see the module docstring)."""
        if self.error is not None and self.rank == 0:
            raise self.failure() from self.error
        if self.error is not None and not self._said:
            self._said = True
            log.warning("yeto-patch: rank %d: the background %s stage failed (island rank 0 reports it): %s",
                        self.rank, self.kind, self.error)

    def close(self) -> None:
        self._q.put(None)

    # ------------------------------------------------------------------------------------- worker thread
    def _work(self, job):
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None or self.error is not None:
                return
            try:
                job.t_start, cpu0 = time.perf_counter(), time.thread_time()
                result = self._work(job)
                job.work_s = time.perf_counter() - job.t_start
                job.cpu_s = time.thread_time() - cpu0   # (this thread's CPU: what the job took from training)
            except BaseException as e:  # noqa: BLE001 - raised on the training thread (check)
                with self._cv:
                    self.error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._finish(job, result)
                self._cv.notify_all()

    def _finish(self, job, result) -> None:
        job.result = result
