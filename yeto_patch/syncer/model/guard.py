"""One push must not wreck the global model: an outlier guard on pushes and a usability check on bases.

* A push is measured twice: its total norm ``||decode(body)||_2`` and its *peak*, the root mean square of its
  densest block (the codec's quantization blocks, each with its own scale; 256 values for f32/bf16), so a push
  that puts its whole norm into a few values is seen for what it does to them.
* It is judged against the OTHER islands' history, never its own: per fragment, each island's last ``WINDOW``
  accepted non-zero pushes are kept; the reference of island ``i`` is the lower median, over the other islands
  that have a history, of each one's median norm (and median peak). A push above ``ratio`` times the reference
  norm, or with a peak above ``ratio`` times the reference peak, is refused with code ``outlier`` before it
  touches anything; the log names the island (escaped) and the bound. So an island cannot walk its own bound up
  (its history never counts for itself), and colluders walk it only if they are at least half of the others.
* Cold start (no other island has an accepted push yet, so nothing to compare with): a push is refused when,
  applied alone to the fragment's current base, it would leave a base whose norm is above ``first_growth``
  (default 2) times the norm of the base as the guard first saw it (not the current one, which accepted pushes
  may have grown). Relative to its own anchor a push applied alone gives the island's own trained weights, so an
  honest island passes unless its training more than doubled the weights' norm, and one island cannot multiply
  the base before anyone else has pushed (a push of -5 x the base would leave 6 x). In a run of one island
  (``single``), whose base is its own model and which never gets a reference, the bound is relative to the
  current base: no single push may multiply it, while the weights may grow over a long run. The per-block bound
  needs a reference and applies once other islands have pushed.
* ``ratio`` 0 disables the guard. A push that cannot be measured (malformed, non-finite) is left to the usual
  validation, which refuses it with its own code.
* A fragment's first round (pushes relative to the initial base, version 0) has a history of its own: its pushes
  are judged against the other islands' first-round pushes and never become the reference of later rounds. They
  start from the initial weights, usually inside the learning-rate warm-up (the first update often at lr 0), and
  with streaming fragments the first round covers only the fragment's offset (1-2 inner steps of H = 10 with 4-8
  fragments), so their norms can be 50x below every later round's: as the reference of the second round they made
  the guard refuse its ordinary pushes (issue 24), and without any reference the first round would be bounded
  only by the cold start (issue 26). A later round whose fragment has no later history from another island yet
  falls back to the cold start.
* A base is *usable* when every value is finite and at most ``USABLE_MAX`` in magnitude (the outer step refuses a
  merge whose result would not be, see outer.py); a checkpoint whose arrays are not usable is refused at
  ``--resume``.
"""
from __future__ import annotations

import collections
import logging
import statistics
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...wire import codecs
from ...wire.frames import CodecError
from ...wire.text import printable
from . import outer_jit
from .runner import ChunkRunner
from .outer import USABLE_MAX

__all__ = ["NormGuard", "PushStats", "unusable", "too_large", "init_refusal", "USABLE_MAX", "WINDOW", "FIRST_GROWTH",
           "push_stats"]

log = logging.getLogger("yeto.syncer")
WINDOW = 16          # accepted pushes remembered per island and fragment
MAX_ISLANDS = 256    # islands remembered per fragment (the least recently heard from is forgotten first)
FIRST_GROWTH = 2.0   # cold start: applied alone, a push may leave the base at most this times its first norm
PLAIN_BLOCK = 256    # the block over which f32 / bf16 pushes (and bases) are measured


@dataclass(frozen=True)
class PushStats:
    norm: float   # ||x||_2
    peak: float   # root mean square of the densest block
    grown: Optional[float] = None   # ||base - x||_2: the base's norm were the push applied alone (cold start)
    base_now: Optional[float] = None   # ||base||_2 of the current base it was applied to


def _block_sums(x: np.ndarray, block: int) -> np.ndarray:
    """Sum of squares per ``block`` values of ``x`` (float64; the last block may be partial)."""
    full = x.size // block
    with np.errstate(over="ignore", invalid="ignore"):
        v = x[:full * block].reshape(full, block)
        out = np.einsum("ij,ij->i", v, v, dtype=np.float64)
        if full * block < x.size:
            t = x[full * block:]
            out = np.append(out, np.einsum("i,i->", t, t, dtype=np.float64))
    return out


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


