"""PushLane with a stand-in view (no torch.distributed): submit returns at once (host masters are copied on a
snapshot thread, which the next update waits for; device masters on the caller), the gather and the encoding run
on the worker, finished pushes come out in boundary order with their bodies, a stage that falls behind is named
with its rate, and a failed stage (a failed snapshot copy included) is raised on rank 0 (other ranks leave it to
rank 0, which raises it inside the island's plan)."""
import threading
import time

import numpy as np
import pytest

from yeto_patch.island.errors import EngineError
from yeto_patch.island.boundary.fragment import Fragments
from yeto_patch.island.boundary.push_lane import NOTHING, PushLane


class Buf:
    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


class View:
    """snapshot_delta/gather of a stand-in: the gather feeds 4 pieces of ones, each after `release` is set."""

    def __init__(self, fail=None, host=False, copy_release=None, copy_fail=None):
        self.release = threading.Event()
        self.fail, self.host, self.copy_release, self.copy_fail = fail, host, copy_release, copy_fail
        self.snapshots, self.copied_on = [], []

    def host_masters(self, entries):
        return self.host

    def own_numel(self, entries):
        return 10 * len(entries)

    def snapshot_delta(self, entries, spare=None):
        if self.copy_release is not None:
            assert self.copy_release.wait(10)
        if self.copy_fail:
            raise RuntimeError(self.copy_fail)
        self.copied_on.append(threading.current_thread().name)
        self.snapshots.append(list(entries))
        self.spares = getattr(self, "spares", []) + [spare]
        return {(e, 0): (0, 10, Buf(10)) for e in entries}

    @staticmethod
    def snapshot_buffer(snap):
        return next(iter(snap.values()))[2] if snap else None

    def gather(self, entries, snap, sink, comm):
        snap.get((entries[0], 0))   # (what MasterView.gather reads first)
        for _ in range(4):
            assert self.release.wait(10)
            if self.fail:
                raise RuntimeError(self.fail)
            if sink is not None:
                sink(entries[0], 0, np.ones(5, np.float32))


class Encoder:
    encode_s = 0.001

    def __init__(self):
        self.values = []

    def feed(self, arr):
        self.values.append(arr.copy())

    def finish(self):
        return np.concatenate(self.values)


def frags():
    fs = Fragments([[0], [1]], [20, 20], [20, 20])
    for st in fs:
        st.installed(3)
        st.count(7)
    return fs


def submit(lane, frag, step):
    return lane.submit(frag, frag.begin_push(step))


def test_submit_returns_at_once_and_the_push_comes_out_when_its_stage_ends():
    view, fs = View(), frags()
    p = PushLane(view, None, 0, lambda st: Encoder(), timeout_s=10)
    t0 = time.perf_counter()
    job = submit(p, fs[1], 12)
    assert time.perf_counter() - t0 < 0.5 and view.snapshots == [[1]]
    assert (job.push.base_version, job.push.steps, job.push.tokens, job.nbytes) == (3, 1, 7, 40)
    assert 1 in p.jobs and p.take_finished() == []
    time.sleep(0.1)
    assert "background gather/encode: 0 of 20 values" in p.behind(1)
    view.release.set()
    p.wait_all("test")
    (done,) = p.take_finished()
    body, gather_s, encode_s = done.result
    assert done is job and body.size == 20 and 1 not in p.jobs and gather_s >= 0
    p.close()


def test_pushes_come_out_in_boundary_order():
    view, fs = View(), frags()
    view.release.set()
    p = PushLane(view, None, 0, lambda st: Encoder(), timeout_s=10)
    submit(p, fs[0], 4)
    submit(p, fs[1], 6)
    p.wait_all("test")
    assert [j.fragment.index for j in p.take_finished()] == [0, 1]
    assert view.spares[0] is None
    fs[0].installed(4)
    submit(p, fs[0], 12)   # a spent snapshot's buffer is reused by the next push (no fresh pages to fault in)
    assert view.spares[-1] is not None
    p.close()


