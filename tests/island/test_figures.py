"""The island's boundary figures for the launcher's TensorBoard / W&B (yeto_patch/island/figures.py): which figures
a boundary-log record gives, the two writer kinds, and the relay from island rank 0 to the rank holding the writer
through a real torch.distributed store (HashStore: the same interface as the launcher's TCPStore). The real
launchers' event files are read by tests/launchers/test_mixed_islands.py."""
import numpy as np
import pytest
import torch.distributed as dist

from yeto_patch.island import figures as F
from yeto_patch.island.boundary.log import BoundaryLog
from yeto_patch.island.boundary.fragment import Push, PushPhase, PushWire
from yeto_patch.island.boundary.push_lane import Encoded, PushJob
from yeto_patch.island.boundary.push_encoder import PushEncoder
from yeto_patch.wire.values import merge_info


class TensorBoardLike:
    """Records what a SummaryWriter would be asked (add_scalar(tag, value, step), flush())."""
    def __init__(self):
        self.scalars, self.flushed = [], 0

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        self.flushed += 1


class WandbLike:
    """Records what the wandb module would be asked (define_metric, log(data, commit=False))."""
    def __init__(self):
        self.defined, self.logged = [], []

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))

    def log(self, data, step=None, commit=None):
        self.logged.append((dict(data), step, commit))


BOUNDARY = {"event": "boundary", "island": "a", "step": 12, "fragment": 1, "base_version": 3, "version": 4,
            "bytes": 4096, "pull_lag": 2, "wait_ms": 1.5, "installed": True, "mode": "blend", "delta_norm": 0.25,
            "codec": "int4", "send_ms": None}
MERGE = {"event": "merge", "island": "a", "step": 13, "fragment": 1, "version": 4, "weight": 0.5, "lag": 1,
         "islands": 2, "outer_lr": 0.7, "outer_grad_norm": 3.0}


def test_a_record_gives_its_figures_at_its_iteration():
    step, vals = F.scalars(BOUNDARY)
    assert step == 12
    assert vals == {"yeto/push_bytes": 4096.0, "yeto/delta_norm": 0.25, "yeto/base_version": 3.0,
                    "yeto/version": 4.0, "yeto/pull_lag_steps": 2.0, "yeto/wait_ms": 1.5, "yeto/fragment": 1.0}
    step, vals = F.scalars(MERGE)
    assert step == 13 and vals == {"yeto/staleness": 1.0, "yeto/merge_weight": 0.5, "yeto/outer_lr": 0.7,
                                   "yeto/outer_grad_norm": 3.0, "yeto/merge_islands": 2.0, "yeto/merged_version": 4.0}
    assert F.scalars({"event": "boundary", "step": "x", "bytes": 1}) is None
    assert F.scalars({"event": "nope", "step": 1, "bytes": 1}) is None
    assert F.scalars({"event": "merge", "step": 1, "weight": float("nan")}) is None


def test_the_syncers_merge_figures_are_bounded():
    assert merge_info({"merge": {"weight": 0.5, "lag": 1, "islands": 2, "outer_lr": 0.7,
                                 "outer_grad_norm": 3.0}}) == {"weight": 0.5, "lag": 1, "islands": 2,
                                                               "outer_lr": 0.7, "outer_grad_norm": 3.0}
    for bad in ({"weight": 2.0}, {"lag": -1}, {"lag": 1.5}, {"outer_lr": float("nan")}, {"islands": True},
                {"weight": "0.5"}, "text", {f"k{i}": 1 for i in range(40)}):
        assert merge_info({"merge": bad}) is None, bad
    assert merge_info({}) is None


def test_tensorboard_gets_scalars_and_wandb_its_own_x_axis():
    tb, wb = TensorBoardLike(), WandbLike()
    w = F.Writers([tb, None, wb])
    assert w.describe() == ["tensorboard (TensorBoardLike)", "wandb (WandbLike)"]
    w.write(12, {"yeto/push_bytes": 4096.0})
    w.write(14, {"yeto/pull_lag_steps": 2.0})
    assert tb.scalars == [("yeto/push_bytes", 4096.0, 12), ("yeto/pull_lag_steps", 2.0, 14)]
    assert wb.defined == [("yeto/iteration", None), ("yeto/*", "yeto/iteration")]
    assert wb.logged == [({"yeto/push_bytes": 4096.0, "yeto/iteration": 12}, None, False),
                         ({"yeto/pull_lag_steps": 2.0, "yeto/iteration": 14}, None, False)]


def test_a_failing_writer_is_dropped_and_training_goes_on(caplog):
    class Broken(TensorBoardLike):
        def add_scalar(self, *a):
            raise OSError("disk full")
    tb, bad = TensorBoardLike(), Broken()
    w = F.Writers([bad, tb])
    w.write(1, {"yeto/x": 1.0})
    w.write(2, {"yeto/x": 2.0})
    assert tb.scalars == [("yeto/x", 1.0, 1), ("yeto/x", 2.0, 2)]
    assert sum("disk full" in r.getMessage() for r in caplog.records) == 1


