"""One push must not wreck the global model: a norm guard on pushes and a usability check on bases.

* A push whose delta norm ``||decode(body)||_2`` is above ``ratio`` times the median of the recent accepted
  (non-zero) push norms of its fragment (the last ``WINDOW``; with fewer than ``MIN_HISTORY`` of them: above
  ``ratio`` times the larger of the fragment's base norm and the largest accepted norm) is refused with code
  ``outlier`` before it touches anything; the log names the island (escaped) and both norms. ``ratio`` 0
  disables the guard. A push that cannot be measured (malformed, non-finite) is left to the usual validation,
  which refuses it with its own code. The pushes of a fragment's first round (relative to the initial base) are
  checked but do not join the history: they start from the initial weights, usually inside the learning-rate
  warm-up (the first update often at lr 0), and with streaming fragments the first round covers only the
  fragment's offset (1-2 inner steps of H = 10 with 4-8 fragments), so their norms can be 50x below every later
  round's; as the median's scale they made the guard refuse the second round's ordinary pushes.
* A base is *usable* when every value is finite and at most ``USABLE_MAX`` in magnitude (the outer step refuses a
  merge whose result would not be, see outer.py); a checkpoint whose arrays are not usable is refused at
  ``--resume``.
"""
from __future__ import annotations

import collections
import logging
import statistics
import threading
from typing import Optional

import numpy as np

from ..wire import codecs
from ..wire.frames import CodecError
from ..wire.text import printable
from .merge import ChunkRunner
from .outer import USABLE_MAX

__all__ = ["NormGuard", "unusable", "too_large", "USABLE_MAX", "WINDOW", "MIN_HISTORY"]

log = logging.getLogger("yeto.syncer")
WINDOW = 16
MIN_HISTORY = 3


def _sumsq(x: np.ndarray) -> float:
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.einsum("i,i->", x, x, dtype=np.float64))


def _luts() -> dict:
    """Per code byte: the squared decoded value in units of the block's scale (two values a byte for nibbles)."""
    b = np.arange(256)
    q = b.astype(np.uint8).view(np.int8).astype(np.float64)
    nib = np.arange(16)
    lvl = nib & 7
    int4 = (nib - 8.0) ** 2
    int4log = np.where(lvl == 0, 0.0, 4.0 ** (lvl - 7.0))
    return {"int8": (q * q).astype(np.float32), "int4": (int4[b & 15] + int4[b >> 4]).astype(np.float32),
            "int4-log": (int4log[b & 15] + int4log[b >> 4]).astype(np.float32)}


_LUT = _luts()
_BLOCKS_PER_STEP = 4096


def _block_sumsq(codec: str, mv: memoryview, numel: int, block: int) -> float:
    """Sum of squared decoded values of a (validated) block-codec body: per block, the scale squared times the
    sum of the squared codes (a table lookup per code byte; no decode)."""
    nb = -(-numel // block)
    scales = np.frombuffer(mv, np.float32, nb).astype(np.float64)
    codes = np.frombuffer(mv, np.uint8, offset=4 * nb)
    per = block if codec == "int8" else block // 2   # code bytes per full block
    full = numel // block
    lut = _LUT[codec]
    total = 0.0
    for b0 in range(0, full, _BLOCKS_PER_STEP):
        b1 = min(full, b0 + _BLOCKS_PER_STEP)
        sq = np.take(lut, codes[b0 * per: b1 * per]).reshape(b1 - b0, per).sum(axis=1, dtype=np.float64)
        s = scales[b0:b1]
        total += float(np.dot(s * s, sq))
    if full < nb:   # the last, partial block
        tail = codecs.decode_range(codec, mv, numel, full * block, numel - full * block, block)
        total += _sumsq(tail)
    return total


def push_norm(codec: str, body, numel: int, block: int, runner: ChunkRunner) -> Optional[float]:
    """||decode(body)||_2 in float64 without a full-size temporary (f32: one pass over the values; block codecs:
    from the scales and a table of squared codes); None when the body does not pass the codec checks."""
    try:
        codecs.check_codec(codec, block)
        mv = memoryview(body).cast("B")
        if mv.nbytes != codecs.encoded_nbytes(codec, numel, block):
            return None
        if codec == "f32":
            v = np.frombuffer(mv, np.float32)
            total = 0.0
            for p in runner.map(numel, lambda a, b: _sumsq(v[a:b])):  # fixed order
                total += p
        elif codec == "bf16":
            total = 0.0
            h = np.frombuffer(mv, np.uint16)
            for p in runner.map(numel, lambda a, b: _sumsq((h[a:b].astype(np.uint32) << 16).view(np.float32))):
                total += p
        else:
            codecs.check_encoded(codec, mv, numel, block, threads=1)   # lengths and scales only: cheap
            with np.errstate(over="ignore", invalid="ignore"):
                total = _block_sumsq(codec, mv, numel, block)
    except (CodecError, ValueError, TypeError):
        return None
    return float(np.sqrt(total)) if np.isfinite(total) else None


def unusable(name: str, a: Optional[np.ndarray], chunk: int = 1 << 20) -> Optional[str]:
    """Why array ``a`` is not usable as committed state (None: it is)."""
    if a is None:
        return None
    for s in range(0, a.size, chunk):
        x = a[s:s + chunk]
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(x) <= USABLE_MAX)  # NaN fails the comparison
        if bad.any():
            i = s + int(np.argmax(bad))
            return f"{name} has a value {float(a[i])!r} at element {i} (not finite or above {USABLE_MAX:g})"
    return None


