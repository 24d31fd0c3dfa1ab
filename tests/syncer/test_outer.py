import numpy as np
import pytest

from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.model.outer import FragmentTensors, NonFiniteMerge, OuterOptimizer

from .reference import RefFragment

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("kind,delay", [("nesterov", 1), ("avg", 1), ("delayed-nesterov", 3),
                                        ("delayed-nesterov", 1)])
def test_outer_matches_reference(kind, delay):
    rng = np.random.default_rng(0)
    n = 3000
    base0 = rng.standard_normal(n).astype(np.float32)
    opt = OuterOptimizer(kind, delay=delay)
    ref = RefFragment(base0, kind, opt.lr, opt.momentum, delay)
    t = FragmentTensors(base0.copy())
    runner = ChunkRunner(threads=2, chunk=1000)
    for v in range(1, 8):
        deltas = [(rng.standard_normal(n).astype(np.float32) * 0.01, 1.0) for _ in range(3)]
        acc = np.zeros(n, np.float32)
        for d, _ in deltas:
            acc += d
        g = ref.merge(deltas)
        norm = opt.step(t, acc, 3.0, v, runner)
        assert np.array_equal(t.base, ref.base)
        assert np.isclose(norm, float(np.linalg.norm(g.astype(np.float64))))
        if opt.uses_momentum:
            assert np.array_equal(t.momentum, ref.m)
    if kind == "avg":
        assert t.momentum is None


def test_delayed_nesterov_one_equals_nesterov():
    rng = np.random.default_rng(1)
    b = rng.standard_normal(500).astype(np.float32)
    t1, t2 = FragmentTensors(b.copy()), FragmentTensors(b.copy())
    o1, o2 = OuterOptimizer("nesterov"), OuterOptimizer("delayed-nesterov", delay=1)
    r = ChunkRunner(1)
    for v in range(1, 5):
        g = rng.standard_normal(500).astype(np.float32)
        o1.step(t1, g.copy(), 1.0, v, r)
        o2.step(t2, g.copy(), 1.0, v, r)
    assert np.array_equal(t1.base, t2.base) and np.array_equal(t1.momentum, t2.momentum)


def test_bit_identical_for_any_thread_count():
    rng = np.random.default_rng(2)
    n = 1_000_003
    b = rng.standard_normal(n).astype(np.float32)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    out = []
    for threads in (1, 2, 5):
        t = FragmentTensors(b.copy())
        opt = OuterOptimizer("delayed-nesterov", delay=2)
        r = ChunkRunner(threads, chunk=1 << 16)
        norms = [opt.step(t, g.copy(), 2.0, v, r) for v, g in enumerate(gs, 1)]
        r.close()
        out.append((t.base.tobytes(), t.momentum.tobytes(), t.delay_buf.tobytes(), norms))
    assert out[0] == out[1] == out[2]


def test_non_finite_result_leaves_state_unchanged():
    n = 10_000
    t = FragmentTensors(np.ones(n, np.float32))
    opt = OuterOptimizer("nesterov")
    r = ChunkRunner(2, chunk=1024)
    opt.step(t, np.full(n, 0.5, np.float32), 1.0, 1, r)
    before = (t.base.copy(), t.momentum.copy())
    acc = np.zeros(n, np.float32)
    acc[9000] = np.inf
    with pytest.raises(NonFiniteMerge):
        opt.step(t, acc, 1.0, 2, r)
    acc = np.zeros(n, np.float32)
    acc[5] = 3e38  # finite gradient whose update overflows the base
    with pytest.raises(NonFiniteMerge):
        opt.step(t, acc, 1.0 / 1e10, 2, r)
    assert np.array_equal(t.base, before[0]) and np.array_equal(t.momentum, before[1])
    # a finite gradient whose update overflows a huge base: caught by the second (would-be values) pass
    t.base[17] = np.float32(3.3e38)
    t.bound = None
    before = (t.base.copy(), t.momentum.copy())
    acc = np.zeros(n, np.float32)
    acc[17] = np.float32(-1e38)
    with pytest.raises(NonFiniteMerge, match="overflow"):
        opt.step(t, acc, 1.0, 2, r)
    assert np.array_equal(t.base, before[0]) and np.array_equal(t.momentum, before[1])
    # large but safe values take the checked path and give the same bits as the fast path
    t2 = FragmentTensors(before[0].copy(), before[1].copy())
    g = np.full(n, 1e-3, np.float32)
    opt.step(t, g.copy(), 1.0, 2, r)
    t2.base[17] = 1.0
    opt.step(t2, g.copy(), 1.0, 2, r)
    mask = np.arange(n) != 17
    assert np.array_equal(t.base[mask], t2.base[mask])


