"""BaseLane with a stand-in view (no torch.distributed): submit returns at once, the staging runs on the worker
in submission order, take() hands each rank its own part (waiting for it, bounded), and a failed stage is raised
by every rank that takes the job (and by rank 0 inside the plan, check()), naming the stage and the cause."""
import threading

import pytest

from yeto_patch.island.boundary.base_lane import BaseLane
from yeto_patch.island.errors import EngineError
from yeto_patch.island.boundary.fragment import Fragments


class Comm:
    def __init__(self):
        self.groups = []

    def subgroups(self, sets):
        self.groups.extend(sets)


class View:
    def __init__(self, fail=None):
        self.release = threading.Event()
        self.fail, self.calls = fail, []

    def holder_sets(self):
        return [(0, 1)]

    def stage(self, entries, sources, comm, relative=None, alpha=None):
        assert self.release.wait(10)
        if self.fail:
            raise RuntimeError(self.fail)
        self.calls.append((list(entries), None if sources is None else len(sources), relative, alpha))
        return [(entries[0], 0, 0, 4, 0, "values")]

    def staged_bytes(self, staged):
        return 16 * len(staged)


def frags():
    return Fragments([[0], [1]], [4, 4], [4, 4])


def test_staging_runs_beside_the_caller_in_order_and_take_gives_this_ranks_part():
    view, comm = View(), Comm()
    s = BaseLane(view, comm, 0, timeout_s=10)
    assert comm.groups == [(0, 1)]                      # the holder groups exist on the stager's own comm
    fs = frags()
    s.submit(fs[1], 3, 0, ["full"])
    s.submit(fs[0], 5, 2, ["u1", "u2"], 0.5)
    assert not s.finished(1) and 0 in s.jobs             # returned before any staging ran
    with pytest.raises(EngineError, match="has a base staged already"):
        s.submit(fs[1], 4, 0, ["full"])
    view.release.set()
    job = s.take(1, "the staged base v3 of fragment 1")
    assert (job.version, job.updates, job.result, job.nbytes) == (3, 0, [(1, 0, 0, 4, 0, "values")], 16)
    assert job.sources is None                          # the decoded base's memory is released once staged
    s.take(0, "v5")
    assert view.calls == [([1], 1, False, None), ([0], 2, True, 0.5)] and not s.jobs   # (alpha: a blend's)
    s.close()


def test_take_waits_for_the_part_of_this_rank_bounded_by_the_timeout():
    view = View()
    s = BaseLane(view, Comm(), 1, timeout_s=0.5)
    s.submit(frags()[0], 2, 0, None)
    with pytest.raises(EngineError, match="did not finish within 0.5s"):
        s.take(0, "the staged base v2 of fragment 0")
    view.release.set()
    assert s.take(0, "again").result
    s.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_staging_is_raised_by_every_rank_that_takes_it(rank):
    view = View(fail="the holder's buffer is gone")
    view.release.set()
    s = BaseLane(view, Comm(), rank, timeout_s=10)
    s.submit(frags()[0], 2, 0, ["full"] if rank == 0 else None)
    with pytest.raises(EngineError, match="background base stage failed: the holder's buffer is gone"):
        s.take(0, "the staged base v2 of fragment 0")
    if rank == 0:   # inside the plan too (check): rank 0's error reaches every rank through the plan
        with pytest.raises(EngineError, match="background base stage failed"):
            s.check()
    else:
        s.check()   # another rank only logs: raising alone could leave the others in a collective
    with pytest.raises(EngineError, match="background base stage failed"):
        s.drop_all("the final cut")
