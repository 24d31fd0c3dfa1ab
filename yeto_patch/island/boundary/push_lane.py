"""Pushes off the training thread (every push, whatever tau): at a boundary every rank copies the FP32 masters of its own shard of
the fragment into a host buffer, once (``MasterView.snapshot_delta``: local, no communication), and training goes
on; a worker thread per rank then turns them into the delta (anchor - snapshot) and streams it to rank 0 over the
island's own gloo group for background work (never a group the training loop uses), where the fragment is
encoded (error feedback included).
Rank 0's training thread hands each finished body to the syncer link at its next plan (``take_finished``), or at
once when it waits for it (tau = 0, the tau bound, the final cut); the other ranks let their job go when rank 0
says it handed it (``release``). The link's own sender then sends it in the background.

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
from typing import NamedTuple, Optional

import torch

from yeto_patch.island.boundary.background import BackgroundLane
from yeto_patch.island.errors import EngineError
from yeto_patch.island.keepalive import waiting

log = logging.getLogger("yeto_patch")


class Encoded(NamedTuple):
    """A push's gather and encoding ended: rank 0's encoded body and the seconds each part took (the other
    ranks: ``NOTHING``)."""
    body: object
    gather_s: float
    encode_s: float


NOTHING = Encoded(None, 0.0, 0.0)


@dataclass
class PushJob:
    """One fragment's push between its boundary and its hand-over to the link."""
    fragment: object               # boundary.fragment.Fragment
    push: object                   # its fragment.Push (the boundary's step, anchor version, counters)
    snap: dict
    snapshot_s: float
    nbytes: int                    # this rank's own-shard bytes
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: Optional[float] = None
    work_s: Optional[float] = None
    cpu_s: Optional[float] = None  # the worker thread's CPU time for it
    result: Optional[Encoded] = None
    snapped: Optional[threading.Event] = None   # set once the snapshot copy (beside training) ended
    snapshot_wait_s: float = 0.0   # the training thread's wait for that copy before the next update
    snap_error: Optional[BaseException] = None
    fed: int = 0                   # rank 0: values gathered so far
    boundary_s: Optional[float] = None   # rank 0: the training thread's time in its boundary (plan + snapshots)

    def figures(self, enc: Encoded, handed_at: int) -> dict:
        """Rank 0: the push's figures for its boundary log record."""
        norm = getattr(enc.body, "delta_norm", None)   # (push_encoder.PushBody: the delta's L2 norm)
        return dict(bytes=int(enc.body.nbytes), gather_ms=round(enc.gather_s * 1000, 2),
                    encode_ms=round(enc.encode_s * 1000, 2), wait_ms=0.0,
                    snapshot_ms=round(self.snapshot_s * 1000, 2), own_bytes=self.nbytes,
                    snapshot_wait_ms=round(self.snapshot_wait_s * 1000, 2),
                    push_cpu_ms=round((self.cpu_s or 0.0) * 1000, 2),
                    boundary_ms=round((self.boundary_s or 0.0) * 1000, 2),
                    queued_ms=round(((self.t_start or self.t_submit) - self.t_submit) * 1000, 2),
                    handed_at=handed_at, **({} if norm is None else {"delta_norm": norm}))