def _int1_stats(mv: memoryview, numel: int, block: int) -> tuple:
    """int1: every value of a block is +-its scale, so its sum of squares is scale^2 x its size (no code read)."""
    nb = -(-numel // block)
    s = np.frombuffer(mv, np.float32, nb).astype(np.float64)
    sq = s * s
    sizes = np.full(nb, float(block))
    sizes[-1] = numel - block * (nb - 1)
    return float((sq * sizes).sum()), float(sq.max()) if nb else 0.0


def _block_codec_stats(codec: str, mv: memoryview, numel: int, block: int) -> tuple:
    """(sum of squares, largest block mean square) of a (validated) block-codec body: per block, the scale squared
    times the sum of the squared codes (a table lookup per code byte; no decode)."""
    if codec == "int1":
        return _int1_stats(mv, numel, block)
    nb = -(-numel // block)
    scales = np.frombuffer(mv, np.float32, nb).astype(np.float64)
    codes = np.frombuffer(mv, np.uint8, offset=4 * nb)
    per = block if codec == "int8" else block // 2   # code bytes per full block
    full = numel // block
    lut = _LUT[codec]
    total, top = 0.0, 0.0
    for b0 in range(0, full, _BLOCKS_PER_STEP):
        b1 = min(full, b0 + _BLOCKS_PER_STEP)
        sq = np.take(lut, codes[b0 * per: b1 * per]).reshape(b1 - b0, per).sum(axis=1, dtype=np.float64)
        s = scales[b0:b1]
        blocks = s * s * sq
        total += float(blocks.sum())
        top = max(top, float(blocks.max()) / block)
    if full < nb:   # the last, partial block
        tail = codecs.decode_range(codec, mv, numel, full * block, numel - full * block, block)
        t = float(np.einsum("i,i->", tail, tail, dtype=np.float64))
        total += t
        top = max(top, t / tail.size)
    return total, top


def _plain_stats(values: np.ndarray, runner: ChunkRunner, widen=None) -> tuple:
    """(sum of squares, largest block mean square) of float values (``widen``: bf16 bits -> float32), chunk by chunk
    in a fixed order (CHUNK is a multiple of PLAIN_BLOCK, so blocks never straddle chunks)."""
    total, top = 0.0, 0.0

    def part(a, b):
        x = values[a:b] if widen is None else widen(values[a:b])
        sums = _block_sums(x, PLAIN_BLOCK)
        sizes = np.full(sums.size, PLAIN_BLOCK, np.float64)
        sizes[-1] = x.size - PLAIN_BLOCK * (sums.size - 1)
        return float(sums.sum()), float((sums / sizes).max()) if sums.size else 0.0
    for t, m in runner.map(values.size, part):
        total += t
        top = max(top, m)
    return total, top


def push_stats(codec: str, body, numel: int, block: int, runner: ChunkRunner) -> Optional[PushStats]:
    """Norm and peak of ``decode(body)`` in float64 without a full-size temporary (f32/bf16: one pass over the
    values; block codecs: from the scales and a table of squared codes); None when the body does not pass the
    codec checks or the result is not finite."""
    try:
        codecs.check_codec(codec, block)
        mv = memoryview(body).cast("B")
        if mv.nbytes != codecs.encoded_nbytes(codec, numel, block):
            return None
        if codec == "f32":
            total, top = _plain_stats(np.frombuffer(mv, np.float32), runner)
        elif codec == "bf16":
            total, top = _plain_stats(np.frombuffer(mv, np.uint16), runner,
                                      lambda h: (h.astype(np.uint32) << 16).view(np.float32))
        elif codec not in codecs.CODECS:   # the sparse family: validated, from its scales and codes
            with np.errstate(over="ignore", invalid="ignore"):
                total, top = codecs.sparse_sumsq(codec, mv, numel, block)
        else:
            codecs.check_encoded(codec, mv, numel, block, threads=1)   # lengths and scales only: cheap
            with np.errstate(over="ignore", invalid="ignore"):
                total, top = _block_codec_stats(codec, mv, numel, block)
    except (CodecError, ValueError, TypeError):
        return None
    if not (np.isfinite(total) and np.isfinite(top)):
        return None
    return PushStats(float(np.sqrt(total)), float(np.sqrt(top)))


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


def init_refusal(name: str, a: np.ndarray, runner: ChunkRunner) -> Optional[tuple]:
    """(refusal code, why) when float32 array ``a`` cannot become a base, None when it can: a finite value above
    USABLE_MAX ("bad-init", checked first) or a non-finite one ("nonfinite"). One pass on the runner's threads
    (the outer step's scan: INIT of a large model is not held up by a dozen numpy passes after its last byte);
    the element is named by the slower checks, on hostile input only."""
    if all(ok and amax <= USABLE_MAX for ok, amax in runner.map(a.size, lambda x, y: _largest(a[x:y]))):
        return None
    why = too_large(name, a)
    if why:
        return "bad-init", why + " (a base must stay usable)"
    for s in range(0, a.size, 1 << 20):
        if not np.isfinite(a[s:s + (1 << 20)]).all():
            return "nonfinite", f"{name} has a non-finite value near {s}"
    return None


def _largest(x: np.ndarray) -> tuple:
    """(finite, max |x|) of a float32 chunk."""
    if x.size == 0:
        return True, 0.0
    if outer_jit.enabled():
        ok, amax, _ = outer_jit.scan(x)
        return ok, amax
    mx, mn = float(x.max()), float(x.min())   # NaN propagates through max/min
    return bool(np.isfinite(mx) and np.isfinite(mn)), max(mx, -mn)


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


def _growth(codec: str, body, numel: int, block: int, base: np.ndarray, runner: ChunkRunner) -> tuple:
    """(||base - decode(body)||_2, ||base||_2) in float64, chunk by chunk in a fixed order ((None, None): not
    measurable)."""
    def part(a, b):
        y = base[a:b].astype(np.float64)
        d = y - codecs.decode_range(codec, body, numel, a, b - a, block)
        return float(np.dot(d, d)), float(np.dot(y, y))
    try:
        total, norm = 0.0, 0.0
        for t, n in runner.map(numel, part):
            total += t
            norm += n
    except (CodecError, ValueError, TypeError):
        return None, None
    return (float(np.sqrt(total)), float(np.sqrt(norm))) if np.isfinite(total) and np.isfinite(norm) else (None, None)


class NormGuard:
    """The outlier guard of every fragment (see the module docstring). ``admit`` runs under the coordinator's lock,
    ``measure`` and ``base_norm`` outside it."""

    def __init__(self, ratio: float = 10.0, runner: Optional[ChunkRunner] = None, first_growth: float = FIRST_GROWTH,
                 single: bool = False):
        if not (np.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"max push norm ratio must be >= 0 (0 disables it), got {ratio}")
        if not (np.isfinite(first_growth) and (first_growth >= 1 or first_growth == 0)):
            raise ValueError(f"first push growth must be >= 1 (0: no bound), got {first_growth}")
        self.ratio = float(ratio)
        self.first_growth = float(first_growth)
        self.single = single   # a run of one island: no one to protect, the base is its own model (see _overs)
        self.runner = runner or ChunkRunner(1)
        # (fragment, first round?) -> island -> deque of its accepted pushes' stats
        self._hist: dict = collections.defaultdict(collections.OrderedDict)
        self._base: dict = {}   # fragment -> PushStats of its base when the guard first measured it
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.ratio > 0

    def measure(self, codec: str, body, numel: int, block: int, cold: Optional[tuple] = None) -> Optional[PushStats]:
        """The push's figures; ``cold``: (fragment, island, the fragment's current base, first round?): when
        nobody else pushed that fragment in that kind of round yet, also the norm the base would have were the push
        applied alone (one more pass)."""
        if not self.enabled:
            return None
        st = push_stats(codec, body, numel, block, self.runner)
        if st is None or cold is None or not self.first_growth:
            return st
        fragment, island, base, first_round = cold
        if base is None or base.size != numel or self.reference(fragment, island, first_round) is not None:
            return st
        return PushStats(st.norm, st.peak, *_growth(codec, body, numel, block, base, self.runner))

    def base_norm(self, fragment: int, version: int, base: Optional[np.ndarray]) -> PushStats:
        """The cold-start reference of a fragment: its base's norm and peak when first measured (cached; called
        outside the coordinator lock)."""
        with self._lock:
            got = self._base.get(fragment)
        if got is not None:
            return got
        if base is None:
            return PushStats(0.0, 0.0)
        st = push_stats("f32", memoryview(base).cast("B"), base.size, codecs.DEFAULT_BLOCK, self.runner) \
            or PushStats(0.0, 0.0)
        with self._lock:
            return self._base.setdefault(fragment, st)

    def needs_base_norm(self, fragment: int) -> bool:
        with self._lock:
            return fragment not in self._base

    def reference(self, fragment: int, island: str, first_round: bool = False) -> Optional[PushStats]:
        """The lower median, over the islands other than ``island`` with accepted pushes of this fragment (in its
        first round, or in later ones), of each one's median norm and median peak (None: nobody else has)."""
        with self._lock:
            per = [(statistics.median(x.norm for x in h), statistics.median(x.peak for x in h))
                   for other, h in self._hist[(fragment, bool(first_round))].items() if other != island and h]
        if not per:
            return None
        k = (len(per) - 1) // 2
        return PushStats(sorted(n for n, _ in per)[k], sorted(p for _, p in per)[k])

    def _overs(self, fragment: int, stats: PushStats, island: str, base, first_round: bool) -> tuple:
        """(what the push exceeds, what the bounds are relative to)."""
        ref = self.reference(fragment, island, first_round)
        if ref is not None:
            over = []
            if stats.norm > self.ratio * ref.norm:
                over.append(f"norm {stats.norm:.4g} above {self.ratio * ref.norm:.4g}")
            if stats.peak > self.ratio * ref.peak:
                over.append(f"densest block (rms {stats.peak:.4g}) above {self.ratio * ref.peak:.4g}")
            return over, (f"the other islands' {'first-round' if first_round else 'recent'} pushes "
                          f"(--max-push-norm-ratio {self.ratio:g}: norm "
                          f"{ref.norm:.4g}, densest block rms {ref.peak:.4g})")
        with self._lock:
            b = self._base.get(fragment) or base
        ref, which = (b.norm if b is not None else 0.0), "first"
        if self.single and stats.base_now is not None:   # one island alone for good: its weights may grow slowly,
            ref, which = stats.base_now, "current"          # but no push may more than multiply them at once
        if not ref or not self.first_growth:
            return [], "nothing (no other island has pushed yet and the base is zero)"
        lim = self.first_growth * ref
        what = (f"the base's {which} norm {ref:.4g} (--first-push-growth {self.first_growth:g}: no other island "
                f"has pushed yet)")
        if stats.grown is not None:   # applied alone, it would leave a base of this norm
            return ([f"applied alone it would leave the base with norm {stats.grown:.4g}, above {lim:.4g}"]
                    if stats.grown > lim else []), what
        # (not measured against the base: its norm alone must keep the base within the bound)
        return ([f"norm {stats.norm:.4g} above {lim - ref:.4g}"] if stats.norm > lim - ref else []), what

    def admit(self, fragment: int, stats: Optional[PushStats], island: str, base_norm=None,
              first_round: bool = False) -> Optional[str]:
        """The refusal message for a push with these ``stats`` (None: admitted, and it joins ``island``'s history
        of the fragment's first round or of its later ones, see the module docstring). ``base_norm``:
        :meth:`base_norm`'s result when it was needed (a float 0.0 otherwise)."""
        if stats is None or not self.enabled:
            return None
        over, what = self._overs(fragment, stats, island, base_norm if isinstance(base_norm, PushStats) else None,
                                 first_round)
        if over:
            self.refused += 1
            why = " and ".join(over)
            log.warning("refused push of fragment %d from island %s: %s (relative to %s)", fragment,
                        printable(island), why, what)
            return f"push of fragment {fragment} refused as an outlier: {why} (relative to {what})"
        if log.isEnabledFor(logging.DEBUG):
            log.debug("outlier guard: push of fragment %d from island %s: norm %.4g, densest block rms %.4g%s; "
                      "admitted relative to %s", fragment, printable(island), stats.norm, stats.peak,
                      "" if stats.grown is None else f", applied alone the base's norm would be {stats.grown:.4g}",
                      what)
        if stats.norm > 0:
            with self._lock:
                hist = self._hist[(fragment, bool(first_round))]
                h = hist.pop(island, None) or collections.deque(maxlen=WINDOW)
                h.append(stats)
                hist[island] = h   # (the most recently heard from last)
                while len(hist) > MAX_ISLANDS:
                    hist.popitem(last=False)
        return None
