"""Reads of an island's FP32 masters, streamed to rank 0 in bounded chunks (``MasterRead``, owned by a
``MasterView`` and using its public interface: plans, rounds, transfers, slices and anchors).

- ``read(indices, sink)``: rank 0's ``sink(entry, offset, array)`` gets float32 chunks of the full tensors, in
  order; each owner sends only what it owns straight to rank 0 (interleaved tensor-parallel shards are assembled
  there).
- ``read_delta(indices, sink)``: the same with ``anchor - current``, computed where the data lives.
- ``gather(indices, snap, sink, comm)``: a push's delta from each rank's ``snapshot_delta``, on any thread and
  comm: exactly what ``read_delta`` gave at the snapshot.
Errors: one agreement per round (an owner's error, or rank 0's sink error of the previous round), raised on
every rank with its original message.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from yeto_patch.island.masters.collective import IslandComm, IslandError

_F32 = 4


class MasterRead:
    """The reads of one ``MasterView`` (see the module docstring); the view delegates to it."""
    __slots__ = ("view",)

    def __init__(self, view):
        self.view = view

    def read(self, indices: Optional[Sequence[int]] = None, sink: Optional[Callable] = None) -> None:
        """Stream full float32 tensors of `indices` (default: all) to `sink(index, offset, array)` on rank 0."""
        self._read("read", indices, sink, delta=False)

    def read_delta(self, indices: Optional[Sequence[int]] = None, sink: Optional[Callable] = None) -> None:
        """Like read, with anchor - current (the pseudo-gradient) computed by each owner."""
        self._read("read_delta", indices, sink, delta=True)

    def gather(self, indices: Sequence[int], snap, sink: Optional[Callable], comm: IslandComm) -> None:
        """Collective on `comm` (every rank, with its own ``snapshot_delta`` of the same `indices`): rank 0's
        `sink(entry, offset, array)` gets anchor - snapshot in read order, as ``read_delta`` would have at the
        snapshot. The delta is computed in the snapshot's own buffer, a chunk at a time (the snapshot is spent)."""
        def values(e, r, x, y):
            x0, y0, buf = snap.get((e, r), (0, 0, None))
            if buf is None or not (x0 <= x and y <= y0):
                raise IslandError(f"internal: rank {self.view.rank}'s snapshot of '{self.view.manifest.entries[e].name}' "
                                  f"shard {r} lacks [{x}, {y})")
            part = buf[x - x0: y - x0]
            return torch.sub(self.view.anchor_slice(e, r, x, y), part, out=part)
        self._read("gather", indices, sink, delta=False, values=values, comm=comm)

    def _own_values(self, e, r, x, y, delta: bool):
        """(float32 host values of this rank's own [x, y) of shard r: master or anchor - master, extra bytes)."""
        src, extra = self.view.master_slice(e, r, x, y), 0
        if src.device.type != "cpu" or src.dtype != torch.float32:
            src = src.to(device="cpu", dtype=torch.float32)   # host copy, never device memory
            extra += src.numel() * _F32
        if delta:
            src = self.view.anchor_slice(e, r, x, y) - src
            extra += src.numel() * _F32
        return src, extra

    def _read(self, op, indices, sink, delta, values=None, comm=None):
        """Stream to rank 0's `sink`: the masters, their deltas (`delta`), or `values(e, r, x, y)` of this rank's
        own elements (a snapshot: ``gather``); on `comm` (default: the view's)."""
        comm = comm or self.view.comm
        if self.view.rank == 0 and sink is None:
            raise IslandError(f"{op}: rank 0 needs a sink")
        plan = self.view.plan_op(op, indices, comm=comm)
        if delta:
            self.view.agree_anchors(plan["entries"], comm, f"{op}: anchors")
        pending_err = None
        for rnd in self.view.rounds(plan):
            self.view.stats["rounds"] += 1
            works, keep, nbytes = [], [], 0
            assembled = []   # rank 0: (item, out tensor, per-shard bufs or None)
            for it in rnd:
                lay = self.view.layout[it.entry]
                outer, s, T, seg = lay.geometry
                interleave = it.rows is not None and T > 1
                out = bufs = None
                if self.view.rank == 0:
                    out = (torch.zeros if it.virtual else torch.empty)(it.count, dtype=torch.float32)
                    nbytes += it.count * _F32
                    if interleave:
                        n_o = it.rows[1] - it.rows[0]
                        bufs = [torch.empty(n_o * s * seg, dtype=torch.float32) for _ in range(T)]
                        nbytes += it.count * _F32
                    assembled.append((it, out, bufs))
                for r, x, y, o, a in self.view.transfers(it):
                    if self.view.rank == 0:
                        dst = (bufs[r] if interleave else out)[x - a: y - a]
                    if o == self.view.rank:
                        try:
                            if pending_err is not None:
                                raise pending_err
                            if values is not None:
                                src = values(it.entry, r, x, y)
                            else:
                                src, extra = self._own_values(it.entry, r, x, y, delta)
                                nbytes += extra
                        except Exception as ex:  # noqa: BLE001 - keep the transfers going, agree below
                            pending_err = pending_err or ex
                            src = torch.zeros(y - x, dtype=torch.float32)
                        if self.view.rank == 0:
                            dst.copy_(src)
                        else:
                            src = src.contiguous()
                            keep.append(src)
                            works.append(comm.isend(src, 0))
                    elif self.view.rank == 0:
                        works.append(comm.irecv(dst, o))
            self.view.note_buffer(nbytes)
            comm.wait_all(works, f"{op}: gather")
            # one agreement per round: an owner's error, or rank 0's sink error of the previous round
            comm.agree(pending_err, f"{op}: gather")
            if self.view.rank == 0:
                try:
                    for it, out, bufs in assembled:
                        if bufs is not None:
                            n_o = it.rows[1] - it.rows[0]
                            outer, s, T, seg = self.view.layout[it.entry].geometry
                            view = out.view(n_o, s, T, seg)
                            for r, b in enumerate(bufs):
                                view[:, :, r, :].copy_(b.view(n_o, s, seg))
                        sink(it.entry, it.offset, out.numpy())
                except Exception as ex:  # noqa: BLE001
                    pending_err = ex
            del assembled, keep, works
        comm.agree(pending_err, f"{op}: sink")
