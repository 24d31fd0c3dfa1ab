"""Pushes off the training thread (tau >= 1): at a boundary every rank copies the FP32 masters of its own shard of
the fragment into a host buffer, once (``MasterView.snapshot_delta``: local, no communication), and training goes
on; a worker thread per rank then turns them into the delta (anchor - snapshot) and streams it to rank 0 over the
island's own gloo group for background work (never a group the training loop uses), where the fragment is
encoded (error feedback included).
Rank 0's training thread hands each finished body to the syncer link at its next step (``take_finished``); the
link's own sender then sends it in the background as before.

Jobs run in boundary order on every rank, and a failure on any rank fails every rank with this stage's message
(``background.py``: the worker, the ordering and the failure rules). Memory: one own-shard float32 copy per push
in flight and one spare (the largest spent snapshot, reused by the next push so that the training thread's copy
does not fault in fresh pages), plus the gather's chunks (``MasterView``'s bound) and, on rank 0, the encoded
body.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from yeto_patch.island.background import BackgroundLane
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
    fed: int = 0                   # rank 0: values gathered so far
    boundary_s: Optional[float] = None   # rank 0: the training thread's time in its boundary (plan + snapshots)


class PushPipeline(BackgroundLane):
    """The background stage of pushes on one rank. `view`: the island's MasterView; `comm`: a dedicated
    IslandComm; `encoder(state)`: rank 0's PushEncoder factory for a fragment (None on the other ranks)."""

    stage = "push"

    def __init__(self, view, comm, rank: int, encoder, timeout_s: float):
        self.view, self.encoder = view, encoder
        self._spare = None   # the largest spent snapshot buffer, kept for the next push
        super().__init__(comm, rank, timeout_s, "yeto-push-gather")

    # ------------------------------------------------------------------------------------- training thread
    def submit(self, st, step: int) -> PushJob:
        """Every rank, at fragment `st`'s boundary: snapshot this rank's own shard of its delta and queue the
        gather and encoding; returns at once."""
        self.check()
        if st.index in self.jobs and self.rank != 0:   # rank 0 handed it over; the worker here ends right after
            self._wait(lambda: self.jobs[st.index].done is not None, f"the previous push of fragment {st.index}")
            self.take_finished()
        if st.index in self.jobs:   # (rank 0 hands every push over before the fragment's next boundary)
            raise EngineError(f"internal: fragment {st.index} has a push in flight already")
        t0 = time.perf_counter()
        with self._cv:   # (a spent snapshot's buffer is reused: no fresh pages to fault in on this thread)
            spare, self._spare = self._spare, None
        snap = self.view.snapshot_delta(st.entries, spare)
        job = PushJob(st, step, st.anchor_version, st.steps_since, st.tokens_since, snap,
                      time.perf_counter() - t0, sum(int(b.numel()) * 4 for _, _, b in snap.values()))
        self._enqueue(st.index, job)
        log.debug("yeto-patch: step %d: snapshot of fragment %d's delta (%.1f MB own shard) in %.1f ms", step,
                  st.index, job.nbytes / 1e6, job.snapshot_s * 1000)
        return job

    def behind(self, f: int) -> str:
        """What fragment f's push is waiting for, with its rate (for the tau-bound log line)."""
        job = self.jobs.get(f)
        if job is None:
            return "nothing (handed to the link)"
        now = time.perf_counter()
        if job.t_start is None:
            ahead = [j.state.index for j in self.jobs.values() if j is not job and j.done is None]
            return (f"the background gather: queued {now - job.t_submit:.1f}s behind the pushes of fragments "
                    f"{ahead}")
        secs = max(now - job.t_start, 1e-9)
        total = job.state.numel
        return (f"the background gather/encode: {job.fed} of {total} values after {secs:.1f}s "
                f"({job.fed * 4 / secs / 1e6:.1f} MB/s)")

    # ------------------------------------------------------------------------------------- worker thread
    def _finish(self, job, result) -> None:   # (under the lane's lock)
        buf = self.view.snapshot_buffer(job.snap) if job.snap else None
        if buf is not None and (self._spare is None or buf.numel() > self._spare.numel()):
            self._spare = buf   # (the snapshot is spent: its buffer serves the next push, the smaller one goes)
        job.done, job.snap = result, None

    def _work(self, job: PushJob) -> tuple:
        st = job.state
        if self.rank != 0:
            self.view.gather(st.entries, job.snap, None, self.comm)
            return ()
        enc = self.encoder(st)
        t0 = time.perf_counter()

        def sink(e, off, arr):
            enc.feed(arr)
            job.fed += int(arr.size)
        self.view.gather(st.entries, job.snap, sink, self.comm)
        body = enc.finish()
        return body, time.perf_counter() - t0 - enc.encode_s, enc.encode_s