def test_bad_settings():
    with pytest.raises(ValueError):
        OuterOptimizer("adam")
    with pytest.raises(ValueError):
        OuterOptimizer("nesterov", momentum=1.0)
    with pytest.raises(ValueError):
        OuterOptimizer("avg", momentum=0.5)


def test_auto_lr_follows_the_inner_steps():
    """The syncer's default outer lr: 0.4 up to 10 inner steps, 0.7 from 50, linear between; each merge's
    step is bit for bit the step with that number; avg keeps 1.0; the config records "auto"."""
    from yeto_patch.syncer.model.outer import lr_for_steps
    assert [lr_for_steps(s) for s in (1, 10, 30, 50, 500)] == [0.4, 0.4, 0.55, 0.7, 0.7]
    rng = np.random.default_rng(3)
    b = rng.standard_normal(700).astype(np.float32)
    auto, r = OuterOptimizer("nesterov", "auto"), ChunkRunner(1)
    assert auto.config()["lr"] == "auto" and OuterOptimizer("avg", "auto").lr_at(10) == 1.0
    t_auto = FragmentTensors(b.copy())
    for v, steps in enumerate((10, 30, 50), 1):
        g = rng.standard_normal(700).astype(np.float32)
        fixed, t_fixed = OuterOptimizer("nesterov", lr_for_steps(steps)), FragmentTensors(t_auto.base.copy())
        t_fixed.momentum = None if t_auto.momentum is None else t_auto.momentum.copy()
        fixed.step(t_fixed, g.copy(), 1.0, v, r)
        auto.step(t_auto, g.copy(), 1.0, v, r, steps=steps)
        assert np.array_equal(t_auto.base, t_fixed.base) and np.array_equal(t_auto.momentum, t_fixed.momentum)
    assert auto.lr_at(None) == 0.7   # no steps to go by: the fixed default


def test_auto_lr_for_islands_that_blend():
    """Islands that blend bases in (tau > 0) damp every outer step already: 0.7 at any H."""
    from yeto_patch.syncer.model.outer import lr_for_steps
    assert [lr_for_steps(s, blended=True) for s in (1, 10, 50, 500)] == [0.7] * 4
    assert OuterOptimizer("nesterov", "auto").lr_at(10, blended=True) == 0.7
    assert OuterOptimizer("nesterov", 0.3).lr_at(10, blended=True) == 0.3   # an explicit lr is kept


