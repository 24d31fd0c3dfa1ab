"""A small numpy reference of DiLoCo's outer step, written independently of the syncer's kernels."""
import numpy as np


class RefFragment:
    def __init__(self, base, kind="nesterov", lr=0.7, mu=0.9, delay=1, warmup=None):
        """``warmup``: the outer momentum warm-up in merges (default: the syncer's, MOMENTUM_WARMUP)."""
        from yeto_patch.syncer.model.outer import MOMENTUM_WARMUP
        self.warmup = MOMENTUM_WARMUP if warmup is None else warmup
        self.mu_nominal = float(mu)
        self.base = base.astype(np.float32).copy()
        self.m = np.zeros_like(self.base)
        self.d = np.zeros_like(self.base)
        self.kind, self.lr, self.mu, self.delay = kind, np.float32(lr), np.float32(mu), delay
        self.version = 0

    def merge(self, deltas_weights):
        """deltas_weights: [(delta f32, weight)] in fold order."""
        acc = np.zeros_like(self.base)
        total = 0.0
        for d, w in deltas_weights:
            acc += np.float32(w) * d if w != 1.0 else d
            total += w
        g = acc / np.float32(total)
        self.version += 1
        from yeto_patch.syncer.model.outer import warmed_momentum
        self.mu = np.float32(warmed_momentum(self.mu_nominal, self.version, self.warmup))
        if self.kind == "avg":
            self.base = self.base - self.lr * g
        elif self.kind == "nesterov" or self.delay == 1:
            self.m = self.mu * self.m + g
            self.base = self.base - self.lr * (g + self.mu * self.m)
        else:
            self.d = self.d + g
            if self.version % self.delay == 0:
                self.m = self.mu * self.m + self.d * np.float32(1.0 / self.delay)
                self.d[:] = 0
                self.base = self.base - self.lr * (g + self.mu * self.m)
            else:
                self.base = self.base - self.lr * g
        return g
