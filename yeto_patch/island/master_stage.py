"""Installs in two halves, so that the training thread only touches what it holds (part of ``MasterView``).

- ``stage(indices, sources, comm)`` (collective on a background group, off the training thread): rank 0's values
  of a merged base go to every rank that holds them, in the view's chunked rounds: to each element's owner
  first, which (for a base update, ``relative``) adds them to its anchor, one update after the other; then from
  the owner to the shard's other holders (DP replicas, the tied output-layer copy). Each rank keeps what it holds
  as host float32 chunks: its staging buffers (about one copy of what it holds of the fragment). Nothing on the
  training path is read or written, except the anchors of a base update, which only installs change and which
  the engine never installs while the fragment is staged.
- ``install_staged(staged, mode, alpha)`` (local, no communication, on the training thread at rank 0's plan):
  replace, or blend ``alpha * current + (1 - alpha) * value`` with the rank's own current FP32 master, then write
  masters and model parameters (cast) as ``write`` does; the owners' anchors become the value. Adam moments are
  not touched.

Bits: ``stage`` + ``install_staged`` give exactly what ``write`` gives for every rank that has a FP32 master of
what it holds (owners; replicas of a non-distributed optimizer, whose masters equal the owner's) and for every
replace. A holder without a master (a DistributedOptimizer rank's bf16 copy of another rank's shard) blends
from its model parameter cast to float32: with a bf16 model that copy equals the owner's cast up to one bf16
rounding, for the one step until Megatron's next parameter all-gather overwrites it with the owner's.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

_F32 = 4


class StagedInstalls:
    """Mixed into ``MasterView`` (it uses the view's layout, rounds, transfers and install)."""

    def holder_sets(self) -> list:
        """Rank sets that hold a tensor-parallel shard together (a background comm needs their gloo groups:
        ``comm.subgroups(view.holder_sets())``, collective)."""
        return [sh.holders for lay in self.layout.values() for sh in lay.shards]

    def stage(self, indices: Optional[Sequence[int]], sources, comm, *, relative: Optional[bool] = None) -> list:
        """Collective on `comm`: rank 0's `sources` (a list of ``source(index, offset, count)``: one absolute
        base, or the base updates in order with ``relative``) to every holder. Returns this rank's staging:
        [(entry, shard, x, y, owner, float32 values of [x, y))], for ``install_staged``."""
        from yeto_patch.island.collective import IslandError
        if self.rank == 0 and not sources:
            raise IslandError("stage: rank 0 needs at least one source")
        plan = self._plan("stage", indices, comm=comm, relative=None if relative is None else bool(relative),
                          updates=len(sources) if sources else None)
        relative, k = bool(plan["relative"]), int(plan["updates"])
        if relative:   # value = anchor + changes: every owner needs the anchor of what it owns (agreed first)
            self._agree_anchors(plan["entries"], comm, "stage: anchors of a base update")
        sources = list(sources) if self.rank == 0 else [None] * k
        staged, pending_err = [], None
        for rnd in self._items(plan):
            pending_err = self._stage_round(rnd, sources, relative, comm, staged, pending_err)
        comm.agree(pending_err, "stage: values")
        return staged

    def _stage_round(self, rnd, sources, relative: bool, comm, staged: list, pending_err):
        """One round of stage: every update to the owners (each added to the running value), the final values
        from the owners to the holders. Returns the error to agree on at the end (None: none)."""
        running = {}   # owner: (entry, shard, x, y) -> value so far (anchor + the updates received)
        vals = []
        for i, source in enumerate(sources):
            last = i == len(sources) - 1
            # (clone: rank 0's own part is a copy, never a view of the source, which the install changes in place)
            vals, works, nbytes, pending_err = self._scatter_round(rnd, source, True, pending_err, comm=comm,
                                                                   holders=last)
            self._note(nbytes)
            comm.wait_all(works, "stage: scatter to owners")
            if relative:
                for it, r, x, y, o, t in vals:
                    if o != self.rank:
                        continue
                    key = (it.entry, r, x, y)
                    try:
                        t.add_(running[key] if key in running else self._anchor_slice(it.entry, r, x, y))
                    except Exception as ex:  # noqa: BLE001 - agreed below
                        pending_err = pending_err or ex
                    running[key] = t
        bworks = []
        for it, r, x, y, o, t in vals:
            w = comm.broadcast(t, o, self.layout[it.entry].shards[r].holders, async_op=True)
            if w is not None:
                bworks.append(w)
        comm.wait_all(bworks, "stage: broadcast to holders")
        # no agreement per round (unlike write): nothing is installed here, one agreement at the end suffices
        staged.extend((it.entry, r, x, y, o, t) for it, r, x, y, o, t in vals)
        return pending_err

    def install_staged(self, staged: List[tuple], mode: str, alpha: Optional[float] = None) -> None:
        """Local: install this rank's staging (``stage``'s result, after every rank staged it): mode "replace"
        (value) or "blend" (alpha * current + (1 - alpha) * value); the owners' anchors become the value."""
        from yeto_patch.island.collective import IslandError
        if mode not in ("replace", "blend"):
            raise IslandError(f"install_staged: mode must be 'replace' or 'blend', got {mode!r}")
        if mode == "blend" and (alpha is None or not 0.0 <= float(alpha) <= 1.0):
            raise IslandError(f"install_staged: blend needs 0 <= alpha <= 1, got {alpha!r}")
        self._quiesce_param_gather()
        self._allocate_anchors(sorted({e for e, *_ in staged}))   # (kept as they are where they exist)
        for e, r, x, y, o, t in staged:
            if o == self.rank:   # anchor := value (before the blend, which then works in place)
                self._anchor_slice(e, r, x, y).copy_(t)
            if mode == "blend":   # (the same float32 operations as write's owner: value * (1 - a) + a * current)
                t.mul_(1.0 - float(alpha)).add_(self._current(e, r, x, y), alpha=float(alpha))
            self._install(e, r, x, y, t, anchor=False)

    def _current(self, e, r, x, y) -> torch.Tensor:
        """This rank's current [x, y) of shard r on the host: its FP32 master where it has one, else its model
        parameter (see the module docstring; a bf16 host param is added as it is, its float32 value exactly)."""
        m = self._master.get((e, r))
        if m is not None and m.start <= x and y <= m.end:
            cur = m.master[x - m.start: y - m.start]
            return cur if cur.device.type == "cpu" and cur.dtype == torch.float32 else \
                cur.to(device="cpu", dtype=torch.float32)
        from yeto_patch.island.master_refs import _flat
        param = _flat(self._local[(e, r)].param.data)[x:y]
        if m is None or max(x, m.start) >= min(y, m.end):
            return param if param.device.type == "cpu" else param.to(device="cpu")
        cur = param.to(device="cpu", dtype=torch.float32, copy=True)
        if m is not None:
            lo, hi = max(x, m.start), min(y, m.end)
            if lo < hi:
                cur[lo - x: hi - x].copy_(m.master[lo - m.start: hi - m.start])
        return cur

    def staged_bytes(self, staged: List[tuple]) -> int:
        return sum(int(t.numel()) * _F32 for *_, t in staged)
