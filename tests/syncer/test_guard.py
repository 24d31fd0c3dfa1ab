"""One push must not wreck the global model (issue 13): a push far outside what its fragment has seen is refused
(code outlier), a merge whose result would be unusable is refused, and an unusable checkpoint is refused at
--resume."""
import numpy as np
import pytest

from yeto_patch.syncer.checkpoint import CheckpointError, CheckpointWriter
from yeto_patch.syncer.guard import NormGuard
from yeto_patch.syncer.outer import USABLE_MAX
from yeto_patch.syncer.rounds import Coordinator
from yeto_patch.syncer.settings import MergeSettings, RoundSettings
from yeto_patch.syncer.snapshot import capture
from yeto_patch.syncer.server import ServerConfig, SyncerServer
from yeto_patch.wire import codecs
from yeto_patch.wire.client import SyncerRefusal

from .helpers import KEY, MANIFEST, fragment_flat, init_values, join_all, make_server, running
from .reference import RefFragment

pytestmark = pytest.mark.timeout(60)


def huge_int4log(numel, scale=2.9e38, block=256):
    """An int4-log push that passes the codec checks (scales <= 3e38) with every value at +scale."""
    nb = -(-numel // block)
    return np.concatenate([np.full(nb, scale, np.float32).view(np.uint8),
                           np.full(-(-numel // 2), 0x77, np.uint8)]).tobytes()


def small(n, seed):
    return (np.random.default_rng(seed).standard_normal(n) * 0.01).astype(np.float32)


def push(c, f, v, d):
    return c.push(f, base_version=v, local_step=1, steps=1, tokens=1, codec="f32", body=codecs.encode("f32", d),
                  wait=True)


def test_huge_int4log_push_is_refused_and_later_rounds_merge():
    server, addr = make_server(islands=2, fragments=3)
    with running(server):
        values = init_values()
        (a, b), ws, layout, _ = join_all(addr, ["a", "b"], values)
        n = ws[0].numels[0]
        ref = RefFragment(fragment_flat(values, layout, 0))
        for v in range(4):
            da, db = small(n, 10 + v), small(n, 20 + v)
            assert push(a, 0, v, da).status == "accepted"
            with pytest.raises(SyncerRefusal) as e:
                b.push(0, base_version=v, local_step=1, steps=1, tokens=1, codec="int4-log",
                       body=huge_int4log(n), wait=True)
            assert e.value.code == "outlier" and "norm" in str(e.value)
            assert server.coord.versions()[0] == v  # nothing merged, nothing folded
            assert push(b, 0, v, db).status == "accepted"  # b's good push answers the same round
            ref.merge([(da, 1.0), (db, 1.0)])
            got = a.wait_base(0, v + 1, 20)
            assert got.version == v + 1 and np.array_equal(got.values, ref.base)
            assert np.isfinite(got.values).all() and np.abs(got.values).max() < 100
        assert server.coord.guard.refused == 4
        for c in (a, b):
            c.close()


def test_merge_whose_result_would_be_unusable_is_refused_without_the_guard():
    server, addr = make_server(islands=2, fragments=3, max_push_norm_ratio=0)
    with running(server):
        values = init_values()
        (a, b), ws, layout, _ = join_all(addr, ["a", "b"], values)
        n = ws[0].numels[0]
        assert push(a, 0, 0, small(n, 1)).status == "accepted"
        r = b.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="int4-log", body=huge_int4log(n),
                   wait=True)
        assert r.status == "accepted"  # finite and within the codec's range: only the merge can tell
        deadline = server.coord.clock() + 10
        while not server.records and server.coord.clock() < deadline:
            a.wait_event(0.05)
        rec = server.records[-1]
        assert not rec.ok and "above" in rec.reason
        f0 = server.coord.frags[0]
        assert f0.version == 0 and np.array_equal(f0.t.base, fragment_flat(values, layout, 0))
        assert not f0.t.momentum.any()
        da, db = small(n, 2), small(n, 3)  # the islands push again: the next round merges
        assert push(a, 0, 0, da).status == "accepted" and push(b, 0, 0, db).status == "accepted"
        got = a.wait_base(0, 1, 20)
        ref = RefFragment(fragment_flat(values, layout, 0))
        ref.merge([(da, 1.0), (db, 1.0)])
        assert np.array_equal(got.values, ref.base) and np.abs(f0.t.base).max() <= USABLE_MAX
        for c in (a, b):
            c.close()


@pytest.mark.parametrize("bad", [np.nan, 1e35])
def test_unusable_checkpoint_is_refused_at_resume(tmp_path, bad):
    coord = Coordinator(MergeSettings(), RoundSettings())
    coord.set_manifest(MANIFEST, 3)
    values = init_values()
    for f in range(3):
        coord.init_fragment(f, fragment_flat(values, coord.layout, f))
    coord.frags[1].t.momentum[7] = bad
    path = str(tmp_path / "s.ckpt")
    CheckpointWriter(path).save(capture(coord, {"final": False}), background=False)
    cfg = ServerConfig(listen="127.0.0.1:0", fragments=3, key=KEY, checkpoint=path, resume=True)
    with pytest.raises(CheckpointError) as e:
        SyncerServer(cfg)
    assert "not usable" in str(e.value) and "fragment 1 momentum" in str(e.value) and "element 7" in str(e.value)


def test_guard_limits_follow_the_recent_median():
    g = NormGuard(10.0)
    assert g.admit(0, 5.0, "a", base_norm=1.0) is None        # no history: 10 x max(base norm, history)
    assert g.admit(0, 60.0, "a", base_norm=1.0) is not None   # above 10 x 5
    assert g.admit(0, 0.0, "a", base_norm=1.0) is None        # zero pushes pass and do not enter the history
    for x in (1.0, 1.0):
        assert g.admit(0, x, "b", base_norm=1.0) is None
    assert g.limit(0, 1.0) == pytest.approx(10.0)             # median of [5, 1, 1]
    assert g.admit(0, 11.0, "c\nforged line", base_norm=1.0) is not None
    assert g.admit(1, 1e9, "a", base_norm=0.0) is None        # no history, zero base: no bound (merge checks)
    assert NormGuard(0).measure("f32", np.zeros(4, np.float32).tobytes(), 4, 256) is None


def test_first_round_pushes_do_not_set_the_scale():
    """Streaming fragments in warm-up (issue 24): a fragment's first round covers 1-2 inner steps at lr ~0, so its
    pushes are 50x below the next rounds'; they are checked (base-norm rule) but do not become the median."""
    g = NormGuard(10.0)
    for island in ("a", "b"):   # round 1 (relative to the initial base v0): tiny
        assert g.admit(0, 0.015, island, base_norm=3.0, scale=False) is None
    assert g.admit(0, 0.8, "a", base_norm=3.0) is None        # round 2: 10 x max(base norm, history)
    assert g.admit(0, 0.8, "b", base_norm=3.0) is None        # (before: median(0.015, 0.015, 0.8) -> refused)
    assert g.admit(0, 0.9, "a", base_norm=3.0) is None
    assert g.limit(0, 3.0) == pytest.approx(8.0)              # the median of the later rounds only
    assert g.admit(0, 9.0, "b", base_norm=3.0) is not None    # still an outlier guard
    assert g.admit(0, 1e4, "b", base_norm=3.0, scale=False) is not None   # first-round pushes are checked too