def test_a_push_knows_the_norm_of_its_delta_and_the_boundary_record_says_it(tmp_path):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    enc = PushEncoder("int4", 256, x.size, piece_elems=256)
    enc.feed(x[:300])
    enc.feed(x[300:])
    body = enc.finish()
    assert body.delta_norm == pytest.approx(float(np.linalg.norm(x.astype(np.float64))), rel=1e-5)
    got = []
    blog = BoundaryLog(None, "a")            # no file: the sinks still get every record
    blog.add_sink(got.append)
    push = Push(step=5, base_version=1, steps=5, tokens=0, phase=PushPhase.AT_SYNCER)
    job = PushJob(None, push, None, 0.0, 16)
    wire = PushWire(body, "int4", job.figures(Encoded(body, 0.0, 0.0), 6), send_ms=3.0)
    blog.installed(7, 0, 2, "replace", "answer", 1.0, 0, push, wire)
    assert got[0]["event"] == "boundary" and got[0]["delta_norm"] == body.delta_norm and "body" not in got[0]
    assert F.scalars(got[0])[1]["yeto/delta_norm"] == body.delta_norm


def _pair(monkeypatch, store):
    """rank 0 (producer) and rank 1 (consumer, holds the writer) of one job, sharing the job's store."""
    ranks = {}

    def fake_store_for(rank):
        return lambda: (store, rank, 2)
    producer, consumer = F.Relay(3), F.Relay(3)
    tb = TensorBoardLike()
    monkeypatch.setattr(F, "_store", fake_store_for(1))
    consumer.see_writers(lambda: [tb, None])
    monkeypatch.setattr(F, "_store", fake_store_for(0))
    producer.see_writers(lambda: [None, None])            # rank 0 holds no writer (Megatron: the last rank does)
    blog = BoundaryLog(None, "a")
    producer.attach(blog)
    ranks.update(producer=producer, consumer=consumer, tb=tb, blog=blog)
    return ranks


def test_rank_zeros_figures_reach_the_rank_with_the_writer_through_the_jobs_store(monkeypatch):
    store = dist.HashStore()
    r = _pair(monkeypatch, store)
    assert r["consumer"].is_consumer and not r["producer"].is_consumer and r["producer"].consumer == 1
    r["blog"].write("boundary", **{k: v for k, v in BOUNDARY.items() if k not in ("event", "island")})
    assert r["consumer"].drain() == 1 and r["consumer"].drain() == 0
    assert ("yeto/push_bytes", 4096.0, 12) in r["tb"].scalars
    r["blog"].write("merge", **{k: v for k, v in MERGE.items() if k not in ("event", "island")})
    r["blog"].write("final", step=14, versions=[4, 4], seconds=0.5)
    assert r["consumer"].drain(final=True, wait_s=5) == 2
    tags = {t for t, _, _ in r["tb"].scalars}
    assert {"yeto/merge_weight", "yeto/staleness", "yeto/outer_lr", "yeto/final_cut_seconds"} <= tags
    assert r["tb"].flushed == 1
    assert not store.check(["yeto_patch/figures/3/1"])     # read records are deleted from the store


def test_nobody_holds_a_writer_nothing_is_published(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(F, "_store", lambda: (store, 0, 2))
    producer = F.Relay(0)
    producer.see_writers(lambda: [None])
    blog = BoundaryLog(None, "a")
    producer.attach(blog)
    blog.write("boundary", step=3, bytes=10)
    assert producer.consumer is None and not store.check(["yeto_patch/figures/0/n"])


def test_the_backlog_is_bounded_when_the_writer_rank_reads_nothing(monkeypatch, caplog):
    store = dist.HashStore()
    monkeypatch.setattr(F, "MAX_BACKLOG", 8)
    r = _pair(monkeypatch, store)
    for i in range(20):
        r["blog"].write("boundary", step=i, bytes=1)
    assert int(store.add("yeto_patch/figures/3/n", 0)) == 8
    assert sum("records behind" in x.getMessage() for x in caplog.records) == 1
    assert r["consumer"].drain() == 8
    r["blog"].write("boundary", step=21, bytes=1)             # room again
    assert r["consumer"].drain() == 1


def test_a_store_that_fails_turns_the_figures_off_and_never_training(monkeypatch, caplog):
    class Broken:
        def compare_set(self, *a):
            raise RuntimeError("store gone")
    monkeypatch.setattr(F, "_store", lambda: (Broken(), 1, 2))
    relay = F.Relay(0)
    relay.see_writers(lambda: [TensorBoardLike()])      # no exception reaches the training step
    assert not relay.enabled and relay.drain(final=True) == 0
    assert any("store gone" in r.getMessage() for r in caplog.records)
