"""Outer optimizers applied by the syncer to a fragment's base after each merge.

With the merged outer gradient ``g`` (the weighted mean of the islands' deltas, anchor minus local weights),
per fragment, in float32:

* ``nesterov`` (default, lr 0.7, momentum 0.9):  ``m = mu*m + g;  base -= lr*(g + mu*m)``
* ``avg`` (plain averaging; lr 1, momentum 0):   ``base -= lr*g``  (lr 1 gives the mean of the islands' weights)
* ``delayed-nesterov`` with delay N:            ``d += g`` every round; on rounds whose new version is a multiple
  of N: ``m = mu*m + d/N;  base -= lr*(g + mu*m);  d = 0``; on the other rounds ``base -= lr*g``.  N = 1 is exactly
  ``nesterov``.

:meth:`OuterOptimizer.step` first computes ``g`` and checks that ``g`` and the would-be new base and momentum are
finite everywhere (pass 1, nothing is written but the scratch accumulator), and only then commits (pass 2).  A
non-finite result raises :class:`NonFiniteMerge` and leaves base, momentum and delay buffer unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .merge import ChunkRunner

__all__ = ["OUTER_KINDS", "OuterOptimizer", "NonFiniteMerge", "FragmentTensors"]

OUTER_KINDS = ("nesterov", "avg", "delayed-nesterov")


class NonFiniteMerge(ValueError):
    pass


@dataclass
class FragmentTensors:
    base: np.ndarray
    momentum: Optional[np.ndarray] = None
    delay_buf: Optional[np.ndarray] = None
    bound: Optional[float] = None  # max |x| over base, momentum, delay buffer (None: unknown)


class OuterOptimizer:
    def __init__(self, kind: str = "nesterov", lr: Optional[float] = None, momentum: Optional[float] = None,
                 delay: int = 1):
        if kind not in OUTER_KINDS:
            raise ValueError(f"unknown outer optimizer {kind!r} (known: {', '.join(OUTER_KINDS)})")
        if lr is None:
            lr = 1.0 if kind == "avg" else 0.7
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
        self.kind = kind
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.delay = int(delay) if kind == "delayed-nesterov" else 1

    def config(self) -> dict:
        return {"outer": self.kind, "lr": self.lr, "momentum": self.momentum, "delay": self.delay}

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
             runner: ChunkRunner) -> float:
        """``g = acc / total_weight``, check, apply. Returns ||g||_2 (float64). ``acc`` is scratch.

        Pass 1 reads only ``acc``: ``g`` finite, max |g| and sum of squares.  When max |g| and the cached
        bound of |base|, |momentum|, |delay buffer| (kept by the previous commit) are both below
        ``FLT_MAX / (1 + 4 lr)``, the update provably cannot overflow and the commit pass follows directly;
        otherwise a second check pass computes the would-be values first.  Either way nothing is written
        before the result is known to be finite, and the bits are the same."""
        self.ensure_state(t)
        n = t.base.size
        assert acc.size == n and acc.dtype == np.float32
        W = np.float32(total_weight)
        lr, mu = np.float32(self.lr), np.float32(self.momentum)
        kind = self.kind
        momentum_round = kind == "nesterov" or (kind == "delayed-nesterov" and new_version % self.delay == 0)
        dn = kind == "delayed-nesterov" and self.delay > 1 and t.delay_buf is not None
        invN = np.float32(1.0 / self.delay)
        base, m, d = t.base, t.momentum, t.delay_buf
        use_m = m is not None and momentum_round
        limit = float(np.finfo(np.float32).max) / (1.0 + 4.0 * self.lr)
        if t.bound is None:
            t.bound = self._bound(t, runner)

        def scan(a: int, b: int):
            s1 = runner.scratch("s1", b - a)
            if W != 0:
                np.divide(acc[a:b], W, out=s1)
            else:
                s1[...] = acc[a:b]
            if not np.isfinite(s1).all():
                return False, 0.0, 0.0
            s64 = runner.scratch("sq64", b - a, np.float64)
            np.square(s1, out=s64, dtype=np.float64)
            sq = float(s64.sum())
            np.abs(s1, out=s1)
            return True, float(s1.max()) if b > a else 0.0, sq

        def check(a: int, b: int):
            g = acc[a:b]
            if W != 0:
                np.divide(g, W, out=g)
            ok = bool(np.isfinite(g).all())
            s1 = runner.scratch("s1", b - a)
            s2 = runner.scratch("s2", b - a)
            if ok and use_m:
                # would-be momentum: mu*m + (d + g)/N  (dn)  or  mu*m + g
                if dn:
                    np.add(d[a:b], g, out=s2)
                    np.multiply(s2, invN, out=s2)
                else:
                    s2[...] = g
                np.multiply(m[a:b], mu, out=s1)
                np.add(s1, s2, out=s1)          # s1 = new m
                ok = bool(np.isfinite(s1).all())
                np.multiply(s1, mu, out=s1)
                np.add(s1, g, out=s1)           # s1 = g + mu*m'
            elif ok:
                s1[...] = g
            if ok:
                np.multiply(s1, lr, out=s1)
                np.subtract(base[a:b], s1, out=s1)
                ok = bool(np.isfinite(s1).all())
            if ok and dn and not momentum_round:
                np.add(d[a:b], g, out=s2)
                ok = bool(np.isfinite(s2).all())
            return ok

        def quiet(fn):
            def run(a: int, b: int):
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    return fn(a, b)
            return run

        parts = runner.map(n, quiet(scan))
        bad = [i for i, (ok, _, _) in enumerate(parts) if not ok]
        if bad:
            raise NonFiniteMerge(f"merged outer gradient is not finite (first bad chunk at element "
                                 f"{bad[0] * runner.chunk}); state unchanged")
        sq = 0.0
        gmax = 0.0
        for _, mx, s in parts:  # fixed order: bit-identical for any thread count
            sq += s
            gmax = max(gmax, mx)
        divided = False
        if not (gmax < limit and t.bound < limit):
            oks = runner.map(n, quiet(check))
            divided = True
            if not all(oks):
                c = oks.index(False) * runner.chunk
                raise NonFiniteMerge(f"merged result would overflow (first bad chunk at element {c}); "
                                     "state unchanged")

        def commit(a: int, b: int) -> float:
            if divided:
                g = acc[a:b]
            else:
                g = runner.scratch("g", b - a)
                if W != 0:
                    np.divide(acc[a:b], W, out=g)
                else:
                    g[...] = acc[a:b]
            s1 = runner.scratch("s1", b - a)
            if use_m:
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
            if b <= a:
                return 0.0
            mx = 0.0
            for x in (base, m, d):
                if x is not None:
                    np.abs(x[a:b], out=s1)
                    mx = max(mx, float(s1.max()))
            return mx

        t.bound = max(runner.map(n, commit), default=0.0)
        return float(np.sqrt(sq))
