"""Merged bases off the training thread: when rank 0's plan says so, every rank's worker takes part in staging a
fragment's base (``MasterView.stage``, on a gloo group of its own with the view's holder groups): rank 0's
decoded values (or base updates) go to the owners, which add the updates to their anchors, and on to the other
ranks with a FP32 master of them; a blend's ``(1 - alpha) * base`` is prepared there too. At a later step rank
0's plan installs the staged base: each rank takes its own job (normally ended long before) and installs it into
its masters inside the optimizer step (``installs.py``, ``MasterView.install_masters``).

One job per fragment at a time: the engine stages a fragment's next base only after the previous one was
installed, and installs nothing else into a fragment while it is staged (so the anchors a base update adds to
stay as they were). Failures: ``background.py``. Memory: per staged fragment one float32 copy of the masters
the rank holds of it, a second one for a blend's scaled values (see README), plus the rounds' chunks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from yeto_patch.island.boundary.background import BackgroundLane
from yeto_patch.island.errors import EngineError


@dataclass
class StageJob:
    fragment: object               # boundary.fragment.Fragment
    version: int
    updates: int                   # base updates (0: an absolute base)
    sources: Optional[list]        # rank 0: source(index, offset, count) per update (or the one absolute base)
    alpha: Optional[float] = None  # rank 0: the blend's alpha (None: the base replaces the masters)
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: Optional[float] = None
    work_s: Optional[float] = None
    cpu_s: Optional[float] = None  # the worker thread's CPU time for it
    result: Optional[object] = None   # this rank's staging (masters.stage.StagedBase)
    nbytes: int = 0


class BaseLane(BackgroundLane):
    """`view`: the island's MasterView; `comm`: a dedicated IslandComm (its holder groups are made here:
    construction is collective)."""

    kind = "base"

    def __init__(self, view, comm, rank: int, timeout_s: float):
        self.view = view
        comm.subgroups(view.holder_sets())
        super().__init__(comm, rank, timeout_s, "yeto-base-stage")

    def submit(self, frag, version: int, updates: int, sources, alpha=None) -> StageJob:
        """Every rank (rank 0 with the sources and the blend's alpha): queue the staging of fragment `frag`'s
        base `version`."""
        self.check()
        if frag.index in self.jobs:
            raise EngineError(f"internal: fragment {frag.index} has a base staged already")
        job = StageJob(frag, int(version), int(updates), sources, alpha)
        self._enqueue(frag.index, job)
        return job

    def take(self, f: int, what: str) -> StageJob:
        """Every rank, at the install rank 0 planned: fragment f's job once this rank's part ended (bounded);
        its failure is raised here (every rank waits for the same job)."""
        if f not in self.jobs:
            raise EngineError(f"internal: fragment {f} has no staged base")
        self._wait(lambda: self.jobs[f].result is not None, what)
        if self.error is not None:
            raise self.failure() from self.error
        with self._cv:
            return self.jobs.pop(f)

    def drop_all(self, what: str) -> None:
        """Every rank: wait for the jobs still running and forget them (the final cut replaces every base)."""
        self.wait_all(what)
        if self.error is not None:
            raise self.failure() from self.error
        with self._cv:
            self.jobs.clear()

    def _work(self, job: StageJob):
        staged = self.view.stage(job.fragment.entries, job.sources, self.comm,
                                 relative=(job.updates > 0) if self.rank == 0 else None, alpha=job.alpha)
        job.sources = None   # (rank 0: the decoded base's memory can go)
        job.nbytes = self.view.staged_bytes(staged)
        return staged