def test_a_failed_stage_is_raised_on_rank_0_and_left_to_rank_0_elsewhere():
    for rank in (0, 1):
        view, fs = View(fail="disk on fire"), frags()
        p = PushLane(view, None, rank, (lambda st: Encoder()) if rank == 0 else None, timeout_s=10)
        submit(p, fs[0], 4)
        view.release.set()
        if rank == 0:
            with pytest.raises(EngineError, match="background push stage failed: disk on fire"):
                p.wait_all("test")
            with pytest.raises(EngineError, match="disk on fire"):
                p.take_finished()
        else:
            p.wait_all("test")            # returns: rank 0 raises it for the island
            assert p.take_finished() == [] and "disk on fire" in str(p.error)
        p.close()


def test_a_stage_that_never_ends_is_bounded_by_the_timeout():
    view, fs = View(), frags()
    p = PushLane(view, None, 0, lambda st: Encoder(), timeout_s=0.5)
    submit(p, fs[0], 4)
    with pytest.raises(EngineError, match="did not finish within 0.5s"):
        p.wait_all("the final cut")
    view.release.set()
    p.close()


def test_host_masters_are_copied_beside_training_and_the_next_update_waits_for_the_copy():
    copy = threading.Event()
    view, fs = View(host=True, copy_release=copy), frags()
    view.release.set()
    p = PushLane(view, None, 0, lambda st: Encoder(), timeout_s=0.5)
    t0 = time.perf_counter()
    submit(p, fs[0], 4)
    assert time.perf_counter() - t0 < 0.2 and view.snapshots == []   # nothing copied on the caller
    assert "its snapshot copy" in p.behind(0)
    with pytest.raises(EngineError, match="step 5: the snapshot of fragment 0's push did not finish within 0.5s"):
        p.wait_snapshots("step 5")
    copy.set()
    p.wait_snapshots("step 5")
    assert view.copied_on == ["yeto-push-snapshot"] and view.snapshots == [[0]]
    p.wait_all("test")
    (done,) = p.take_finished()
    assert done.result.body.size == 20
    p.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_snapshot_copy_fails_the_push_stage(rank):
    view, fs = View(host=True, copy_fail="page fault storm"), frags()
    view.release.set()
    p = PushLane(view, None, rank, (lambda st: Encoder()) if rank == 0 else None, timeout_s=10)
    submit(p, fs[0], 4)
    p.wait_snapshots("step 5")              # the copy ended (failed): the update may go on
    if rank == 0:
        with pytest.raises(EngineError, match="push stage failed: the snapshot copy failed: page fault storm"):
            p.wait_all("test")
    else:
        p.wait_all("test")
        assert "page fault storm" in str(p.error)
    p.close()


def test_other_ranks_release_a_push_once_rank_0_handed_it_and_wait_for_their_part():
    view, fs = View(), frags()
    p = PushLane(view, None, 1, None, timeout_s=0.5)
    submit(p, fs[0], 4)
    submit(p, fs[1], 4)
    with pytest.raises(EngineError, match="the push of fragment 0: the background push stage did not finish"):
        p.release(0, "the push of fragment 0")
    view.release.set()
    p.wait_for([0], "test")   # fragment 0's job and those before it
    p.release(0, "the push of fragment 0")
    assert list(p.jobs) == [1] and fs[0].push is not None
    p.wait_for(None, "test")
    assert p.jobs[1].result is NOTHING
    with pytest.raises(EngineError, match="no push in the lane to release"):
        p.release(0, "again")
    p.close()


def test_the_push_figures_name_what_its_log_record_reports():
    view, fs = View(), frags()
    view.release.set()
    p = PushLane(view, None, 0, lambda st: Encoder(), timeout_s=10)
    job = submit(p, fs[0], 4)
    p.note_boundary(0, 0.012)
    p.wait_all("test")
    fig = job.figures(job.result, handed_at=5)
    assert fig["bytes"] == 80 and fig["boundary_ms"] == 12.0 and fig["handed_at"] == 5 and fig["own_bytes"] == 40
    p.close()