def too_large(name: str, a: np.ndarray, chunk: int = 1 << 20) -> Optional[str]:
    """Why finite array ``a`` holds values above USABLE_MAX (None: it does not; non-finite values are left to
    the finiteness checks, which name them)."""
    for s in range(0, a.size, chunk):
        x = a[s:s + chunk]
        with np.errstate(invalid="ignore"):
            big = np.isfinite(x) & (np.abs(x) > USABLE_MAX)
        if big.any():
            i = s + int(np.argmax(big))
            return f"{name} has a value {float(a[i])!r} at element {i}, above {USABLE_MAX:g}"
    return None


class NormGuard:
    def __init__(self, ratio: float = 10.0, runner: Optional[ChunkRunner] = None):
        if not (np.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"max push norm ratio must be >= 0 (0 disables it), got {ratio}")
        self.ratio = float(ratio)
        self.runner = runner or ChunkRunner(1)
        self._hist: dict = collections.defaultdict(lambda: collections.deque(maxlen=WINDOW))
        self._base_norm: dict = {}   # fragment -> (version, norm)
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.ratio > 0

    def measure(self, codec: str, body, numel: int, block: int) -> Optional[float]:
        return push_norm(codec, body, numel, block, self.runner) if self.enabled else None

    def base_norm(self, fragment: int, version: int, base: Optional[np.ndarray]) -> float:
        """||base||_2 of a fragment's version (cached; called outside the coordinator lock)."""
        with self._lock:
            got = self._base_norm.get(fragment)
            if got is not None and got[0] == version:
                return got[1]
        if base is None:
            return 0.0
        n = push_norm("f32", memoryview(base).cast("B"), base.size, codecs.DEFAULT_BLOCK, self.runner) or 0.0
        with self._lock:
            self._base_norm[fragment] = (version, n)
        return n

    def needs_base_norm(self, fragment: int) -> bool:
        with self._lock:
            return len(self._hist[fragment]) < MIN_HISTORY

    def limit(self, fragment: int, base_norm: float) -> Optional[float]:
        with self._lock:
            h = list(self._hist[fragment])
        if len(h) >= MIN_HISTORY:
            return self.ratio * statistics.median(h)
        ref = max([base_norm] + h)
        return self.ratio * ref if ref > 0 else None

    def admit(self, fragment: int, norm: Optional[float], island: str, base_norm: float,
              scale: bool = True) -> Optional[str]:
        """The refusal message for a push of this norm (None: admitted, and with `scale` its norm joins the
        history: False for a fragment's first round, see the module docstring)."""
        if norm is None or not self.enabled:
            return None
        lim = self.limit(fragment, base_norm)
        if lim is not None and norm > lim:
            self.refused += 1
            log.warning("refused push of fragment %d from island %s: norm %.4g above %.4g (--max-push-norm-ratio "
                        "%g x the recent median of accepted push norms, or of the base norm)", fragment,
                        printable(island), norm, lim, self.ratio)
            return (f"push of fragment {fragment} has norm {norm:.4g}, above the limit {lim:.4g} "
                    f"(--max-push-norm-ratio {self.ratio:g} x the recent median of accepted push norms, or of the "
                    f"base norm before there are {MIN_HISTORY}); refused")
        if norm > 0 and scale:
            with self._lock:
                self._hist[fragment].append(norm)
        return None
