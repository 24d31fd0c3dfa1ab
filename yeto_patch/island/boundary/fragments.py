"""What an island knows about each fragment: one ``FragmentState`` per fragment (torch-free).

The syncer's layout (fragment -> manifest indices) fixes each fragment's tensors, their offsets in the
fragment's flat vector and its size. Per fragment the engine then tracks:

- ``anchor_version``: the base version the fragment's anchor is (-1 before the first install);
- ``steps_since`` / ``tokens_since``: optimizer steps and tokens since this fragment's previous push (a push
  reports them and starts counting again; a merged base blended in keeps them, since the local progress stays,
  while one that replaces the local weights starts them again), so the syncer's weights see what was computed;
- ``pending``: the push awaiting its answer (rank 0 keeps the record with its encoded body, to send again after a
  reconnect; the other ranks keep only its step);
- ``arrived`` (rank 0): the newest base received and not staged or installed yet;
- ``staging``: the base handed to the background stage (``base_stager.py``), installed at a later plan;
- ``residual`` (rank 0, error feedback): what the push codec dropped so far;
- restart flags: ``skip`` (boundaries merged before a restart, not pushed again), ``adopt`` (rank 0: the syncer is
  behind this island, its older base replaces the anchor), ``repushed`` (rank 0: base versions of pushes sent again,
  whose ``duplicate`` refusal is expected).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

from yeto_patch.island.errors import EngineError


@dataclass
class FragmentState:
    index: int
    entries: List[int]                 # manifest indices, ascending (the syncer's order)
    offsets: Dict[int, int]            # manifest index -> offset in the fragment's flat vector
    starts: List[int]                  # offsets in `entries` order
    numel: int
    anchor_version: int = -1
    steps_since: int = 0
    tokens_since: int = 0
    pending: Optional[dict] = None
    arrived: object = None             # rank 0: a wire.client.Base
    residual: object = None            # rank 0: float32 array (error feedback)
    staging: Optional[list] = None     # every rank: [version, updates] of the base staged in the background
    skip: int = 0
    adopt: bool = False
    repushed: set = field(default_factory=set)

    def count(self, tokens: int) -> None:
        self.steps_since += 1
        self.tokens_since += tokens

    def installed(self, version: int, keep_counts: bool = False) -> None:
        """The base of `version` is the anchor now; `keep_counts`: it was blended in (the local progress since the
        previous push stays and is reported by the next push), else counting starts again."""
        self.anchor_version = int(version)
        self.adopt = False
        if not keep_counts:
            self.steps_since = 0
            self.tokens_since = 0

    def take_counts(self) -> tuple:
        """(steps, tokens) since the previous push, for the push made now; counting starts again."""
        out = (self.steps_since, self.tokens_since)
        self.steps_since = self.tokens_since = 0
        return out

    def start_push(self, step: int, body, codec: str, gather_s: float, encode_s: float, final: bool,
                   made=None) -> dict:
        """Rank 0: the push of this fragment's delta relative to its anchor (encoded `body`) awaits its answer;
        the record keeps the body until then (after a reconnect it is sent again) and becomes the boundary log's
        record (keys starting with "_" are not logged). `made`: (base version, steps, tokens) when the delta was
        taken earlier than now (a background push: its boundary's anchor and counters)."""
        base, steps, tokens = made or (self.anchor_version, *self.take_counts())
        self.pending = {"step": step, "fragment": self.index, "base_version": base,
                        "bytes": int(body.nbytes), "codec": codec, "steps": steps,
                        "tokens": tokens, "gather_ms": round(gather_s * 1000, 2),
                        "encode_ms": round(encode_s * 1000, 2), "wait_ms": 0.0, "installed": False, "final": final,
                        "_send": {}, "_body": body}
        return self.pending

    def take_base(self, b) -> None:
        """Rank 0: a base received from the syncer; kept if it is the newest (an update of the previous base,
        --base-wire int8/int4, is applied to it in order)."""
        cur = self.arrived
        if b.relative:
            self.arrived = b if cur is None else cur.then(b)
        elif cur is None or b.version >= cur.version or self.adopt:
            self.arrived = b

    def answered(self, base_version: int) -> bool:
        """Rank 0: a base that answers a push relative to `base_version` has arrived."""
        if self.staging is not None and self.staging[0] > base_version:
            return True
        return self.arrived is not None and (self.arrived.version > base_version or self.adopt)


class Fragments:
    """The island's fragments in the syncer's layout, checked against this island's manifest."""

    def __init__(self, layout, numels, entry_numels: List[int], announced: Optional[int] = None):
        n = len(entry_numels)
        layout = [[int(i) for i in frag] for frag in layout]
        if sorted(i for frag in layout for i in frag) != list(range(n)):
            raise EngineError(f"the syncer's fragment layout does not cover this island's {n} tensors exactly "
                              f"once")
        announced = len(layout) if announced is None else int(announced)
        if len(layout) != announced:
            raise EngineError(f"the syncer announced {announced} fragments but sent {len(layout)}")
        if len(numels) != len(layout):
            raise EngineError(f"the syncer announced {len(numels)} fragment sizes for {len(layout)} fragments")
        self.layout = layout
        self.states: List[FragmentState] = []
        for f, idx in enumerate(layout):
            off, offs, starts = 0, {}, []
            for e in idx:
                offs[e] = off
                starts.append(off)
                off += int(entry_numels[e])
            if off != int(numels[f]):
                raise EngineError(f"fragment {f}: the syncer counts {numels[f]} values, this island {off}")
            self.states.append(FragmentState(f, idx, offs, starts, off))

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[FragmentState]:
        return iter(self.states)

    def __getitem__(self, f: int) -> FragmentState:
        return self.states[f]

    @property
    def numels(self) -> List[int]:
        return [s.numel for s in self.states]

    def count_step(self, tokens: int) -> None:
        for s in self.states:
            s.count(tokens)

    def pending(self) -> List[FragmentState]:
        """Fragments with a push awaiting its answer, by fragment number."""
        return [s for s in self.states if s.pending is not None]

    def anchors(self) -> List[int]:
        return [s.anchor_version for s in self.states]
