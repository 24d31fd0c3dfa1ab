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

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from yeto_patch.island.masters.collective import IslandComm, IslandError
from yeto_patch.island.masters.layout import EntryLayout, Item, ShardLayout, build_items, chunk_rounds, cover
from yeto_patch.island.masters.refs import MasterRef, find_masters
from yeto_patch.island.masters.read import MasterRead
from yeto_patch.island.masters.stage import MasterStage, StagedBase
from yeto_patch.island.masters.write import MasterWrite
from yeto_patch.island.masters.names import LocalParam, Manifest

DEFAULT_CHUNK_BYTES = 4 << 20


class Transfer(NamedTuple):
    """One owner's part of a chunk item: its local [start, end) of shard `shard`; `part_start`: where the item's
    part of that shard begins (offsets in the item are relative to it)."""
    shard: int
    start: int
    end: int
    owner: int
    part_start: int


class Scattered(NamedTuple):
    """A value a scatter round left on this rank: the item's [start, end) of shard `shard`, owned by `owner`."""
    item: Item
    shard: int
    start: int
    end: int
    owner: int
    values: torch.Tensor


class Span(NamedTuple):
    """Float32 host values over a rank's local [start, end) of a shard (an anchor, a snapshot)."""
    start: int
    end: int
    values: torch.Tensor
_F32 = 4


