"""Installs in two halves, so that the training thread only touches the FP32 masters it holds (``MasterStage``,
owned by a ``MasterView`` and using its public interface: layout, rounds, transfers, slices, anchors).

- ``stage(indices, sources, comm, alpha=)`` (collective on a background group, off the training thread): rank 0's
  values of a merged base go, in the view's chunked rounds, to each element's owner, which (for a base update,
  ``relative``) adds them to its anchor, one update after the other, and from the owner to the other ranks with
  a FP32 master of it (a non-distributed optimizer's DP replicas, the tied output-layer copy). A rank keeps one
  float32 buffer per master it holds, shaped like the master (its ``StagedPart``); for a blend it also prepares
  ``(1 - alpha) * value`` there, in the background. Ranks that hold only a model parameter of an element (a
  DistributedOptimizer's copy of another rank's shard) keep nothing. Nothing on the training path is read or
  written except the anchors of a base update, which only installs change and which the engine never installs
  while the fragment is staged.
- ``install_masters(staged, leaf=, params=)`` (local, on the training thread): each master := value (replace) or
  ``scaled + alpha * master`` (blend), in one pass; its other FP32 / low-precision copies follow; the owners'
  anchors become the value (the staging buffer itself becomes the anchor: no copy). Adam moments are not touched.
  The engine calls it inside the optimizer step, just before Megatron's own ``_copy_main_params_to_model_params``
  of the master's leaf optimizer (``leaf``): Megatron then casts the masters into the model parameters and
  gathers them to the replicas as it does every step, so the training thread's install costs one pass over the
  rank's own masters. Where no such point came (a skipped update, an optimizer that never copies, a base
  installed after the step at the tau bound or at tau = 0), it installs after the step with ``params=True`` and
  ``refresh_holders`` (collective, on the view's group) sends the owners' new parameters to the ranks without a
  master of them.

Bits: every master, anchor and model parameter ends up exactly as ``write`` leaves them (the blend is the same
float32 operation, ``value * (1 - alpha) + alpha * master``, on the same operands), and a replica's parameter is
the owner's cast, from Megatron's gather or from ``refresh_holders``.

Memory per staged fragment on a rank: one float32 copy of the masters it holds of it, a second for a blend's
scaled values (released at the install; the first becomes the anchor, replacing the old one), plus a chunk.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from typing import List, Optional, Sequence, Tuple

import torch

_F32 = 4


class _Releaser:
    """Frees large host buffers on a thread of its own: giving a fragment-sized block back to the system costs
    about half a memcpy of it, which the training thread need not pay at an install."""

    def __init__(self):
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._t: Optional[threading.Thread] = None

    def drop(self, objs: list) -> None:
        with self._lock:
            if self._t is None or not self._t.is_alive():
                self._t = threading.Thread(target=self._run, name="yeto-release", daemon=True)
                self._t.start()
        self._q.put(objs)

    def _run(self) -> None:
        while True:
            objs = self._q.get()
            objs.clear()   # (the last references: the buffers are freed here)
            del objs


RELEASER = _Releaser()


@dataclasses.dataclass
class StagedPart:
    """This rank's staged base over one FP32 master: local flat [start, end) of shard `shard` of `entry`."""
    entry: int
    shard: int
    start: int
    end: int
    value: torch.Tensor                      # float32 host, the base over [start, end)
    owned: List[Tuple[int, int]]             # sub-ranges this rank owns: its anchor := value there
    scaled: Optional[torch.Tensor] = None    # blend: (1 - alpha) * value, prepared in the background
    done: bool = False                       # installed


@dataclasses.dataclass
class StagedBase:
    """One fragment's base staged on this rank (``stage``'s result)."""
    parts: List[StagedPart]
    alpha: Optional[float]                   # the blend's alpha the parts are prepared for (None: replace)
    entries: List[int]                       # the stage's entries (every rank's; a rank may hold parts of fewer)

    @property
    def nbytes(self) -> int:
        return sum(int(p.value.numel()) * _F32 * (2 if p.scaled is not None else 1) for p in self.parts)

    @property
    def uninstalled(self) -> bool:
        return any(not p.done for p in self.parts)


