"""One push must not wreck the global model (issue 13): a push far outside what its fragment has seen is refused
(code outlier), a merge whose result would be unusable is refused, and an unusable checkpoint is refused at
--resume."""
import numpy as np
import pytest

from yeto_patch.syncer.model.checkpoint import CheckpointError, CheckpointWriter
from yeto_patch.syncer.model.guard import NormGuard, PushStats
from yeto_patch.syncer.model.outer import USABLE_MAX
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.syncer.model.snapshot import capture
from yeto_patch.syncer.net.server import ServerConfig, SyncerServer
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


def test_the_guard_judges_a_push_against_the_other_islands_history():
    g = NormGuard(10.0)
    base = np.full(1024, 0.5, np.float32)
    first = g.base_norm(0, 0, base)      # norm 16, densest block rms 0.5
    assert (first.norm, first.peak) == (pytest.approx(16.0), pytest.approx(0.5)) and not g.needs_base_norm(0)

    def stats(x, island):
        return g.measure("f32", x.astype(np.float32).tobytes(), x.size, 256, cold=(0, island, base, False))
    # cold start (nobody pushed yet): refused when, applied alone, it would leave the base above 2 x its first norm
    assert "no other island has pushed yet" in g.admit(0, stats(-1.1 * base, "b"), "b", first)   # 2.1 x
    big_but_harmless = np.random.default_rng(0).standard_normal(1024) * 0.8   # norm 25.6 > 16, orthogonal-ish
    st = stats(big_but_harmless, "a")
    assert st.norm > first.norm and st.grown < 2 * first.norm
    assert g.admit(0, st, "a", first) is None
    ref = g.reference(0, "b")
    assert ref == PushStats(st.norm, st.peak) and g.reference(0, "a") is None
    assert stats(big_but_harmless, "b").grown is None   # b has a reference now: no pass over the base
    assert g.admit(0, PushStats(10.1 * st.norm, st.peak), "b", 0.0) is not None    # 10 x a's median norm
    assert g.admit(0, PushStats(st.norm, 10.1 * st.peak), "b", 0.0) is not None    # 10 x a's densest block
    assert g.admit(0, PushStats(9 * st.norm, 9 * st.peak), "b", 0.0) is None
    assert g.admit(0, PushStats(0.0, 0.0), "b", 0.0) is None   # zero pushes pass and stay out of the history
    for _ in range(20):   # b's own history never raises b's bound
        assert g.admit(0, PushStats(9.9 * st.norm, 9.9 * st.peak), "b", 0.0) is None
    assert g.reference(0, "b") == PushStats(st.norm, st.peak)
    msg = g.admit(0, PushStats(11 * st.norm, 0.1), "c\nforged line", 0.0)
    assert msg is not None and "other islands" in msg
    assert g.admit(1, PushStats(1e9, 1e9), "a", PushStats(0.0, 0.0)) is None   # nothing yet, zero base: no bound
    assert NormGuard(0).measure("f32", np.zeros(4, np.float32).tobytes(), 4, 256) is None


def test_a_lone_island_cannot_walk_the_base_up_unless_it_is_the_runs_only_island():
    """While no other island pushed, the cold-start bound is relative to the base as first seen: pushes alone,
    round after round, cannot grow it past --first-push-growth times. In a run of one island (nobody to protect,
    its weights may grow over a long run) it is relative to the current base: no single push multiplies it."""
    base0 = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    for single in (False, True):
        g = NormGuard(10.0, first_growth=2.0, single=single)
        first = g.base_norm(0, 0, base0)
        base, accepted = base0.copy(), 0
        for _ in range(12):   # each push applied alone makes the base 1.2 x larger
            x = -0.2 * base
            st = g.measure("f32", x.tobytes(), x.size, 256, cold=(0, "a", base, False))
            if g.admit(0, st, "a", first) is not None:
                break
            base, accepted = base - x, accepted + 1
        if single:
            assert accepted == 12   # slow growth passes
            x = -1.5 * base   # ... a push that would leave 2.5 x does not
            assert g.admit(0, g.measure("f32", x.tobytes(), x.size, 256, cold=(0, "a", base, False)), "a", 0.0) is not None
        else:
            assert accepted == 3 and np.linalg.norm(base) <= 2 * first.norm   # 1.2 ** 4 > 2


@pytest.mark.parametrize("codec", ["f32", "bf16", "int8", "int4", "int4-log", "int1", "topk:0.05+int2",
                                   "topk:0.1+int8"])
def test_push_stats_match_the_decoded_values(codec):
    from yeto_patch.syncer.model.guard import push_stats
    from yeto_patch.syncer.model.runner import ChunkRunner
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    x[300:310] *= 50   # one dense block
    body = codecs.encode(codec, x, 64)
    d = codecs.decode(codec, body, x.size, 64).astype(np.float64)
    block = 256 if codec in ("f32", "bf16") else 64
    rms = [np.sqrt(np.mean(d[i:i + block] ** 2)) for i in range(0, d.size, block)]
    st = push_stats(codec, body, x.size, 64, ChunkRunner(2))
    assert st.norm == pytest.approx(np.linalg.norm(d), rel=1e-5) and st.peak == pytest.approx(max(rms), rel=1e-5)


