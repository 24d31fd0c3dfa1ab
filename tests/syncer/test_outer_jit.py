"""The outer step's one-pass kernels (syncer/model/outer_jit.py) against outer.py's numpy kernels: the same bits for
every update kind, the same verdict on non-finite gradients, the same norm up to summation order."""
import numpy as np
import pytest

from yeto_patch.syncer.model import outer_jit
from yeto_patch.syncer.model.outer import FragmentTensors, NonFiniteMerge, OuterOptimizer, _scan
from yeto_patch.syncer.model.runner import ChunkRunner

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not outer_jit.available(), reason="numba not installed")]


@pytest.fixture
def numpy_kernels():
    def use(on: bool):
        outer_jit.set_enabled(not on)
    yield use
    outer_jit.set_enabled(True)


@pytest.mark.parametrize("kind,delay,lr", [("nesterov", 1, 0.7), ("avg", 1, 1.0), ("delayed-nesterov", 3, 0.4),
                                           ("nesterov", 1, "auto")])
def test_one_pass_step_gives_the_numpy_bits(numpy_kernels, kind, delay, lr):
    rng = np.random.default_rng(5)
    n = 70_001   # chunks of 4096 and a short tail
    base = (rng.standard_normal(n) * 3).astype(np.float32)
    accs = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2)).astype(np.float32) for _ in range(7)]
    for a in accs:
        a[::97] = 0.0
        a[5] = np.float32(1e-41)   # a subnormal goes through unflushed
    out = []
    for use_numpy in (True, False):
        numpy_kernels(use_numpy)
        t = FragmentTensors(base.copy())
        opt = OuterOptimizer(kind, lr=lr, delay=delay)
        r = ChunkRunner(2, chunk=4096)
        norms = []
        for v in range(1, 8):   # warm-up momentum, delayed rounds with and without the momentum update
            w = [3.0, 0.0, 1.5][v % 3]   # weight 0: acc is g
            norms.append(opt.step(t, accs[v - 1].copy(), w, v, r, steps=10 * v))
        r.close()
        out.append((t.base, t.momentum, t.delay_buf, norms))
    (b0, m0, d0, n0), (b1, m1, d1, n1) = out
    assert np.array_equal(b0, b1)
    assert (m0 is None and m1 is None) or np.array_equal(m0, m1)
    assert (d0 is None and d1 is None) or np.array_equal(d0, d1)
    assert np.allclose(n0, n1, rtol=1e-12, atol=0)


def test_the_checked_path_gives_the_numpy_bits(numpy_kernels):
    """Values near the overflow bound take pass 2 (acc divided in place): the commit reads g from acc."""
    n = 9000
    out = []
    for use_numpy in (True, False):
        numpy_kernels(use_numpy)
        t = FragmentTensors(np.linspace(-1, 1, n).astype(np.float32), np.full(n, 0.25, np.float32))
        t.base[3] = np.float32(2e30)
        acc = np.random.default_rng(1).standard_normal(n).astype(np.float32)
        OuterOptimizer("nesterov").step(t, acc, 2.0, 9, ChunkRunner(1, chunk=1000))
        out.append((t.base.copy(), t.momentum.copy(), acc))
    assert all(np.array_equal(x, y) for x, y in zip(*out))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 4096, 4103])
def test_scan_finds_every_non_finite_value_and_the_largest(numpy_kernels, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(n)] = -7.5
    ok, mx, sq = outer_jit.scan(x)
    assert ok and mx == float(np.max(np.abs(x)))
    assert sq == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-12)
    for bad in (np.nan, np.inf, -np.inf):
        for pos in {0, n // 2, n - 1}:
            y = x.copy()
            y[pos] = bad
            assert outer_jit.scan(y)[0] is False and _scan(y, 0, n)[0] is False
    acc = np.zeros(n, np.float32)
    acc[n - 1] = np.nan
    with pytest.raises(NonFiniteMerge):
        OuterOptimizer("nesterov").step(FragmentTensors(np.ones(n, np.float32)), acc, 1.0, 2, ChunkRunner(1, chunk=64))
