"""The state of one open round of a fragment (``_Round``) and of one push in it (``_Contrib``), and the checks of
an encoded push body; owned and mutated by :class:`~.rounds.Coordinator` under its lock."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...wire import codecs
from ...wire.frames import CodecError
from .settings import Push

log = logging.getLogger("yeto.syncer")

__all__ = ["_Contrib", "_Round", "AccumulatorPool", "_refusal_code", "validate_encoded", "fold_held", "responder"]


@dataclass
class _Contrib:
    push: Push
    weight_raw: float
    folded: bool = False
    lag: int = 0
    held: bool = False  # body kept (exact mode / carried / weighed at merge time)
    claimed: float = 0.0   # its weight from its checked fields, before the cap (syncer/rounds/weights.py)
    unreferenced: bool = False   # nobody else was on record: its weight is capped against the round at merge time

    @property
    def island(self):
        return self.push.island


@dataclass
class _Round:
    base_version: int
    contribs: dict = field(default_factory=dict)  # island -> _Contrib (fresh answers)
    acc: Optional[np.ndarray] = None
    inflight: int = 0
    closed: bool = False
    t_first: Optional[float] = None
    t_quorum: Optional[float] = None
    next_wait_log: float = 0.0
    fold_lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(self) -> set:
        """Islands whose push is in the round: folded (or held, in exact mode). A push still being folded is
        not an answer yet: it may be refused, and must not make the round due meanwhile."""
        return {i for i, c in self.contribs.items() if c.folded}


class AccumulatorPool:
    """One released float32 accumulator kept for the next round (no fresh pages to fault in)."""

    def __init__(self):
        self._spare: Optional[np.ndarray] = None
        self._lock = threading.Lock()

    def take(self, n: int, runner) -> np.ndarray:
        """A zeroed accumulator of `n` values (`runner`: a merge.ChunkRunner, to zero it in parallel chunks)."""
        with self._lock:
            sp = self._spare
            if sp is not None and sp.size >= n:
                self._spare = None
                acc = sp[:n]
                runner.map(n, lambda a, b: acc[a:b].fill(0.0))
                return acc
        return np.zeros(n, np.float32)

    def give(self, acc: Optional[np.ndarray]) -> None:
        if acc is None:
            return
        full = acc.base if isinstance(acc.base, np.ndarray) else acc
        with self._lock:
            if self._spare is None or full.size > self._spare.size:
                self._spare = full


def _refusal_code(e: CodecError) -> str:
    return "nonfinite" if getattr(e, "code", "") == "nonfinite" else "bad-push"


def validate_encoded(codec: str, body, numel: int, block: int) -> None:
    """Check an encoded push without decoding it (size, scales in range, finite values), exactly as the
    decoder will at merge time: a held push that passes here cannot be dropped later."""
    codecs.check_encoded(codec, memoryview(body).cast("B"), numel, block, threads=1)


def responder(c: _Contrib, lag: int, w: float, carried: bool) -> dict:
    """One push of a merge, as its tape record lists it."""
    p = c.push
    return {"island": p.island, "lag": lag, "weight": w, "on_time_weight": c.weight_raw, "claimed": c.claimed,
            "carried": carried, "base_version": p.base_version, "steps": p.steps, "tokens": p.tokens,
            "local_step": p.local_step, "codec": p.codec, "bytes": int(p.nbytes)}


def fold_held(book, acc: np.ndarray, fresh: list, carried: list, version: int, late_factor: float, numel: int,
              threads: int, index: int) -> tuple:
    """(total weight, responders) of a merge into ``acc``: fresh pushes were folded on arrival (here only those held:
    with --exact, in island order, and those weighed against the round: syncer/rounds/weights.py), carried ones are folded
    now with weight x late_factor^lag. ``book``: the coordinator's weights.WeightBook."""
    for c in fresh:
        if c.unreferenced:   # nobody else was on record when it came: weighed against this round's others
            c.weight_raw = book.cap_in_round(c.claimed, [o.claimed for o in fresh if o is not c])
        if c.held:
            codecs.decode_accumulate(c.push.codec, c.push.body, numel, c.weight_raw, acc, c.push.block,
                                     threads=threads)
    weights = [c.weight_raw for c in fresh]
    responders = [responder(c, 0, c.weight_raw, False) for c in fresh]
    for c in carried:
        lag = version - c.push.base_version
        if c.unreferenced:
            c.weight_raw = book.cap_in_round(c.claimed, [o.claimed for o in fresh])
        w = c.weight_raw * (late_factor ** lag)
        try:
            codecs.decode_accumulate(c.push.codec, c.push.body, numel, w, acc, c.push.block, threads=threads)
        except CodecError as e:  # validated on arrival, so not expected; never poisons the round
            log.error("fragment %d: carried push from island %s dropped: %s", index, c.island, e)
            continue
        weights.append(w)
        responders.append(responder(c, lag, w, True))
    total = 0.0
    for w in weights:  # fixed order
        total += w
    return total, responders
