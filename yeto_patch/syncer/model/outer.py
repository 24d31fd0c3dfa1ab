"""Outer optimizers applied by the syncer to a fragment's base after each merge.

With the merged outer gradient ``g`` (the weighted mean of the islands' deltas, anchor minus local weights),
per fragment, in float32:

* ``nesterov`` (default, momentum 0.9):          ``m = mu*m + g;  base -= lr*(g + mu*m)``
* ``avg`` (plain averaging; lr 1, momentum 0):   ``base -= lr*g``  (lr 1 gives the mean of the islands' weights)
* ``delayed-nesterov`` with delay N:            ``d += g`` every round; on rounds whose new version is a multiple
  of N: ``m = mu*m + d/N;  base -= lr*(g + mu*m);  d = 0``; on the other rounds ``base -= lr*g``.  N = 1 is exactly
  ``nesterov``.

Momentum warm-up (``MOMENTUM_WARMUP``, the default: 4 merges; Pier, arXiv 2511.17849): a fragment's merge to
version v uses ``mu_v = mu * min(1, (v - 1) / 4)`` instead of ``mu``: the first merge is a plain ``lr * g`` step
and the momentum reaches ``mu`` at the fifth.  From a fresh model the first rounds' deltas are many times larger
than later ones and momentum 0.9 carries them on for about ten merges; warmed up, DiLoCo from scratch ended
0.6-1.3% lower at no cost in bytes (issue 37, docs/convergence.md, "Outer momentum warm-up").  The rule depends
only on the fragment's version, so a resumed run continues it exactly.

:meth:`OuterOptimizer.step` first computes ``g`` and checks that ``g`` and the would-be new base and momentum are
finite everywhere (pass 1, nothing is written but the scratch accumulator), and only then commits (pass 2).  A
non-finite result raises :class:`NonFiniteMerge` and leaves base, momentum and delay buffer unchanged.

The learning rate is a number, or ``"auto"`` (the syncer's default): each merge then takes :func:`lr_for_steps` of
the inner steps its deltas cover (the median ``steps`` the round's pushes report, which is H in steady state) and
of whether its islands blend bases in (pushes say so: tau > 0).  The rule is what was measured
(docs/convergence.md): islands that install bases as they are (tau = 0) overshoot with Nesterov 0.7 when deltas
cover few inner steps (0.4 was best at H = 10, 0.7-1.0 at H = 50), so 0.4 up to 10 steps, 0.7 from 50, linear
between; islands that blend (installed = alpha * local + (1 - alpha) * base) already damp every outer step, and
0.7 was best for them at H = 10 and at H = 50.  Blending islands that started from pretrained weights (a
fine-tune: their pushes say so) take 1.0: fine-tuning a pretrained model on Perl, 1.0 ended 0.996-0.999x DDP at F =
1-8 against 0.7's 1.001-1.002x, while from scratch 1.0 made runs 0.75% apart against 0.7's 0.2% (docs/convergence.md,
"Fine-tune regime").  ``avg`` keeps lr 1 (the mean of the islands' weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import outer_jit
from .runner import ChunkRunner

__all__ = ["OUTER_KINDS", "OuterOptimizer", "NonFiniteMerge", "FragmentTensors", "AUTO_LR", "lr_for_steps",
           "outer_lr_inputs", "LrInputs", "warmed_momentum", "MOMENTUM_WARMUP"]

OUTER_KINDS = ("nesterov", "avg", "delayed-nesterov")
AUTO_LR = "auto"
#: (inner steps, outer lr) ends of the automatic rule, linear between them
AUTO_LR_SHORT, AUTO_LR_LONG = (10, 0.4), (50, 0.7)
#: the automatic outer lr when the islands blend bases in (any H)
AUTO_LR_BLENDED = 0.7
#: ... and when, blending, they started from pretrained weights (a fine-tune)
AUTO_LR_PRETRAINED = 1.0
#: outer momentum warm-up, merges per fragment (warmed_momentum): 0 = the full momentum from the first merge; 4
#: was the best of 0 / 4 / 10 measured through yeto-patch (docs/convergence.md, "Outer momentum warm-up")
MOMENTUM_WARMUP = 4


def lr_for_steps(steps: float, blended: bool = False, pretrained: bool = False) -> float:
    """The automatic Nesterov outer learning rate for deltas of ``steps`` inner steps: when the islands blend bases
    in, AUTO_LR_PRETRAINED if they started from pretrained weights, else AUTO_LR_BLENDED; else 0.4 up to 10, 0.7
    from 50, linear between (rounded to 3 decimals so the value is the same on every platform). Islands that do
    not blend go by the steps whatever their start (no fine-tune was measured at tau = 0)."""
    if blended:
        return AUTO_LR_PRETRAINED if pretrained else AUTO_LR_BLENDED
    (s0, lr0), (s1, lr1) = AUTO_LR_SHORT, AUTO_LR_LONG
    x = min(max(float(steps), s0), s1)
    return round(lr0 + (lr1 - lr0) * (x - s0) / (s1 - s0), 3)


def warmed_momentum(momentum: float, version: int, warmup: int) -> float:
    """The momentum of a fragment's merge to ``version`` (its first merge makes version 1) with a momentum warm-up
    of ``warmup`` rounds: ``momentum * min(1, (version - 1) / warmup)``, linear from 0 on the first merge to the
    full momentum from merge ``warmup + 1`` on; ``warmup`` 0: the full momentum from the first merge."""
    if warmup <= 0 or version > warmup:
        return float(momentum)
    return float(momentum) * max(0, int(version) - 1) / float(warmup)


@dataclass(frozen=True)
class LrInputs:
    """What a merge's outer lr goes by (:meth:`OuterOptimizer.lr_at`): the median inner steps of its pushes (None:
    no pushes), whether most of them blend bases in, and whether most say their run started from pretrained
    weights (a tie counts as yes for both)."""
    steps: Optional[float] = None
    blended: bool = False
    pretrained: bool = False


def outer_lr_inputs(pushes) -> LrInputs:
    """The LrInputs of a merge's pushes (anything with ``steps``, ``blend`` and ``pretrained``)."""
    pushes = list(pushes)
    steps = sorted(p.steps for p in pushes)
    if not steps:
        return LrInputs()
    k, n = len(steps) // 2, len(steps)
    median = float(steps[k]) if n % 2 else (steps[k - 1] + steps[k]) / 2.0
    return LrInputs(median, 2 * sum(1 for p in pushes if p.blend) >= n,
                    2 * sum(1 for p in pushes if getattr(p, "pretrained", False)) >= n)