class PushLane(BackgroundLane):
    """The background lane of pushes on one rank. `view`: the island's MasterView; `comm`: a dedicated
    IslandComm; `encoder(fragment)`: rank 0's PushEncoder factory for a fragment (None on the other ranks)."""

    kind = "push"

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

    def submit(self, frag, push) -> PushJob:
        """Every rank, at fragment `frag`'s boundary (`push`: its record): queue the snapshot of this rank's own
        shard of its FP32 masters, its gather and encoding; returns at once. Host masters are copied beside
        training (on a thread of their own, done before the next update: ``wait_snapshots``); device masters
        here, device-to-host."""
        self.check()
        if frag.index in self.jobs:   # (every push is handed over before the fragment's next boundary)
            raise EngineError(f"internal: fragment {frag.index} has a push in the lane already")
        with self._cv:   # (a spent snapshot's buffer is reused: no fresh pages to fault in)
            spare, self._spare = self._spare, None
        job = PushJob(frag, push, None, 0.0, self.view.own_numel(frag.entries) * 4)
        if self.view.host_masters(frag.entries):
            job.snapped = threading.Event()
            self._copies.put((job, spare))
        else:
            t0 = time.perf_counter()
            job.snap = self.view.snapshot_delta(frag.entries, spare)
            job.snapshot_s = time.perf_counter() - t0
        self._enqueue(frag.index, job)
        log.debug("yeto-patch: step %d: fragment %d's push queued (%.1f MB own shard)", push.step, frag.index,
                  job.nbytes / 1e6)
        return job

    def note_boundary(self, f: int, seconds: float) -> None:
        """Rank 0: the training thread's share of fragment f's push (the step's plan and the snapshot)."""
        job = self.jobs.get(f)
        if job is not None and self.rank == 0:
            job.boundary_s = seconds

    def release(self, f: int, what: str) -> None:
        """Every rank but 0, once rank 0 handed fragment f's push to the link: its job here ended too (rank 0's
        part of the same collective ended), or ends at once; it goes."""
        if f not in self.jobs:
            raise EngineError(f"internal: fragment {f} has no push in the lane to release")
        self._wait(lambda: self.jobs[f].result is not None, what)
        with self._cv:
            self.jobs.pop(f)

    def wait_for(self, fragments, what: str) -> None:
        """Wait (bounded) until the jobs of `fragments` and every job queued before them ended (all jobs: None)."""
        keys = list(self.jobs)
        if fragments is not None:
            last = max((keys.index(f) for f in fragments if f in self.jobs), default=-1)
            keys = keys[:last + 1]
        self._wait(lambda: all(self.jobs[k].result is not None for k in keys if k in self.jobs), what)

    @waiting   # (keep-alive calls while it lasts, island/keepalive.py)
    def wait_snapshots(self, what: str) -> None:
        """Training thread, before the next update changes the masters: every queued snapshot is copied (normally
        long done; bounded by the timeout)."""
        deadline = time.monotonic() + self.timeout_s
        for job in list(self.jobs.values()):
            if job.snapped is None or job.snapped.is_set():
                continue
            t0 = time.perf_counter()
            if not job.snapped.wait(max(0.0, deadline - time.monotonic())):
                raise EngineError(f"yeto-patch: {what}: the snapshot of fragment {job.fragment.index}'s push did not "
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
            ahead = [j.fragment.index for j in self.jobs.values() if j is not job and j.result is None]
            return (f"the background gather: queued {now - job.t_submit:.1f}s behind the pushes of fragments "
                    f"{ahead}")
        secs = max(now - job.t_start, 1e-9)
        total = job.fragment.numel
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
                job.snap = self.view.snapshot_delta(job.fragment.entries, spare)
            except BaseException as e:  # noqa: BLE001 - raised through the gather's agreement (_work)
                job.snap_error = e
            job.snapshot_s = time.perf_counter() - t0
            job.snapped.set()

    # ------------------------------------------------------------------------------------- worker thread
    def _finish(self, job, result) -> None:   # (under the lane's lock)
        buf = self.view.snapshot_buffer(job.snap) if job.snap else None
        if buf is not None and (self._spare is None or buf.numel() > self._spare.numel()):
            self._spare = buf   # (the snapshot is spent: its buffer serves the next push, the smaller one goes)
        job.result, job.snap = result, None

    def _work(self, job: PushJob) -> Encoded:
        frag = job.fragment
        if job.snapped is not None:
            job.snapped.wait()   # (the copier always sets it)
        snap = job.snap if job.snap_error is None else _Unreadable(job.snap_error)
        if self.rank != 0:
            self.view.gather(frag.entries, snap, None, self.comm)
            return NOTHING
        enc = self.encoder(frag)
        t0 = time.perf_counter()

        def sink(e, off, arr):
            enc.feed(arr)
            job.fed += int(arr.size)
        self.view.gather(frag.entries, snap, sink, self.comm)
        body = enc.finish()
        return Encoded(body, time.perf_counter() - t0 - enc.encode_s, enc.encode_s)


class _Unreadable(dict):
    """A snapshot whose copy failed: the gather's first read of it raises, inside the collective, so every rank
    of the island fails with this rank's message."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error

    def get(self, *args):
        raise EngineError(f"the snapshot copy failed: {self.error}") from self.error