class MasterStage:
    """The staged installs of one ``MasterView`` (see the module docstring); the view delegates to it."""
    __slots__ = ("view", "_needs_refresh")

    def __init__(self, view):
        self.view = view
        self._needs_refresh: Optional[bool] = None

    def holder_sets(self) -> list:
        """Rank sets that hold a tensor-parallel shard together (a background comm needs their gloo groups:
        ``comm.subgroups(view.holder_sets())``, collective)."""
        return [sh.holders for lay in self.view.layout.values() for sh in lay.shards]

    def needs_refresh(self) -> bool:
        """Some rank holds a model parameter it has no FP32 master of (a DistributedOptimizer's replica): a base
        installed after Megatron's parameter gather must be sent to it (``refresh_holders``). Same on every rank."""
        if self._needs_refresh is None:
            self._needs_refresh = any(set(sh.holders) - set(sh.master_holders(x, y))
                                      for lay in self.view.layout.values() for sh in lay.shards
                                      for x, y, _o in sh.owners)
        return self._needs_refresh

    # ------------------------------------------------------------------------------------- stage (background)
    def stage(self, indices: Optional[Sequence[int]], sources, comm, *, relative: Optional[bool] = None,
              alpha: Optional[float] = None) -> StagedBase:
        """Collective on `comm`: rank 0's `sources` (a list of ``source(index, offset, count)``: one absolute
        base, or the base updates in order with ``relative``) to every rank with a FP32 master of them; with
        `alpha` (a blend; rank 0's) each part's ``(1 - alpha) * value`` is prepared too."""
        from yeto_patch.island.masters.collective import IslandError
        if self.view.rank == 0 and not sources:
            raise IslandError("stage: rank 0 needs at least one source")
        if self.view.rank == 0 and alpha is not None and not 0.0 <= float(alpha) <= 1.0:
            raise IslandError(f"stage: blend needs 0 <= alpha <= 1, got {alpha!r}")
        plan = self.view.plan_op("stage", indices, comm=comm, relative=None if relative is None else bool(relative),
                          updates=len(sources) if sources else None,
                          alpha=None if alpha is None else float(alpha))
        relative, k = bool(plan["relative"]), int(plan["updates"])
        if relative:   # value = anchor + changes: every owner needs the anchor of what it owns (agreed first)
            self.view.agree_anchors(plan["entries"], comm, "stage: anchors of a base update")
        parts, pending_err = self._staging_parts(plan["entries"], relative)
        sources = list(sources) if self.view.rank == 0 else [None] * k
        for rnd in self.view.rounds(plan):
            pending_err = self._stage_round(rnd, sources, relative, comm, parts, pending_err)
        comm.agree(pending_err, "stage: values")
        out = StagedBase(list(parts.values()), plan["alpha"], list(plan["entries"]))
        if out.alpha is not None:   # (the same float32 operation as write's owner: value * (1 - alpha))
            for p in out.parts:
                p.scaled = torch.mul(p.value, 1.0 - out.alpha)
        return out

    def _staging_parts(self, entries, relative: bool):
        """{(entry, shard): StagedPart} over this rank's masters of `entries`; a base update starts from the
        anchor on the owned ranges. Returns (parts, error to agree on)."""
        parts, err = {}, None
        for e in entries:
            for r, sh in enumerate(self.view.layout[e].shards):
                m = self.view.master_ref(e, r)
                if m is None or m.end <= m.start:
                    continue
                owned = [(x, y) for x, y, o in sh.owners if o == self.view.rank]
                part = StagedPart(e, r, m.start, m.end, torch.empty(m.end - m.start, dtype=torch.float32), owned)
                if relative:
                    try:
                        for x, y in owned:
                            part.value[x - m.start: y - m.start].copy_(self.view.anchor_slice(e, r, x, y))
                    except Exception as ex:  # noqa: BLE001 - agreed at the end of the stage
                        err = err or ex
                parts[(e, r)] = part
        return parts, err

    def _stage_round(self, rnd, sources, relative: bool, comm, parts: dict, pending_err):
        """One round of stage: every update to the owners (an absolute base straight into their staging, an
        update added to it), then the owners' values to the other master holders. Returns the error to agree on
        at the end (None: none)."""
        def into(e, r, x, y):
            p = parts.get((e, r))
            return None if p is None or relative else p.value[x - p.start: y - p.start]

        for source in sources:
            vals, works, nbytes, pending_err = self.view.scatter_round(rnd, source, False, pending_err, comm=comm,
                                                                   holders=False, into=into)
            self.view.note_buffer(nbytes)
            comm.wait_all(works, "stage: scatter to owners")
            if relative:
                for it, r, x, y, o, t in vals:
                    p = parts.get((it.entry, r))
                    if o != self.view.rank or p is None:
                        continue
                    p.value[x - p.start: y - p.start].add_(t)
        return self._stage_to_master_holders(rnd, comm, parts, pending_err)

    def _stage_to_master_holders(self, rnd, comm, parts: dict, pending_err):
        """The owners' staged values to the shard's other ranks with a master of them (broadcast on the shard's
        holder group; a holder without a master receives into a scratch chunk and drops it)."""
        bworks, copies = [], []
        for it in rnd:
            if it.virtual:
                continue
            lay = self.view.layout[it.entry]
            for r, x, y, o, _a in self.view.transfers(it):
                sh = lay.shards[r]
                if self.view.rank not in sh.holders or len(sh.master_holders(x, y)) <= 1:
                    continue
                p = parts.get((it.entry, r))
                if p is not None and p.start <= x and y <= p.end:
                    buf = p.value[x - p.start: y - p.start]
                else:
                    buf = torch.empty(y - x, dtype=torch.float32)
                    self.view.note_buffer((y - x) * _F32)
                    if p is not None:   # part of [x, y) only: copied out after the broadcast
                        copies.append((p, x, y, buf))
                w = comm.broadcast(buf, o, sh.holders, async_op=True)
                if w is not None:
                    bworks.append(w)
        comm.wait_all(bworks, "stage: broadcast to master holders")
        for p, x, y, buf in copies:
            lo, hi = max(x, p.start), min(y, p.end)
            if lo < hi:
                p.value[lo - p.start: hi - p.start].copy_(buf[lo - x: hi - x])
        return pending_err

    # ------------------------------------------------------------------------------------- install (training thread)
    def install_masters(self, staged: StagedBase, leaf: Optional[int] = None, params: bool = True) -> int:
        """Local: install the parts of `staged` not installed yet (only those whose master belongs to the leaf
        optimizer with id `leaf`, if given). ``params=False``: the model parameter is left to Megatron's cast
        where it makes one (the pre-copy point); otherwise every part's parameter range is written (cast).
        Returns the number of parts installed now."""
        self.view.quiesce_param_gather()
        self.view.allocate_anchors(sorted({p.entry for p in staged.parts if p.owned}))   # (existing ones kept)
        n = 0
        for p in staged.parts:
            m = self.view.master_ref(p.entry, p.shard)
            if p.done or (leaf is not None and m.leaf != leaf):
                continue
            self._install_part(p, m, staged.alpha, params or not m.cast_by_megatron)
            n += 1
        return n

    def _install_part(self, p: StagedPart, m, alpha: Optional[float], write_param: bool) -> None:
        from yeto_patch.island.masters.refs import flat_view, same_storage
        master = m.master
        if alpha is None:
            master.copy_(p.value)
        elif master.device.type == "cpu":
            torch.add(p.scaled, master, alpha=alpha, out=master)
        else:   # a chunk at a time: no device allocation beyond a chunk
            step = self.view.chunk_elems
            for i in range(0, master.numel(), step):
                seg = master[i: i + step]
                torch.add(p.scaled[i: i + step].to(master.device), seg, alpha=alpha, out=seg)
        for c in list(m.extra_fp32) + list(m.extra_lowp):
            c.copy_(master)
        lp = self.view.local_param(p.entry, p.shard)
        if write_param and not same_storage(master, lp.param):
            flat_view(lp.param.data)[p.start: p.end].copy_(master)
        RELEASER.drop([p.scaled, self._set_anchor(p)])
        p.scaled, p.done = None, True

    def _set_anchor(self, p: StagedPart) -> Optional[torch.Tensor]:
        """The owner's anchor := the staged value: the staging buffer becomes the anchor where it covers it
        (returns the old anchor's buffer, to free), else the value is copied in."""
        if not p.owned:
            return None
        x0, y0, old = self.view.anchor_range(p.entry, p.shard)
        if p.owned == [(p.start, p.end)] and (x0, y0) == (p.start, p.end):
            self.view.replace_anchor(p.entry, p.shard, p.value)
            return old
        for x, y in p.owned:
            self.view.anchor_slice(p.entry, p.shard, x, y).copy_(p.value[x - p.start: y - p.start])
        return None

    def refresh_holders(self, indices: Sequence[int]) -> None:
        """Collective on the view's group (the training thread): each owner's model parameters of `indices` to
        the shard's other holders, where some holder has no FP32 master of them (after an install that came
        after Megatron's own parameter gather)."""
        from yeto_patch.island.masters.refs import flat_view
        plan = self.view.plan_op("refresh", indices)
        pending_err = None
        for rnd in self.view.rounds(plan):
            works, copies = [], []
            for it in rnd:
                if it.virtual:
                    continue
                sh_all = self.view.layout[it.entry].shards
                for r, x, y, o, _a in self.view.transfers(it):
                    sh = sh_all[r]
                    if self.view.rank not in sh.holders or not set(sh.holders) - set(sh.master_holders(x, y)):
                        continue
                    try:
                        param = flat_view(self.view.local_param(it.entry, r).param.data)[x:y]
                        buf = param if param.device.type == "cpu" else param.to("cpu")
                    except Exception as ex:  # noqa: BLE001 - keep the transfers going, agreed below
                        pending_err = pending_err or ex
                        param = buf = torch.zeros(y - x)
                    if buf is not param and self.view.rank != o:
                        copies.append((param, buf))
                    w = self.view.comm.broadcast(buf, o, sh.holders, async_op=True)
                    if w is not None:
                        works.append(w)
            self.view.comm.wait_all(works, "refresh: parameters to holders")
            for param, buf in copies:
                param.copy_(buf)
        self.view.comm.agree(pending_err, "refresh: parameters")