#: committed base, momentum and delay buffer values stay at most this large: a merge whose result would not is
#: refused like a non-finite one, so a committed base stays usable (later steps and the islands' codecs, which
#: refuse |x| > 3e38, cannot overflow on it)
USABLE_MAX = 1e30


def _usable(x: np.ndarray, old: np.ndarray) -> bool:
    """Finite, and no larger than USABLE_MAX (or than the largest value already there: state that never came
    from a merge, e.g. a test's, is not made unusable by a merge that leaves it as it is)."""
    if not np.isfinite(x).all():
        return False
    return x.size == 0 or float(np.max(np.abs(x))) <= max(USABLE_MAX, float(np.max(np.abs(old))))


class NonFiniteMerge(ValueError):
    pass


@dataclass
class FragmentTensors:
    base: np.ndarray
    momentum: Optional[np.ndarray] = None
    delay_buf: Optional[np.ndarray] = None
    shadow: Optional[np.ndarray] = None   # --base-wire int8/int4/topk: the base the islands hold (base + residual)
    bound: Optional[float] = None  # max |x| over base, momentum, delay buffer (None: unknown)


class OuterOptimizer:
    def __init__(self, kind: str = "nesterov", lr: Optional[float] = None, momentum: Optional[float] = None,
                 delay: int = 1, momentum_warmup: Optional[int] = None):
        if kind not in OUTER_KINDS:
            raise ValueError(f"unknown outer optimizer {kind!r} (known: {', '.join(OUTER_KINDS)})")
        self.auto = lr == AUTO_LR and kind != "avg"
        if lr is None or lr == AUTO_LR:
            lr = 1.0 if kind == "avg" else 0.7   # with auto: used only where a merge has no steps to go by
        if momentum is None:
            momentum = 0.0 if kind == "avg" else 0.9
        if kind == "avg" and momentum != 0.0:
            raise ValueError("the avg outer optimizer has no momentum (use nesterov)")
        if not (np.isfinite(lr) and lr > 0):
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        if delay < 1:
            raise ValueError(f"delayed-nesterov delay must be >= 1, got {delay}")
        warm = MOMENTUM_WARMUP if momentum_warmup is None else momentum_warmup
        if not (isinstance(warm, int) and 0 <= warm <= 10**6):
            raise ValueError(f"outer momentum warm-up must be a number of merges in 0..1000000, got {warm!r}")
        self.kind = kind
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.delay = int(delay) if kind == "delayed-nesterov" else 1
        self.momentum_warmup = warm if self.momentum > 0.0 else 0

    def config(self) -> dict:
        """The resolved settings (a checkpoint's merge configuration). The momentum warm-up only when it is not
        the default: a checkpoint written before the warm-up existed still resumes (it only changes merges 1-4,
        which such a checkpoint is almost always past)."""
        out = {"outer": self.kind, "lr": AUTO_LR if self.auto else self.lr, "momentum": self.momentum,
               "delay": self.delay}
        if self.momentum > 0.0 and self.momentum_warmup != MOMENTUM_WARMUP:
            out["momentum_warmup"] = self.momentum_warmup
        return out

    def lr_at(self, steps: Optional[float], blended: bool = False, pretrained: bool = False) -> float:
        """The learning rate of a merge whose deltas cover ``steps`` inner steps (None: not known) from islands
        that do (``blended``) or do not blend bases in, and did (``pretrained``) or did not start from pretrained
        weights."""
        return lr_for_steps(steps, blended, pretrained) if self.auto and steps is not None else self.lr

    @property
    def uses_momentum(self) -> bool:
        return self.kind != "avg" and self.momentum > 0.0

    def ensure_state(self, t: FragmentTensors) -> None:
        n = t.base.size
        if self.uses_momentum and t.momentum is None:
            t.momentum = np.zeros(n, np.float32)
        if self.uses_momentum and self.kind == "delayed-nesterov" and self.delay > 1 and t.delay_buf is None:
            t.delay_buf = np.zeros(n, np.float32)

    def _bound(self, t: FragmentTensors, runner: ChunkRunner) -> float:
        arrays = [x for x in (t.base, t.momentum, t.delay_buf) if x is not None]

        def amax(a: int, b: int) -> float:
            return max(float(np.max(np.abs(x[a:b]))) if b > a else 0.0 for x in arrays)

        return max(runner.map(t.base.size, amax), default=0.0)

    def step(self, t: FragmentTensors, acc: np.ndarray, total_weight: float, new_version: int,
             runner: ChunkRunner, steps: Optional[float] = None, blended: bool = False,
             pretrained: bool = False) -> float:
        """``g = acc / total_weight``, check, apply. Returns ||g||_2 (float64). ``acc`` is scratch; ``steps``,
        ``blended``, ``pretrained``: the inner steps the merged deltas cover, whether their islands blend and
        started from pretrained weights (the lr with "auto").

        Pass 1 reads only ``acc`` (finite?, max |acc|, sum of squares).  From max |g| and a kept upper bound of
        |base|, |momentum|, |delay buffer| it bounds every value the update can produce; below 1e38 nothing
        can overflow and the commit pass follows directly, otherwise a second pass computes the would-be
        values and checks them first.  Either way nothing is written before the result is known to be finite,
        and the bits are the same."""
        self.ensure_state(t)
        n = t.base.size
        assert acc.size == n and acc.dtype == np.float32
        lr = self.lr_at(steps, blended, pretrained)
        p = self._plan(t, total_weight, new_version, lr)
        if t.bound is None:
            t.bound = self._bound(t, runner)
        gmax, sq = _scan_gradient(acc, p.W, runner)
        new_bound = self._new_bound(t.bound, gmax, lr)
        divided = False
        if not new_bound < USABLE_MAX:  # cannot rule out an unusable result: compute the would-be values first
            oks = runner.map(n, _quiet(lambda a, b: _check(p, acc, runner, a, b)))
            divided = True
            if not all(oks):
                c = oks.index(False) * runner.chunk
                raise NonFiniteMerge(f"merged result would overflow, is not finite or above {USABLE_MAX:g} (first "
                                     f"bad chunk at element {c}); state unchanged")
        runner.map(n, lambda a, b: _commit(p, acc, runner, divided, a, b))
        # the analytic bound only grows; measure it again once it gets large (rare: values near 1e30)
        t.bound = new_bound if new_bound < 1e30 else self._bound(t, runner)
        return float(np.sqrt(sq))

    def _plan(self, t: FragmentTensors, total_weight: float, new_version: int, lr: float) -> "_StepPlan":
        """The constants and arrays of one step (which update this round applies)."""
        kind = self.kind
        momentum_round = kind == "nesterov" or (kind == "delayed-nesterov" and new_version % self.delay == 0)
        dn = kind == "delayed-nesterov" and self.delay > 1 and t.delay_buf is not None
        m = t.momentum
        mu = warmed_momentum(self.momentum, new_version, self.momentum_warmup)
        return _StepPlan(W=np.float32(total_weight), lr=np.float32(lr), mu=np.float32(mu),
                         invN=np.float32(1.0 / self.delay), momentum_round=momentum_round, dn=dn,
                         use_m=m is not None and momentum_round, base=t.base, m=m, d=t.delay_buf)

    def _new_bound(self, B: float, gmax: float, lr: float) -> float:
        """An upper bound of every value the update produces (g, momentum, delay buffer, base), from the bound
        B of the current state: new momentum <= mu*B + B + gmax (covers (d + g)/N), update <= gmax + mu*that."""
        lr_f, mu_f = float(lr), float(self.momentum)
        nm = mu_f * B + B + gmax
        return max(B + lr_f * (gmax + mu_f * nm), nm, B + gmax) * (1.0 + 1e-6)


