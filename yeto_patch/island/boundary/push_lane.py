"""Pushes off the training thread (tau >= 1): at a boundary every rank copies the FP32 masters of its own shard of
the fragment into a host buffer, once (``MasterView.snapshot_delta``: local, no communication), and training goes
on; a worker thread per rank then turns them into the delta (anchor - snapshot) and streams it to rank 0 over the
island's own gloo group for background work (never a group the training loop uses), where the fragment is
encoded (error feedback included).
Rank 0's training thread hands each finished body to the syncer link at its next step (``take_finished``); the
link's own sender then sends it in the background as before.

Jobs run in boundary order on every rank, and a failure on any rank fails every rank with this stage's message
(``background.py``: the worker, the ordering and the failure rules). Memory: one own-shard float32 copy per push
in flight and one spare (the largest spent snapshot buffer, reused by the next push so that its copy does not
fault in fresh pages), plus the gather's chunks (``MasterView``'s bound) and, on rank 0, the encoded
body.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from yeto_patch.island.boundary.background import BackgroundLane
from yeto_patch.island.errors import EngineError

log = logging.getLogger("yeto_patch")


@dataclass
class PushJob:
    """One fragment's push between its boundary and its hand-over to the link."""
    state: object                  # the FragmentState
    step: int
    base_version: int
    steps: int
    tokens: int
    snap: dict
    snapshot_s: float
    nbytes: int                    # this rank's own-shard bytes
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: Optional[float] = None
    work_s: Optional[float] = None
    cpu_s: Optional[float] = None  # the worker thread's CPU time for it
    done: Optional[tuple] = None   # rank 0: (body, gather_s, encode_s); other ranks: ()
    snapped: Optional[threading.Event] = None   # set once the snapshot copy (beside training) ended
    snapshot_wait_s: float = 0.0   # the training thread's wait for that copy before the next update
    snap_error: Optional[BaseException] = None
    fed: int = 0                   # rank 0: values gathered so far
    boundary_s: Optional[float] = None   # rank 0: the training thread's time in its boundary (plan + snapshots)


