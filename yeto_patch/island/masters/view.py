"""FP32 master read / write for a Megatron island, streamed in bounded chunks over gloo.

`MasterView(model_chunks, optimizer, manifest)` finds, on every rank, the FP32 master of each local parameter
(DistributedOptimizer shards, Float16OptimizerWithFloat16Params main params, FP32Optimizer params,
HybridDeviceOptimizer host masters, any of them inside a ChainedOptimizer) and agrees island-wide on:
- the read owner of every element of every entry (exactly one rank; replicas: the lowest rank),
- the holders of every tensor-parallel shard (every rank with a copy: DP replicas, the tied output-layer copy),
  with one gloo group per distinct holder set (these are host mirrors of Megatron's data-parallel, expert
  data-parallel and embedding groups, derived from what each rank actually holds).

Operations (collective: every rank calls the same operation; rank 0's arguments are broadcast as a JSON plan,
the others may pass None, and a rank that passes different arguments makes every rank raise):
- `read(indices, sink)`: rank 0 gets `sink(entry_index, offset, array)` calls with float32 numpy chunks of
  the full tensors, in order (offset = flat element offset in the full tensor). Each owner sends only what it
  owns straight to rank 0.
- `read_delta(indices, sink)`: the same with `anchor - current`, computed where the data lives.
- `write(indices, source, mode="replace"|"blend", alpha=None, set_anchor=False)`: rank 0's
  `source(entry_index, offset, count)` values (or a dict of full arrays) go to each element's owner, which
  (blend) computes `alpha * current + (1 - alpha) * value`, and are broadcast to every holder, which installs
  them into its FP32 masters and its model parameters (cast to their dtype). Adam moments and step counts are
  not touched. With `set_anchor` the owners' anchors become the installed values. With `relative` rank 0's
  values are a change: each owner adds its anchor first (value = anchor + change, in float32), so a syncer that
  sends quantized base updates is followed bit for bit (the anchors must hold the previous base exactly).
- `snapshot_anchor(indices)` / `set_anchor_from_current(indices)`: local, no communication.

Memory: per round at most `chunk_bytes` of payload; rank 0 holds at most ~2 chunks (assembly of interleaved
tensor-parallel shards), other ranks at most ~1 chunk, plus the anchors (one float32 copy of the elements a
rank owns). Nothing is allocated on an accelerator. `stats["peak_buffer_bytes"]` records the peak.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from yeto_patch.island.masters.collective import IslandComm, IslandError
from yeto_patch.island.masters.layout import EntryLayout, Item, ShardLayout, build_items, chunk_rounds, cover
from yeto_patch.island.masters.refs import MasterRef, find_masters, flat_view, same_storage
from yeto_patch.island.masters.stage import StagedInstalls
from yeto_patch.island.masters.names import LocalParam, Manifest

DEFAULT_CHUNK_BYTES = 4 << 20
_F32 = 4


# ---------------------------------------------------------------------------------------------------------
class MasterView(StagedInstalls):
    """See the module docstring. Construction is collective (every rank of the island)."""

    def __init__(self, model_chunks, optimizer, manifest: Manifest, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 comm: Optional[IslandComm] = None):
        self.chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.optimizer = optimizer
        self.manifest = manifest
        self.comm = comm or IslandComm()
        self.rank, self.world = self.comm.rank, self.comm.world
        if chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be at least 1024, got {chunk_bytes}")
        self.chunk_elems = int(chunk_bytes) // _F32
        self.stats = {"peak_buffer_bytes": 0, "rounds": 0}
        self._seqs: Dict[int, int] = {}   # id(comm) -> plans made on it
        self.anchors: Dict[Tuple[int, int], Tuple[int, int, torch.Tensor]] = {}
        err = None
        rows = []
        self._local: Dict[Tuple[int, int], LocalParam] = {}
        self._master: Dict[Tuple[int, int], Optional[MasterRef]] = {}
        try:
            masters = find_masters(optimizer)
            for lp in manifest.local:
                key = (lp.entry, lp.shard)
                if key in self._local:
                    raise IslandError(f"rank {self.rank} holds two copies of shard {lp.shard} of "
                                      f"'{lp.name}' ({self._local[key].local_name}, {lp.local_name})")
                self._local[key] = lp
                m = masters.get(id(lp.param))
                self._master[key] = m
                own = (m.start, m.end) if m is not None and m.end > m.start else (0, 0)
                rows.append([lp.entry, lp.shard, lp.nshards, lp.partition_dim, lp.stride, list(lp.padded_shape),
                             int(np.prod(lp.full_shape)), own[0], own[1], lp.local_numel])
        except Exception as e:  # noqa: BLE001
            err = e
        self.comm.agree(err, "MasterView: find FP32 masters")
        table = self.comm.all_gather_json(rows, "MasterView: layout table")
        err = None
        try:
            self.layout = self._layout_from(table)
        except Exception as e:  # noqa: BLE001
            err = e
        self.comm.agree(err, "MasterView: layout")
        self.comm.subgroups(self.holder_sets())

    # -- layout ---------------------------------------------------------------------------------------------
    def _layout_from(self, table) -> Dict[int, EntryLayout]:
        per_entry: Dict[int, dict] = {}
        for rank, rows in enumerate(table):
            for e, r, T, d, s, padded, kept, own_s, own_e, n_local in rows:
                info = per_entry.setdefault(e, dict(geo=(tuple(padded), kept, T, d, s, n_local), shards={}))
                if info["geo"] != (tuple(padded), kept, T, d, s, n_local):
                    raise IslandError(f"'{self.manifest.entries[e].name}': ranks disagree on its sharding "
                                      f"{info['geo']} vs {(tuple(padded), kept, T, d, s, n_local)} (rank {rank})")
                info["shards"].setdefault(r, []).append((rank, own_s, own_e))
        layout = {}
        for e, entry in enumerate(self.manifest.entries):
            if e not in per_entry:
                raise IslandError(f"'{entry.name}' is held by no rank")
            (padded, kept, T, d, s, n_local), shards = per_entry[e]["geo"], per_entry[e]["shards"]
            if sorted(shards) != list(range(T)):
                raise IslandError(f"'{entry.name}': tensor-parallel shards {sorted(shards)} of {T} are held")
            out = []
            for r in range(T):
                holders = tuple(sorted({x[0] for x in shards[r]}))
                out.append(ShardLayout(cover(entry.name, r, n_local, shards[r]), holders,
                                       sorted((a, b, rk) for rk, a, b in shards[r] if b > a)))
            layout[e] = EntryLayout(padded, kept, T, d, s, out)
            if kept != entry.numel:
                raise IslandError(f"internal: '{entry.name}' keeps {kept} elements, manifest says {entry.numel}")
        return layout

    # -- plan -------------------------------------------------------------------------------------------------
    def _plan(self, op: str, indices, comm: Optional[IslandComm] = None, **kw) -> dict:
        """Rank 0's plan, broadcast as JSON on `comm` (default: the view's; each comm counts its own calls); a
        rank that asked for something else makes every rank raise."""
        comm = comm or self.comm
        seq = self._seqs[id(comm)] = self._seqs.get(id(comm), 0) + 1
        plan = None
        if self.rank == 0:
            try:
                idx = [int(i) for i in indices] if indices is not None else list(range(len(self.manifest)))
                bad = [i for i in idx if not 0 <= i < len(self.manifest)]
                if bad:
                    raise IslandError(f"{op}: entry indices {bad[:5]} outside the manifest of {len(self.manifest)}")
                if len(set(idx)) != len(idx):
                    raise IslandError(f"{op}: repeated entry indices")
                plan = dict(op=op, entries=idx, chunk_elems=self.chunk_elems, seq=seq, **kw)
            except Exception as e:  # noqa: BLE001
                plan = dict(op=op, error=str(e), seq=seq)
        plan = comm.broadcast_plan(plan, what=f"{op}: plan")
        if "error" in plan:
            raise IslandError(plan["error"] + " [island rank 0]", 0)
        err = None
        if plan["op"] != op or plan["seq"] != seq:
            err = IslandError(f"rank {self.rank} called {op} (#{seq}) while rank 0 called "
                              f"{plan['op']} (#{plan['seq']})")
        elif indices is not None and self.rank != 0 and [int(i) for i in indices] != plan["entries"]:
            err = IslandError(f"rank {self.rank} asked to {op} entries different from rank 0's")
        else:
            for k, v in kw.items():
                if self.rank != 0 and v is not None and plan.get(k) != v:
                    err = IslandError(f"rank {self.rank}: {op} argument {k}={v!r} differs from rank 0's {plan.get(k)!r}")
        comm.agree(err, f"{op}: plan check")
        return plan

    def _items(self, plan) -> List[List[Item]]:
        items = []
        for e in plan["entries"]:
            items.extend(build_items(e, self.layout[e], plan["chunk_elems"]))
        return chunk_rounds(items, plan["chunk_elems"])

    def _transfers(self, it: Item):
        """[(r, x, y, owner, a)] for the item: owner's local [x, y) of shard r; a = start of the part."""
        lay = self.layout[it.entry]
        out = []
        for r, a, b in it.parts(lay):
            for x, y, o in lay.shards[r].owners:
                lo, hi = max(a, x), min(b, y)
                if lo < hi:
                    out.append((r, lo, hi, o, a))
        return out

    def _note(self, nbytes):
        self.stats["peak_buffer_bytes"] = max(self.stats["peak_buffer_bytes"], nbytes)

    # -- local helpers -----------------------------------------------------------------------------------------
    def _master_slice(self, e, r, x, y) -> torch.Tensor:
        m = self._master.get((e, r))
        if m is None or not (m.start <= x and y <= m.end):
            raise IslandError(f"internal: rank {self.rank} has no master for "
                              f"'{self.manifest.entries[e].name}' shard {r} [{x}, {y})")
        return m.master[x - m.start: y - m.start]

    def _anchor_slice(self, e, r, x, y) -> torch.Tensor:
        a = self.anchors.get((e, r))
        if a is None or not (a[0] <= x and y <= a[1]):
            raise IslandError(f"no anchor for '{self.manifest.entries[e].name}' on rank {self.rank}: "
                              f"call snapshot_anchor (or write with set_anchor=True) before read_delta")
        return a[2][x - a[0]: y - a[0]]

    def _owned_hulls(self, indices) -> Dict[Tuple[int, int], List[int]]:
        """(entry, shard) -> [x0, y0]: the hull of what this rank owns of each shard of `indices`."""
        hull: Dict[Tuple[int, int], List[int]] = {}
        for e, r, x, y in self._owned(indices):
            h = hull.setdefault((e, r), [x, y])
            h[0], h[1] = min(h[0], x), max(h[1], y)
        return hull

    def _owned(self, indices):
        """(e, r, x, y) read-owned by this rank."""
        for e in indices:
            for r, sh in enumerate(self.layout[e].shards):
                for x, y, o in sh.owners:
                    if o == self.rank:
                        yield e, r, x, y

    def _agree_anchors(self, indices, comm, what: str) -> None:
        """Collective on `comm`: every rank raises, with the first failing rank's message, unless every owner has
        the anchor of each element of `indices` it owns."""
        err = None
        try:
            for e, r, x, y in self._owned(indices):
                self._anchor_slice(e, r, x, y)
        except Exception as ex:  # noqa: BLE001 - agreed below
            err = ex
        comm.agree(err, what)

    # -- anchors (local) ---------------------------------------------------------------------------------------
    def snapshot_anchor(self, indices: Optional[Sequence[int]] = None) -> None:
        """Anchor := current FP32 master, for the elements this rank owns (no communication)."""
        idx = range(len(self.manifest)) if indices is None else indices
        self._allocate_anchors(idx)
        for e, r, x, y in self._owned(idx):
            self._anchor_slice(e, r, x, y).copy_(self._master_slice(e, r, x, y))

    def _allocate_anchors(self, indices) -> None:
        """An anchor buffer per owned shard range of ``indices`` (the hull of what this rank owns; an existing
        one of the same range is kept, its values unchanged)."""
        for (e, r), (x0, y0) in self._owned_hulls(indices).items():
            a = self.anchors.get((e, r))
            if a is None or a[0] != x0 or a[1] != y0:
                self.anchors[(e, r)] = (x0, y0, torch.empty(y0 - x0, dtype=torch.float32))

    set_anchor_from_current = snapshot_anchor

    def anchor_bytes(self) -> int:
        return sum(a[2].numel() * _F32 for a in self.anchors.values())

    # -- read ----------------------------------------------------------------------------------------------
    def read(self, indices: Optional[Sequence[int]] = None, sink: Optional[Callable] = None) -> None:
        """Stream full float32 tensors of `indices` (default: all) to `sink(index, offset, array)` on rank 0."""
        self._read("read", indices, sink, delta=False)

    def read_delta(self, indices: Optional[Sequence[int]] = None, sink: Optional[Callable] = None) -> None:
        """Like read, with anchor - current (the pseudo-gradient) computed by each owner."""
        self._read("read_delta", indices, sink, delta=True)

    def snapshot_delta(self, indices: Sequence[int], spare: Optional[torch.Tensor] = None
                       ) -> Dict[Tuple[int, int], Tuple[int, int, torch.Tensor]]:
        """Local, no communication: the FP32 masters of the elements of `indices` this rank owns, copied once into
        host float32 ((entry, shard) -> (start, end, values) per owned shard range, views of one flat buffer:
        `spare` when it is large enough, else a new one; ``snapshot_buffer(snap)`` gives it back for reuse): the
        training thread's whole share of a push. ``gather`` turns it into the delta (anchor - snapshot) and
        streams it to rank 0 later, on any thread and comm: exactly what read_delta would have sent at the
        snapshot, provided the anchors do not change in between (the engine installs nothing into a fragment
        whose push is in flight)."""
        idx = list(indices)
        hull = self._owned_hulls(idx)
        need = sum(y0 - x0 for x0, y0 in hull.values())
        flat = spare if spare is not None and spare.numel() >= need else torch.empty(need, dtype=torch.float32)
        snap, pos = {}, 0
        for k, (x0, y0) in hull.items():
            snap[k] = (x0, y0, flat[pos: pos + y0 - x0])
            pos += y0 - x0
        for e, r, x, y in self._owned(idx):
            x0, _, buf = snap[(e, r)]
            buf[x - x0: y - x0].copy_(self._master_slice(e, r, x, y))   # (device-to-host where it lives there)
        return snap

    def host_masters(self, indices: Sequence[int]) -> bool:
        """Every FP32 master this rank owns of `indices` is in host memory (its snapshot can be copied beside
        training, on another thread)."""
        return all(self._master[(e, r)].master.device.type == "cpu" for e, r, _x, _y in self._owned(list(indices)))

    def own_numel(self, indices: Sequence[int]) -> int:
        """Elements of `indices` this rank owns (what ``snapshot_delta`` of them copies)."""
        return sum(y - x for _e, _r, x, y in self._owned(list(indices)))

    @staticmethod
    def snapshot_buffer(snap) -> Optional[torch.Tensor]:
        """The flat buffer a ``snapshot_delta`` lives in (None for an empty one)."""
        for _, _, buf in snap.values():
            return buf._base if buf._base is not None else buf
        return None

    def gather(self, indices: Sequence[int], snap, sink: Optional[Callable], comm: IslandComm) -> None:
        """Collective on `comm` (every rank, with its own ``snapshot_delta`` of the same `indices`): rank 0's
        `sink(entry, offset, array)` gets anchor - snapshot in read order, as ``read_delta`` would have at the
        snapshot. The delta is computed in the snapshot's own buffer, a chunk at a time (the snapshot is spent)."""
        def values(e, r, x, y):
            x0, y0, buf = snap.get((e, r), (0, 0, None))
            if buf is None or not (x0 <= x and y <= y0):
                raise IslandError(f"internal: rank {self.rank}'s snapshot of '{self.manifest.entries[e].name}' "
                                  f"shard {r} lacks [{x}, {y})")
            part = buf[x - x0: y - x0]
            return torch.sub(self._anchor_slice(e, r, x, y), part, out=part)
        self._read("gather", indices, sink, delta=False, values=values, comm=comm)

    def _own_values(self, e, r, x, y, delta: bool):
        """(float32 host values of this rank's own [x, y) of shard r: master or anchor - master, extra bytes)."""
        src, extra = self._master_slice(e, r, x, y), 0
        if src.device.type != "cpu" or src.dtype != torch.float32:
            src = src.to(device="cpu", dtype=torch.float32)   # host copy, never device memory
            extra += src.numel() * _F32
        if delta:
            src = self._anchor_slice(e, r, x, y) - src
            extra += src.numel() * _F32
        return src, extra

    def _read(self, op, indices, sink, delta, values=None, comm=None):
        """Stream to rank 0's `sink`: the masters, their deltas (`delta`), or `values(e, r, x, y)` of this rank's
        own elements (a snapshot: ``gather``); on `comm` (default: the view's)."""
        comm = comm or self.comm
        if self.rank == 0 and sink is None:
            raise IslandError(f"{op}: rank 0 needs a sink")
        plan = self._plan(op, indices, comm=comm)
        if delta:
            self._agree_anchors(plan["entries"], comm, f"{op}: anchors")
        pending_err = None
        for rnd in self._items(plan):
            self.stats["rounds"] += 1
            works, keep, nbytes = [], [], 0
            assembled = []   # rank 0: (item, out tensor, per-shard bufs or None)
            for it in rnd:
                lay = self.layout[it.entry]
                outer, s, T, seg = lay.geometry
                interleave = it.rows is not None and T > 1
                out = bufs = None
                if self.rank == 0:
                    out = (torch.zeros if it.virtual else torch.empty)(it.count, dtype=torch.float32)
                    nbytes += it.count * _F32
                    if interleave:
                        n_o = it.rows[1] - it.rows[0]
                        bufs = [torch.empty(n_o * s * seg, dtype=torch.float32) for _ in range(T)]
                        nbytes += it.count * _F32
                    assembled.append((it, out, bufs))
                for r, x, y, o, a in self._transfers(it):
                    if self.rank == 0:
                        dst = (bufs[r] if interleave else out)[x - a: y - a]
                    if o == self.rank:
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
                        if self.rank == 0:
                            dst.copy_(src)
                        else:
                            src = src.contiguous()
                            keep.append(src)
                            works.append(comm.isend(src, 0))
                    elif self.rank == 0:
                        works.append(comm.irecv(dst, o))
            self._note(nbytes)
            comm.wait_all(works, f"{op}: gather")
            # one agreement per round: an owner's error, or rank 0's sink error of the previous round
            comm.agree(pending_err, f"{op}: gather")
            if self.rank == 0:
                try:
                    for it, out, bufs in assembled:
                        if bufs is not None:
                            n_o = it.rows[1] - it.rows[0]
                            outer, s, T, seg = self.layout[it.entry].geometry
                            view = out.view(n_o, s, T, seg)
                            for r, b in enumerate(bufs):
                                view[:, :, r, :].copy_(b.view(n_o, s, seg))
                        sink(it.entry, it.offset, out.numpy())
                except Exception as ex:  # noqa: BLE001
                    pending_err = ex
            del assembled, keep, works
        comm.agree(pending_err, f"{op}: sink")

    # -- write ---------------------------------------------------------------------------------------------
    def write(self, indices: Optional[Sequence[int]] = None, source=None, *, mode: Optional[str] = None,
              alpha: Optional[float] = None, set_anchor: Optional[bool] = None,
              anchor: Optional[str] = None, relative: Optional[bool] = None) -> None:
        """Install rank 0's full float32 values into FP32 masters and model params on every holder.

        `source(index, offset, count) -> float32 array` or a dict {index: full array} (rank 0 only).
        mode "replace": new = value; mode "blend": new = alpha * current + (1 - alpha) * value (owner's master).
        set_anchor: the owners' anchors become the installed values (anchor="installed", default) or rank 0's
        values before blending (anchor="value": DiLoCo's "anchor := base" with a blended install).
        relative: rank 0's values are changes to the owners' anchors: value = anchor + change (the anchors of
        every element written must exist).
        Ranks other than 0 may pass None for everything; what they pass is checked against rank 0's plan."""
        plan = self._write_plan(indices, source, mode, alpha, set_anchor, anchor, relative)
        relative = bool(plan.get("relative"))
        if relative:   # value = anchor + change: every owner needs the anchor of what it owns (agreed first)
            self._agree_anchors(plan["entries"], self.comm, "write: anchors for a relative write")
        if isinstance(source, dict):
            arrays = source
            source = lambda e, off, n: np.asarray(arrays[e], dtype=np.float32).reshape(-1)[off: off + n]  # noqa: E731
        self._quiesce_param_gather()
        if plan["set_anchor"] and not relative:
            self._allocate_anchors(plan["entries"])
        pending_err = None
        for rnd in self._items(plan):
            pending_err = self._write_round(rnd, source, plan, pending_err)
        self.comm.agree(pending_err, "write: install")

    def _write_plan(self, indices, source, mode, alpha, set_anchor, anchor, relative) -> dict:
        """write's arguments checked (rank 0's defaults filled in) and agreed island-wide as a plan."""
        if self.rank == 0:
            mode = mode or "replace"
            set_anchor = bool(set_anchor)
            anchor = anchor or "installed"
            relative = bool(relative)
        if anchor is not None and anchor not in ("installed", "value"):
            raise IslandError(f"write: anchor must be 'installed' or 'value', got {anchor!r}")
        if mode is not None and mode not in ("replace", "blend"):
            raise IslandError(f"write: mode must be 'replace' or 'blend', got {mode!r}")
        if mode == "blend" and (alpha is None or not 0.0 <= float(alpha) <= 1.0):
            if self.rank == 0 or alpha is not None:
                raise IslandError(f"write: blend needs 0 <= alpha <= 1, got {alpha!r}")
        if self.rank == 0 and source is None:
            raise IslandError("write: rank 0 needs a source")
        return self._plan("write", indices, mode=mode, alpha=None if alpha is None else float(alpha),
                          set_anchor=set_anchor, anchor=anchor, relative=relative)

    def _write_round(self, rnd: List[Item], source, plan: dict, pending_err):
        """One round of write: scatter to the owners, blend, broadcast to the holders, agree, install. Returns
        the error to report at the next agreement (None: none)."""
        mode, alpha, set_anchor = plan["mode"], plan["alpha"], plan["set_anchor"]
        relative = bool(plan.get("relative"))
        keep_value = set_anchor and mode == "blend" and plan["anchor"] == "value"
        self.stats["rounds"] += 1
        vals, works, nbytes, pending_err = self._scatter_round(rnd, source, mode == "blend" or relative,
                                                               pending_err)
        self._note(nbytes)
        self.comm.wait_all(works, "write: scatter to owners")
        # owners blend, then every holder gets the owner's values
        raw, bworks, nbytes, pending_err = self._blend_and_broadcast(vals, mode, alpha, relative, keep_value,
                                                                     nbytes, pending_err)
        self._note(nbytes)
        self.comm.wait_all(bworks, "write: broadcast to holders")
        # one agreement per round, before installing: nothing of a failed round is installed
        self.comm.agree(pending_err, "write: transfer")
        try:
            for k, (it, r, x, y, o, t) in enumerate(vals):
                self._install(it.entry, r, x, y, t, anchor=set_anchor and o == self.rank,
                              anchor_values=raw.get(k))
        except Exception as ex:  # noqa: BLE001 - reported at the next agreement
            pending_err = ex
        return pending_err

    def _scatter_round(self, rnd: List[Item], source, clone: bool, pending_err, comm=None, holders=True,
                       into=None):
        """Rank 0 reads the round's values and sends each owner its part; holders allocate their receive
        buffers. Returns (vals, works, nbytes, pending_err); vals: (item, r, x, y, owner, tensor) in plan order,
        on ranks that hold or own it (``clone``: rank 0 keeps a copy of what it owns, to change in place;
        ``holders=False``: owners only; ``into(entry, r, x, y)``: the owner's buffer to receive into, or None
        for a new one). On `comm` (default: the view's)."""
        comm = comm or self.comm
        works, vals, nbytes = [], [], 0
        for it in rnd:
            if it.virtual:   # rows this island does not hold: nothing to install
                continue
            lay = self.layout[it.entry]
            outer, s, T, seg = lay.geometry
            interleave = it.rows is not None and T > 1
            chunk = bufs = None
            if self.rank == 0:
                chunk, pending_err = self._source_chunk(it, source, pending_err)
                nbytes += it.count * _F32
                if interleave:
                    n_o = it.rows[1] - it.rows[0]
                    view = chunk.view(n_o, s, T, seg)
                    bufs = [view[:, :, r, :].contiguous().view(-1) for r in range(T)]
                    nbytes += it.count * _F32
            for r, x, y, o, a in self._transfers(it):
                held_by = lay.shards[r].holders
                dest = into(it.entry, r, x, y) if into is not None and self.rank == o else None
                if self.rank == 0:
                    src = (bufs[r] if interleave else chunk)[x - a: y - a]
                    if o == 0:
                        vals.append((it, r, x, y, o, dest.copy_(src) if dest is not None else
                                     src.clone() if clone else src))
                    else:
                        works.append(comm.isend(src, o))
                if self.rank == o and o != 0:
                    t = dest if dest is not None else torch.empty(y - x, dtype=torch.float32)
                    nbytes += t.numel() * _F32 if dest is None else 0
                    works.append(comm.irecv(t, 0))
                    vals.append((it, r, x, y, o, t))
                elif holders and self.rank in held_by and self.rank != o:
                    t = torch.empty(y - x, dtype=torch.float32)
                    nbytes += t.numel() * _F32
                    vals.append((it, r, x, y, o, t))
        return vals, works, nbytes, pending_err

    def _source_chunk(self, it: Item, source, pending_err):
        """Rank 0: the item's values from ``source``, checked (count, finite); zeros after an error (the
        transfers go on, the error is agreed at the end of the round). Returns (tensor, pending_err)."""
        try:
            if pending_err is not None:
                raise pending_err
            arr = np.ascontiguousarray(np.asarray(source(it.entry, it.offset, it.count),
                                                  dtype=np.float32).reshape(-1))
            if arr.size != it.count:
                raise IslandError(f"write: source gave {arr.size} values for "
                                  f"'{self.manifest.entries[it.entry].name}' at offset {it.offset}, "
                                  f"expected {it.count}")
            if not np.isfinite(arr).all():
                raise IslandError(f"write: non-finite values for '{self.manifest.entries[it.entry].name}'"
                                  f" at offset {it.offset}")
            chunk = torch.from_numpy(arr)
        except Exception as ex:  # noqa: BLE001
            pending_err = pending_err or ex
            chunk = torch.zeros(it.count, dtype=torch.float32)
        return chunk, pending_err

    def _blend_and_broadcast(self, vals, mode, alpha, relative, keep_value, nbytes, pending_err):
        """Owners turn rank 0's values into the values to install (anchor + change, blend with the current
        master) and broadcast them to the shard's holders. Returns (raw, works, nbytes, pending_err); raw:
        {position in vals: rank 0's value} kept by the owner for anchor="value"."""
        bworks = []
        raw = {}
        for k, (it, r, x, y, o, t) in enumerate(vals):
            if self.rank == o and relative:
                try:
                    t.add_(self._anchor_slice(it.entry, r, x, y))
                except Exception as ex:  # noqa: BLE001
                    pending_err = pending_err or ex
            if self.rank == o and mode == "blend":
                try:
                    if keep_value:
                        raw[k] = t.clone()
                        nbytes += t.numel() * _F32
                    cur = self._master_slice(it.entry, r, x, y)
                    if cur.device.type != "cpu" or cur.dtype != torch.float32:
                        cur = cur.to(device="cpu", dtype=torch.float32)
                    t.mul_(1.0 - alpha).add_(cur, alpha=alpha)
                except Exception as ex:  # noqa: BLE001
                    pending_err = pending_err or ex
            w = self.comm.broadcast(t, o, self.layout[it.entry].shards[r].holders, async_op=True)
            if w is not None:
                bworks.append(w)
        return raw, bworks, nbytes, pending_err

    def _install(self, e, r, x, y, t, anchor, anchor_values=None):
        lp = self._local.get((e, r))
        if lp is None:
            raise IslandError(f"internal: rank {self.rank} is a holder of '{self.manifest.entries[e].name}' "
                              f"shard {r} but has no local parameter")
        flat_view(lp.param.data)[x:y].copy_(t)
        m = self._master.get((e, r))
        if m is not None:
            lo, hi = max(x, m.start), min(y, m.end)
            if lo < hi:
                v = t[lo - x: hi - x]
                sl = slice(lo - m.start, hi - m.start)
                if not same_storage(m.master, lp.param):
                    m.master[sl].copy_(v)
                for c in m.extra_fp32:
                    c[sl].copy_(v)
                for c in m.extra_lowp:
                    c[sl].copy_(v)
        if anchor:
            self._anchor_slice(e, r, x, y).copy_(t if anchor_values is None else anchor_values)

    def _quiesce_param_gather(self):
        """Wait for any in-flight overlapped parameter all-gather, so it cannot overwrite what we install."""
        for c in self.chunks:
            for bg in list(getattr(c, "bucket_groups", []) or []) + \
                    list(getattr(c, "expert_parallel_bucket_groups", []) or []):
                h = getattr(bg, "param_gather_handle", None)
                if h is not None:
                    h.wait()


def collect_arrays(view: MasterView, indices: Optional[Sequence[int]] = None, delta: bool = False) -> dict:
    """Convenience for tests and small tools: full arrays {index: ndarray(full_shape)} on rank 0 ({} elsewhere).
    Holds the whole selection in memory: the streaming `read` is what the sync uses."""
    out = {}

    def sink(e, off, arr):
        if e not in out:
            out[e] = np.empty(view.manifest.entries[e].numel, dtype=np.float32)
        out[e][off: off + arr.size] = arr

    (view.read_delta if delta else view.read)(indices, sink if view.rank == 0 else None)
    return {e: a.reshape(view.manifest.entries[e].full_shape) for e, a in out.items()}