def test_a_first_push_cannot_multiply_the_base():
    """Issue 26, finding 4 (a): before any other island pushed, a push that, applied alone, would leave the base
    with more than --first-push-growth (2) times its norm is refused, so an island pushing first cannot push -5 x
    the base (it grew the base's norm 3.5x in one round under the old cold start of 10 x)."""
    server, addr = make_server(islands=2, fragments=1)
    with running(server):
        values = init_values()
        (a, b), ws, layout, _ = join_all(addr, ["a", "b"], values)
        base = fragment_flat(values, layout, 0)
        with pytest.raises(SyncerRefusal) as e:
            push(b, 0, 0, -5.0 * base)
        assert e.value.code == "outlier" and "no other island has pushed yet" in e.value.message
        assert "applied alone it would leave the base with norm" in e.value.message
        assert server.coord.rounds[0].answers == {}   # nothing folded
        n = ws[0].numels[0]
        assert push(a, 0, 0, small(n, 1)).status == "accepted" and push(b, 0, 0, small(n, 2)).status == "accepted"
        got = a.wait_base(0, 1, 20)
        assert np.linalg.norm(got.values) < 1.01 * np.linalg.norm(base)
        for c in (a, b):
            c.close()


@pytest.mark.parametrize("colluders", [1, 2])
def test_colluders_cannot_walk_their_bound_up(colluders):
    """Issue 26, finding 4 (b): each round the colluders push the largest push the syncer still accepts; judged
    against the honest island's history (never their own, nor only each other's), their pushes stay within
    --max-push-norm-ratio (10) x the honest norm round after round (one colluder among 2 islands, two among 3;
    under the old median of all accepted pushes they walked to 50 x in 10 rounds)."""
    names = ["honest"] + [f"x{i}" for i in range(colluders)]
    server, addr = make_server(islands=len(names), fragments=1, rounds={"grace_s": 0.0})
    with running(server):
        cs, ws, layout, _ = join_all(addr, names)
        n = ws[0].numels[0]
        rng = np.random.default_rng(7)
        honest, ratios = [], []
        for v in range(10):
            h = small(n, 100 + v)
            honest.append(float(np.linalg.norm(h)))
            assert push(cs[0], 0, v, h).status == "accepted"
            for c in cs[1:]:
                d = rng.standard_normal(n)
                d /= np.linalg.norm(d)
                scale = 2000.0 * honest[-1]   # from far above, down by 1.25 until accepted (refusals cost nothing)
                while True:
                    try:
                        push(c, 0, v, (d * scale).astype(np.float32))
                    except SyncerRefusal as e:
                        assert e.code == "outlier", e
                        scale /= 1.25
                        continue
                    break
                ratios.append(scale / float(np.median(honest)))
            cs[0].wait_base(0, v + 1, 20)
        assert max(ratios) <= 10.0 * 1.1, ratios   # (the honest norms vary a little from round to round)
        assert min(ratios[-colluders:]) > 10.0 / 1.25 / 1.1, ratios   # (and the colluders did reach the bound)
        for c in cs:
            c.close()


def test_a_push_concentrated_in_one_value_is_refused():
    """Issue 26, finding 4 (c): one non-zero value carrying 9 x the honest norm passes a total-norm bound of 10 x
    but is 9 * sqrt(numel) / 16 times denser than an honest block: refused by the per-block bound."""
    server, addr = make_server(islands=2, fragments=1)
    with running(server):
        (a, b), ws, layout, _ = join_all(addr, ["a", "b"])
        n = ws[0].numels[0]
        for v in range(2):   # some honest history on both sides
            assert push(a, 0, v, small(n, 10 + v)).status == "accepted"
            assert push(b, 0, v, small(n, 20 + v)).status == "accepted"
            a.wait_base(0, v + 1, 20)
        spike = np.zeros(n, np.float32)
        spike[123] = 9.0 * np.linalg.norm(small(n, 10))
        assert push(a, 0, 2, small(n, 12)).status == "accepted"
        with pytest.raises(SyncerRefusal) as e:
            push(b, 0, 2, spike)
        assert e.value.code == "outlier" and "densest block" in e.value.message and "norm" not in \
            e.value.message.split("refused as an outlier:")[1].split("densest")[0]
        assert push(b, 0, 2, small(n, 22)).status == "accepted"
        got = a.wait_base(0, 3, 20)
        assert np.abs(got.values).max() < 10
        for c in (a, b):
            c.close()


def test_first_round_pushes_are_judged_among_themselves_and_never_become_a_later_reference():
    """Streaming fragments in warm-up (issue 24): a fragment's first round covers 1-2 inner steps at lr ~0, so its
    pushes are 50x below the next rounds'. They are judged against the other islands' first-round pushes (so the
    first round is bounded by the others too, issue 26) and are not the reference of later rounds (else island
    b's first push would make a's ordinary second push an outlier)."""
    g = NormGuard(10.0)
    tiny, ordinary = PushStats(0.015, 0.001), PushStats(0.8, 0.05)
    assert g.admit(0, tiny, "a", first_round=True) is None
    assert g.admit(0, PushStats(1.0, 0.05), "b", first_round=True) is not None   # 10 x a's first round
    assert g.admit(0, tiny, "b", first_round=True) is None
    assert g.reference(0, "a") is None and g.reference(0, "a", first_round=True).norm == pytest.approx(0.015)
    assert g.admit(0, ordinary, "a") is None          # round 2: (before: 0.8 > 10 x b's 0.015, refused)
    assert g.admit(0, ordinary, "b") is None
    assert g.reference(0, "a").norm == pytest.approx(0.8)
    assert g.admit(0, PushStats(9.0, 0.05), "b") is not None    # still an outlier guard
