"""The state of one open round of a fragment (``_Round``) and of one push in it (``_Contrib``), and the checks of
an encoded push body; owned and mutated by :class:`~.rounds.Coordinator` under its lock."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..wire import codecs
from ..wire.frames import CodecError
from .settings import Push

__all__ = ["_Contrib", "_Round", "_refusal_code", "validate_encoded"]


@dataclass
class _Contrib:
    push: Push
    weight_raw: float
    folded: bool = False
    lag: int = 0
    held: bool = False  # body kept (exact mode / carried / weighed at merge time)
    claimed: float = 0.0   # its weight from its checked fields, before the cap (syncer/weights.py)
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


def _refusal_code(e: CodecError) -> str:
    return "nonfinite" if getattr(e, "code", "") == "nonfinite" else "bad-push"


def validate_encoded(codec: str, body, numel: int, block: int) -> None:
    """Check an encoded push without decoding it (size, scales in range, finite values), exactly as the
    decoder will at merge time: a held push that passes here cannot be dropped later."""
    codecs.check_encoded(codec, memoryview(body).cast("B"), numel, block, threads=1)