# ---------------------------------------------------------------------------------------------------------
class MasterView:
    """See the module docstring. Construction is collective (every rank of the island). The view owns the agreed
    layout, the masters' references, the anchors and the plans; its writes (write.py) and staged installs
    (stage.py) are parts of their own that use the public interface below."""

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
        self._anchors: Dict[Tuple[int, int], Span] = {}
        self._read = MasterRead(self)
        self._write = MasterWrite(self)
        self._stage = MasterStage(self)
        err = None
        rows = []
        self._locals: Dict[Tuple[int, int], LocalParam] = {}
        self._masters: Dict[Tuple[int, int], Optional[MasterRef]] = {}
        try:
            masters = find_masters(optimizer)
            for lp in manifest.local:
                key = (lp.entry, lp.shard)
                if key in self._locals:
                    raise IslandError(f"rank {self.rank} holds two copies of shard {lp.shard} of "
                                      f"'{lp.name}' ({self._locals[key].local_name}, {lp.local_name})")
                self._locals[key] = lp
                m = masters.get(id(lp.param))
                self._masters[key] = m
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
    def plan_op(self, op: str, indices, comm: Optional[IslandComm] = None, **kw) -> dict:
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

    def rounds(self, plan) -> List[List[Item]]:
        items = []
        for e in plan["entries"]:
            items.extend(build_items(e, self.layout[e], plan["chunk_elems"]))
        return chunk_rounds(items, plan["chunk_elems"])

    def transfers(self, it: Item) -> List[Transfer]:
        """The owners' parts of the item, in plan order."""
        lay = self.layout[it.entry]
        out = []
        for r, a, b in it.parts(lay):
            for x, y, o in lay.shards[r].owners:
                lo, hi = max(a, x), min(b, y)
                if lo < hi:
                    out.append(Transfer(r, lo, hi, o, a))
        return out

    def note_buffer(self, nbytes):
        self.stats["peak_buffer_bytes"] = max(self.stats["peak_buffer_bytes"], nbytes)

    # -- what this rank holds (the writes' and the staged installs' interface) -----------------------------------
    def master_ref(self, e: int, r: int) -> Optional[MasterRef]:
        """This rank's FP32 master of shard r of entry e (None: it holds the parameter only, or nothing)."""
        return self._masters.get((e, r))

    def local_param(self, e: int, r: int, default=IslandError):
        """This rank's model parameter of shard r of entry e (`default` when it holds none: raise, unless given)."""
        lp = self._locals.get((e, r))
        if lp is None and default is IslandError:
            raise IslandError(f"internal: rank {self.rank} holds no parameter of "
                              f"'{self.manifest.entries[e].name}' shard {r}")
        return lp if lp is not None else default

    def master_refs(self) -> Dict[Tuple[int, int], Optional[MasterRef]]:
        """(entry, shard) -> this rank's master of it (a copy of the mapping: tests and tools read it)."""
        return dict(self._masters)

    def local_params(self) -> Dict[Tuple[int, int], LocalParam]:
        return dict(self._locals)

    def anchor_range(self, e: int, r: int) -> Span:
        """(start, end, values) of this rank's anchor of shard r of entry e."""
        return self._anchors[(e, r)]

    def replace_anchor(self, e: int, r: int, values: torch.Tensor) -> None:
        """The anchor of shard r of entry e becomes `values` (same range; the staged installs hand their buffer
        over instead of copying it)."""
        x0, y0, old = self._anchors[(e, r)]
        if values.numel() != y0 - x0:
            raise IslandError(f"internal: an anchor of {y0 - x0} values replaced by {values.numel()}")
        self._anchors[(e, r)] = Span(x0, y0, values)

    def anchors(self) -> Dict[Tuple[int, int], Span]:
        return dict(self._anchors)

    # -- writes and staged installs (write.py, stage.py) ------------------------------------------------------
    def write(self, indices: Optional[Sequence[int]] = None, source=None, *, mode: Optional[str] = None,
              alpha: Optional[float] = None, set_anchor: Optional[bool] = None,
              anchor: Optional[str] = None, relative: Optional[bool] = None) -> None:
        """See write.MasterWrite.write."""
        self._write.write(indices, source, mode=mode, alpha=alpha, set_anchor=set_anchor, anchor=anchor,
                          relative=relative)

    def stage(self, indices, sources, comm, *, relative: Optional[bool] = None,
              alpha: Optional[float] = None) -> StagedBase:
        """See stage.MasterStage.stage."""
        return self._stage.stage(indices, sources, comm, relative=relative, alpha=alpha)

    def install_masters(self, staged: StagedBase, leaf: Optional[int] = None, params: bool = True) -> int:
        return self._stage.install_masters(staged, leaf, params)

    def refresh_holders(self, indices: Sequence[int]) -> None:
        self._stage.refresh_holders(indices)

    def holder_sets(self) -> list:
        return self._stage.holder_sets()

    def needs_refresh(self) -> bool:
        return self._stage.needs_refresh()

    @staticmethod
    def staged_bytes(staged: StagedBase) -> int:
        return staged.nbytes

    # -- local helpers -----------------------------------------------------------------------------------------
    def master_slice(self, e, r, x, y) -> torch.Tensor:
        m = self._masters.get((e, r))
        if m is None or not (m.start <= x and y <= m.end):
            raise IslandError(f"internal: rank {self.rank} has no master for "
                              f"'{self.manifest.entries[e].name}' shard {r} [{x}, {y})")
        return m.master[x - m.start: y - m.start]

    def anchor_slice(self, e, r, x, y) -> torch.Tensor:
        a = self._anchors.get((e, r))
        if a is None or not (a[0] <= x and y <= a[1]):
            raise IslandError(f"no anchor for '{self.manifest.entries[e].name}' on rank {self.rank}: "
                              f"call snapshot_anchor (or write with set_anchor=True) before read_delta")
        return a[2][x - a[0]: y - a[0]]

    def owned_hulls(self, indices) -> Dict[Tuple[int, int], List[int]]:
        """(entry, shard) -> [x0, y0]: the hull of what this rank owns of each shard of `indices`."""
        hull: Dict[Tuple[int, int], List[int]] = {}
        for e, r, x, y in self.owned(indices):
            h = hull.setdefault((e, r), [x, y])
            h[0], h[1] = min(h[0], x), max(h[1], y)
        return hull

    def owned(self, indices):
        """(e, r, x, y) read-owned by this rank."""
        for e in indices:
            for r, sh in enumerate(self.layout[e].shards):
                for x, y, o in sh.owners:
                    if o == self.rank:
                        yield e, r, x, y

    def agree_anchors(self, indices, comm, what: str) -> None:
        """Collective on `comm`: every rank raises, with the first failing rank's message, unless every owner has
        the anchor of each element of `indices` it owns."""
        err = None
        try:
            for e, r, x, y in self.owned(indices):
                self.anchor_slice(e, r, x, y)
        except Exception as ex:  # noqa: BLE001 - agreed below
            err = ex
        comm.agree(err, what)

    # -- anchors (local) ---------------------------------------------------------------------------------------
    def snapshot_anchor(self, indices: Optional[Sequence[int]] = None) -> None:
        """Anchor := current FP32 master, for the elements this rank owns (no communication)."""
        idx = range(len(self.manifest)) if indices is None else indices
        self.allocate_anchors(idx)
        for e, r, x, y in self.owned(idx):
            self.anchor_slice(e, r, x, y).copy_(self.master_slice(e, r, x, y))

    def allocate_anchors(self, indices) -> None:
        """An anchor buffer per owned shard range of ``indices`` (the hull of what this rank owns; an existing
        one of the same range is kept, its values unchanged)."""
        for (e, r), (x0, y0) in self.owned_hulls(indices).items():
            a = self._anchors.get((e, r))
            if a is None or a[0] != x0 or a[1] != y0:
                self._anchors[(e, r)] = Span(x0, y0, torch.empty(y0 - x0, dtype=torch.float32))

    set_anchor_from_current = snapshot_anchor

    def anchor_bytes(self) -> int:
        return sum(a[2].numel() * _F32 for a in self._anchors.values())

    # -- reads (read.py) -----------------------------------------------------------------------------------------
    def read(self, indices: Optional[Sequence[int]] = None, sink: Optional[Callable] = None) -> None:
        """Stream full float32 tensors of `indices` (default: all) to `sink(index, offset, array)` on rank 0."""
        self._read.read(indices, sink)

    def read_delta(self, indices: Optional[Sequence[int]] = None, sink: Optional[Callable] = None) -> None:
        """Like read, with anchor - current (the pseudo-gradient) computed by each owner."""
        self._read.read_delta(indices, sink)

    def gather(self, indices: Sequence[int], snap, sink: Optional[Callable], comm: IslandComm) -> None:
        """See read.MasterRead.gather (a push's delta from a ``snapshot_delta``, on any thread and comm)."""
        self._read.gather(indices, snap, sink, comm)


    def snapshot_delta(self, indices: Sequence[int], spare: Optional[torch.Tensor] = None
                       ) -> Dict[Tuple[int, int], Span]:
        """Local, no communication: the FP32 masters of the elements of `indices` this rank owns, copied once into
        host float32 ((entry, shard) -> (start, end, values) per owned shard range, views of one flat buffer:
        `spare` when it is large enough, else a new one; ``snapshot_buffer(snap)`` gives it back for reuse): the
        training thread's whole share of a push. ``gather`` turns it into the delta (anchor - snapshot) and
        streams it to rank 0 later, on any thread and comm: exactly what read_delta would have sent at the
        snapshot, provided the anchors do not change in between (the engine installs nothing into a fragment
        whose push is in flight)."""
        idx = list(indices)
        hull = self.owned_hulls(idx)
        need = sum(y0 - x0 for x0, y0 in hull.values())
        flat = spare if spare is not None and spare.numel() >= need else torch.empty(need, dtype=torch.float32)
        snap, pos = {}, 0
        for k, (x0, y0) in hull.items():
            snap[k] = Span(x0, y0, flat[pos: pos + y0 - x0])
            pos += y0 - x0
        for e, r, x, y in self.owned(idx):
            x0, _, buf = snap[(e, r)]
            buf[x - x0: y - x0].copy_(self.master_slice(e, r, x, y))   # (device-to-host where it lives there)
        return snap

    def host_masters(self, indices: Sequence[int]) -> bool:
        """Every FP32 master this rank owns of `indices` is in host memory (its snapshot can be copied beside
        training, on another thread)."""
        return all(self._masters[(e, r)].master.device.type == "cpu" for e, r, _x, _y in self.owned(list(indices)))

    def own_numel(self, indices: Sequence[int]) -> int:
        """Elements of `indices` this rank owns (what ``snapshot_delta`` of them copies)."""
        return sum(y - x for _e, _r, x, y in self.owned(list(indices)))

    @staticmethod
    def snapshot_buffer(snap) -> Optional[torch.Tensor]:
        """The flat buffer a ``snapshot_delta`` lives in (None for an empty one)."""
        for _, _, buf in snap.values():
            return buf._base if buf._base is not None else buf
        return None

    def scatter_round(self, rnd: List[Item], source, clone: bool, pending_err, comm=None, holders=True,
                       into=None):
        """Rank 0 reads the round's values and sends each owner its part; holders allocate their receive
        buffers. Returns (vals, works, nbytes, pending_err); vals: ``Scattered`` values in plan order,
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
                chunk, pending_err = self.source_chunk(it, source, pending_err)
                nbytes += it.count * _F32
                if interleave:
                    n_o = it.rows[1] - it.rows[0]
                    view = chunk.view(n_o, s, T, seg)
                    bufs = [view[:, :, r, :].contiguous().view(-1) for r in range(T)]
                    nbytes += it.count * _F32
            for r, x, y, o, a in self.transfers(it):
                held_by = lay.shards[r].holders
                dest = into(it.entry, r, x, y) if into is not None and self.rank == o else None
                if self.rank == 0:
                    src = (bufs[r] if interleave else chunk)[x - a: y - a]
                    if o == 0:
                        vals.append(Scattered(it, r, x, y, o, dest.copy_(src) if dest is not None else
                                     src.clone() if clone else src))
                    else:
                        works.append(comm.isend(src, o))
                if self.rank == o and o != 0:
                    t = dest if dest is not None else torch.empty(y - x, dtype=torch.float32)
                    nbytes += t.numel() * _F32 if dest is None else 0
                    works.append(comm.irecv(t, 0))
                    vals.append(Scattered(it, r, x, y, o, t))
                elif holders and self.rank in held_by and self.rank != o:
                    t = torch.empty(y - x, dtype=torch.float32)
                    nbytes += t.numel() * _F32
                    vals.append(Scattered(it, r, x, y, o, t))
        return vals, works, nbytes, pending_err

    def source_chunk(self, it: Item, source, pending_err):
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

    def quiesce_param_gather(self):
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