@dataclass
class _StepPlan:
    """What one :meth:`OuterOptimizer.step` applies: float32 constants and the fragment's state arrays."""
    W: np.float32
    lr: np.float32
    mu: np.float32
    invN: np.float32
    momentum_round: bool
    dn: bool                        # a delayed-nesterov delay buffer is kept
    use_m: bool                     # this round updates the momentum
    base: np.ndarray
    m: Optional[np.ndarray]
    d: Optional[np.ndarray]


def _quiet(fn):
    def run(a: int, b: int):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return fn(a, b)
    return run


def _scan(acc: np.ndarray, a: int, b: int):
    """Read-only: is acc finite, max |acc|, sum of acc^2 (float64)."""
    x = acc[a:b]
    if b <= a:
        return True, 0.0, 0.0
    if outer_jit.enabled():   # one pass (outer_jit.py)
        return outer_jit.scan(x)
    mx, mn = float(x.max()), float(x.min())  # NaN propagates through max/min
    if not (np.isfinite(mx) and np.isfinite(mn)):
        return False, 0.0, 0.0
    return True, max(mx, -mn), float(np.einsum("i,i->", x, x, dtype=np.float64))


def _scan_gradient(acc: np.ndarray, W: np.float32, runner: ChunkRunner) -> tuple:
    """Pass 1: (an upper bound of max |g|, ||g||^2) with g = acc / W; NonFiniteMerge if acc is not finite."""
    parts = runner.map(acc.size, _quiet(lambda a, b: _scan(acc, a, b)))
    bad = [i for i, (ok, _, _) in enumerate(parts) if not ok]
    if bad:
        raise NonFiniteMerge(f"merged outer gradient is not finite (first bad chunk at element "
                             f"{bad[0] * runner.chunk}); state unchanged")
    sq = 0.0
    amax = 0.0
    for _, mx, sqi in parts:  # fixed order: bit-identical for any thread count
        sq += sqi
        amax = max(amax, mx)
    w = float(W) if W != 0 else 1.0
    gmax = amax / w * (1.0 + 1e-6)
    sq /= w * w
    return gmax, sq