def test_auto_lr_for_islands_that_started_from_pretrained_weights():
    """A fine-tune (its pushes say the run started from pretrained weights) takes 1.0 when its islands blend; the
    islands of the merge decide by majority (a tie counts as pretrained); islands that do not blend go by H."""
    from types import SimpleNamespace as P
    from yeto_patch.syncer.model.outer import LrInputs, lr_for_steps, outer_lr_inputs
    assert [lr_for_steps(s, blended=True, pretrained=True) for s in (1, 10, 500)] == [1.0] * 3
    assert lr_for_steps(10, blended=False, pretrained=True) == 0.4
    auto = OuterOptimizer("nesterov", "auto")
    assert auto.lr_at(10, True, True) == 1.0 and OuterOptimizer("nesterov", 0.5).lr_at(10, True, True) == 0.5

    def push(steps, blend=True, pretrained=True):
        return P(steps=steps, blend=blend, pretrained=pretrained)
    assert outer_lr_inputs([]) == LrInputs(None, False, False)
    assert outer_lr_inputs([push(10), push(12, pretrained=False)]) == LrInputs(11.0, True, True)
    assert outer_lr_inputs([push(10), push(10, pretrained=False), push(10, pretrained=False)]).pretrained is False
    assert outer_lr_inputs([P(steps=10, blend=True)]).pretrained is False   # a push that does not say: fresh
    # on the wire: a PUSH says it only when true, and only a JSON true counts
    from yeto_patch.syncer.rounds.pushes import parse_push
    from yeto_patch.wire.schema import push_meta
    meta = push_meta(0, 4, base_version=0, local_step=10, steps=10, tokens=10, codec="f32", block=256,
                     final=False, blend=True, patience=1.0, pretrained=True)
    assert meta["pretrained"] is True and parse_push("a", "1", meta, b"").pretrained is True
    assert "pretrained" not in push_meta(0, 4, base_version=0, local_step=10, steps=10, tokens=10, codec="f32",
                                         block=256, final=False, blend=True, patience=1.0)
    for bad in (1, "true", [True], None):
        assert parse_push("a", "1", {**meta, "pretrained": bad}, b"").pretrained is False
    b = np.random.default_rng(5).standard_normal(300).astype(np.float32)
    g = np.random.default_rng(6).standard_normal(300).astype(np.float32)
    t1, t2, r = FragmentTensors(b.copy()), FragmentTensors(b.copy()), ChunkRunner(1)
    auto.step(t1, g.copy(), 1.0, 1, r, steps=10, blended=True, pretrained=True)
    OuterOptimizer("nesterov", 1.0).step(t2, g.copy(), 1.0, 1, r)
    assert np.array_equal(t1.base, t2.base)


def test_momentum_warm_up_ramps_from_zero_to_the_momentum():
    """Outer momentum warm-up over K merges of a fragment: merge v uses mu * min(1, (v - 1) / K), i.e. the first
    merge is a plain lr * g step, the momentum then grows linearly and is full from merge K + 1 on; each merge is
    bit for bit the textbook update with that momentum (the buffer accumulates from the first merge on)."""
    from yeto_patch.syncer.model.outer import warmed_momentum
    assert [warmed_momentum(0.9, v, 3) for v in (1, 2, 3, 4, 9)] == [0.0, 0.3, 0.6, 0.9, 0.9]
    assert [warmed_momentum(0.9, v, 0) for v in (1, 2)] == [0.9, 0.9]
    rng = np.random.default_rng(4)
    b = rng.standard_normal(600).astype(np.float32)
    opt, t, r = OuterOptimizer("nesterov", 0.7, 0.9, momentum_warmup=3), FragmentTensors(b.copy()), ChunkRunner(2, 256)
    base, m = b.copy(), np.zeros_like(b)
    for v in range(1, 7):
        g = (rng.standard_normal(600) * 0.1).astype(np.float32)
        mu = np.float32(0.9 * min(1.0, (v - 1) / 3))
        m = mu * m + g
        base = base - np.float32(0.7) * (g + mu * m)
        opt.step(t, g.copy(), 1.0, v, r)
        assert np.array_equal(t.base, base) and np.array_equal(t.momentum, m), v
    assert opt.config()["momentum_warmup"] == 3 and OuterOptimizer(momentum_warmup=0).config()["momentum_warmup"] == 0
    assert "momentum_warmup" not in OuterOptimizer("nesterov").config()   # the default: old checkpoints resume
    assert OuterOptimizer("avg", momentum_warmup=5).momentum_warmup == 0   # nothing to warm up
    for bad in (-1, 1.5, 10**7):
        with pytest.raises(ValueError):
            OuterOptimizer("nesterov", momentum_warmup=bad)