class PushPipeline(BackgroundLane):
    """The background stage of pushes on one rank. `view`: the island's MasterView; `comm`: a dedicated
    IslandComm; `encoder(state)`: rank 0's PushEncoder factory for a fragment (None on the other ranks)."""

    stage = "push"

    def __init__(self, view, comm, rank: int, encoder, timeout_s: float):
        self.view, self.encoder = view, encoder
        self._spare = None   # the largest spent snapshot buffer, kept for the next push
        self._copies: "queue.Queue" = queue.Queue()   # snapshots to copy beside training, in boundary order
        self._copier = threading.Thread(target=self._copy_loop, name="yeto-push-snapshot", daemon=True)
        self._copier.start()
        super().__init__(comm, rank, timeout_s, "yeto-push-gather")

    # ------------------------------------------------------------------------------------- training thread
    def reserve(self, numel: int) -> None:
        """At start: the spare snapshot buffer, `numel` float32 (the largest fragment's own shard), its pages
        touched now, so that no boundary's snapshot faults in fresh memory (steady state from the first push)."""
        with self._cv:
            if self._spare is None or self._spare.numel() < numel:
                self._spare = torch.zeros(int(numel), dtype=torch.float32)

    def submit(self, st, step: int) -> PushJob:
        """Every rank, at fragment `st`'s boundary: queue the snapshot of this rank's own shard of its FP32
        masters, its gather and encoding; returns at once. Host masters are copied beside training (on a thread
        of their own, done before the next update: ``wait_snapshots``); device masters here, device-to-host."""
        self.check()
        if st.index in self.jobs and self.rank != 0:   # rank 0 handed it over; the worker here ends right after
            self._wait(lambda: self.jobs[st.index].done is not None, f"the previous push of fragment {st.index}")
            self.take_finished()
        if st.index in self.jobs:   # (rank 0 hands every push over before the fragment's next boundary)
            raise EngineError(f"internal: fragment {st.index} has a push in flight already")
        with self._cv:   # (a spent snapshot's buffer is reused: no fresh pages to fault in)
            spare, self._spare = self._spare, None
        job = PushJob(st, step, st.anchor_version, *st.take_counts(), None, 0.0,
                      self.view.own_numel(st.entries) * 4)
        if self.view.host_masters(st.entries):
            job.snapped = threading.Event()
            self._copies.put((job, spare))
        else:
            t0 = time.perf_counter()
            job.snap = self.view.snapshot_delta(st.entries, spare)
            job.snapshot_s = time.perf_counter() - t0
        self._enqueue(st.index, job)
        log.debug("yeto-patch: step %d: fragment %d's push queued (%.1f MB own shard)", step, st.index,
                  job.nbytes / 1e6)
        return job

    def wait_snapshots(self, what: str) -> None:
        """Training thread, before the next update changes the masters: every queued snapshot is copied (normally
        long done; bounded by the timeout)."""
        deadline = time.monotonic() + self.timeout_s
        for job in list(self.jobs.values()):
            if job.snapped is None or job.snapped.is_set():
                continue
            t0 = time.perf_counter()
            if not job.snapped.wait(max(0.0, deadline - time.monotonic())):
                raise EngineError(f"yeto-patch: {what}: the snapshot of fragment {job.state.index}'s push did not "
                                  f"finish within {self.timeout_s:g}s (YETO_DILOCO_TIMEOUT)")
            job.snapshot_wait_s += time.perf_counter() - t0

    def close(self) -> None:
        self._copies.put(None)
        super().close()

    def behind(self, f: int) -> str:
        """What fragment f's push is waiting for, with its rate (for the tau-bound log line)."""
        job = self.jobs.get(f)
        if job is None:
            return "nothing (handed to the link)"
        now = time.perf_counter()
        if job.snapped is not None and not job.snapped.is_set():
            return f"its snapshot copy, queued {now - job.t_submit:.1f}s ago"
        if job.t_start is None:
            ahead = [j.state.index for j in self.jobs.values() if j is not job and j.done is None]
            return (f"the background gather: queued {now - job.t_submit:.1f}s behind the pushes of fragments "
                    f"{ahead}")
        secs = max(now - job.t_start, 1e-9)
        total = job.state.numel
        return (f"the background gather/encode: {job.fed} of {total} values after {secs:.1f}s "
                f"({job.fed * 4 / secs / 1e6:.1f} MB/s)")

    # ------------------------------------------------------------------------------------- snapshot thread
    def _copy_loop(self) -> None:
        while True:
            item = self._copies.get()
            if item is None:
                return
            job, spare = item
            t0 = time.perf_counter()
            try:
                job.snap = self.view.snapshot_delta(job.state.entries, spare)
            except BaseException as e:  # noqa: BLE001 - raised through the gather's agreement (_work)
                job.snap_error = e
            job.snapshot_s = time.perf_counter() - t0
            job.snapped.set()

    # ------------------------------------------------------------------------------------- worker thread
    def _finish(self, job, result) -> None:   # (under the lane's lock)
        buf = self.view.snapshot_buffer(job.snap) if job.snap else None
        if buf is not None and (self._spare is None or buf.numel() > self._spare.numel()):
            self._spare = buf   # (the snapshot is spent: its buffer serves the next push, the smaller one goes)
        job.done, job.snap = result, None

    def _work(self, job: PushJob) -> tuple:
        st = job.state
        if job.snapped is not None:
            job.snapped.wait()   # (the copier always sets it)
        snap = job.snap if job.snap_error is None else _Unreadable(job.snap_error)
        if self.rank != 0:
            self.view.gather(st.entries, snap, None, self.comm)
            return ()
        enc = self.encoder(st)
        t0 = time.perf_counter()

        def sink(e, off, arr):
            enc.feed(arr)
            job.fed += int(arr.size)
        self.view.gather(st.entries, snap, sink, self.comm)
        body = enc.finish()
        return body, time.perf_counter() - t0 - enc.encode_s, enc.encode_s


class _Unreadable(dict):
    """A snapshot whose copy failed: the gather's first read of it raises, inside the collective, so every rank
    of the island fails with this rank's message."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error

    def get(self, *args):
        raise EngineError(f"the snapshot copy failed: {self.error}") from self.error