def _check(p: _StepPlan, acc: np.ndarray, runner: ChunkRunner, a: int, b: int) -> bool:
    """Pass 2 (only when the bound cannot rule out overflow): divides acc by W in place and checks the would-be
    momentum, base and delay buffer of elements a:b; writes nothing else but scratch."""
    W, lr, mu, invN = p.W, p.lr, p.mu, p.invN
    base, m, d, dn = p.base, p.m, p.d, p.dn
    g = acc[a:b]
    if W != 0:
        np.divide(g, W, out=g)
    ok = bool(np.isfinite(g).all())
    s1 = runner.scratch("s1", b - a)
    s2 = runner.scratch("s2", b - a)
    if ok and p.use_m:
        # would-be momentum: mu*m + (d + g)/N  (dn)  or  mu*m + g
        if dn:
            np.add(d[a:b], g, out=s2)
            np.multiply(s2, invN, out=s2)
        else:
            s2[...] = g
        np.multiply(m[a:b], mu, out=s1)
        np.add(s1, s2, out=s1)          # s1 = new m
        ok = _usable(s1, m[a:b])
        np.multiply(s1, mu, out=s1)
        np.add(s1, g, out=s1)           # s1 = g + mu*m'
    elif ok:
        s1[...] = g
    if ok:
        np.multiply(s1, lr, out=s1)
        np.subtract(base[a:b], s1, out=s1)
        ok = _usable(s1, base[a:b])
    if ok and dn and not p.momentum_round:
        np.add(d[a:b], g, out=s2)
        ok = _usable(s2, d[a:b])
    return ok


def _commit(p: _StepPlan, acc: np.ndarray, runner: ChunkRunner, divided: bool, a: int, b: int) -> None:
    """The update of elements a:b (``divided``: pass 2 already turned acc into g)."""
    if outer_jit.enabled():   # one pass, the same bits (outer_jit.py)
        outer_jit.commit(p, acc, divided, a, b)
        return
    W, lr, mu, invN = p.W, p.lr, p.mu, p.invN
    base, m, d, dn = p.base, p.m, p.d, p.dn
    if divided:
        g = acc[a:b]
    else:
        g = runner.scratch("g", b - a)
        if W != 0:
            np.divide(acc[a:b], W, out=g)
        else:
            g[...] = acc[a:b]
    s1 = runner.scratch("s1", b - a)
    if p.use_m:
        if dn:
            np.add(d[a:b], g, out=d[a:b])
            np.multiply(d[a:b], invN, out=s1)
            d[a:b] = 0.0
            np.multiply(m[a:b], mu, out=m[a:b])
            np.add(m[a:b], s1, out=m[a:b])
        else:
            np.multiply(m[a:b], mu, out=m[a:b])
            np.add(m[a:b], g, out=m[a:b])
        np.multiply(m[a:b], mu, out=s1)
        np.add(s1, g, out=s1)
    else:
        if dn:
            np.add(d[a:b], g, out=d[a:b])
        s1[...] = g
    np.multiply(s1, lr, out=s1)
    np.subtract(base[a:b], s1, out=base[a:b])
