"""Writes into an island's FP32 masters and model parameters (``MasterWrite``, owned by a ``MasterView`` and using
its public interface: its plans, rounds, transfers, slices and anchors).

``write(indices, source, mode=, alpha=, set_anchor=, anchor=, relative=)`` (collective): rank 0's values go, in the
view's chunked rounds, to each element's owner, which (blend) computes ``alpha * current + (1 - alpha) * value``
(or first adds its anchor, ``relative``), and from the owner to every holder of the shard, which installs them
into its FP32 masters (every copy) and its model parameters (cast). One agreement per round, before installing:
nothing of a failed round is installed. Used where an install must be complete at once: the start, the final cut,
a restart's adoption, a base that is the island's own weights. Bases merged during training take the staged
route (stage.py), whose results are bit for bit this one's.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from yeto_patch.island.masters.collective import IslandError
from yeto_patch.island.masters.layout import Item
from yeto_patch.island.masters.refs import flat_view, same_storage

_F32 = 4


class MasterWrite:
    """The writes of one ``MasterView`` (see the module docstring); the view delegates ``write`` to it."""
    __slots__ = ("view",)

    def __init__(self, view):
        self.view = view

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
            self.view.agree_anchors(plan["entries"], self.view.comm, "write: anchors for a relative write")
        if isinstance(source, dict):
            arrays = source
            source = lambda e, off, n: np.asarray(arrays[e], dtype=np.float32).reshape(-1)[off: off + n]  # noqa: E731
        self.view.quiesce_param_gather()
        if plan["set_anchor"] and not relative:
            self.view.allocate_anchors(plan["entries"])
        pending_err = None
        for rnd in self.view.rounds(plan):
            pending_err = self._write_round(rnd, source, plan, pending_err)
        self.view.comm.agree(pending_err, "write: install")

    def _write_plan(self, indices, source, mode, alpha, set_anchor, anchor, relative) -> dict:
        """write's arguments checked (rank 0's defaults filled in) and agreed island-wide as a plan."""
        if self.view.rank == 0:
            mode = mode or "replace"
            set_anchor = bool(set_anchor)
            anchor = anchor or "installed"
            relative = bool(relative)
        if anchor is not None and anchor not in ("installed", "value"):
            raise IslandError(f"write: anchor must be 'installed' or 'value', got {anchor!r}")
        if mode is not None and mode not in ("replace", "blend"):
            raise IslandError(f"write: mode must be 'replace' or 'blend', got {mode!r}")
        if mode == "blend" and (alpha is None or not 0.0 <= float(alpha) <= 1.0):
            if self.view.rank == 0 or alpha is not None:
                raise IslandError(f"write: blend needs 0 <= alpha <= 1, got {alpha!r}")
        if self.view.rank == 0 and source is None:
            raise IslandError("write: rank 0 needs a source")
        return self.view.plan_op("write", indices, mode=mode, alpha=None if alpha is None else float(alpha),
                          set_anchor=set_anchor, anchor=anchor, relative=relative)

    def _write_round(self, rnd: List[Item], source, plan: dict, pending_err):
        """One round of write: scatter to the owners, blend, broadcast to the holders, agree, install. Returns
        the error to report at the next agreement (None: none)."""
        mode, alpha, set_anchor = plan["mode"], plan["alpha"], plan["set_anchor"]
        relative = bool(plan.get("relative"))
        keep_value = set_anchor and mode == "blend" and plan["anchor"] == "value"
        self.view.stats["rounds"] += 1
        vals, works, nbytes, pending_err = self.view.scatter_round(rnd, source, mode == "blend" or relative,
                                                               pending_err)
        self.view.note_buffer(nbytes)
        self.view.comm.wait_all(works, "write: scatter to owners")
        # owners blend, then every holder gets the owner's values
        raw, bworks, nbytes, pending_err = self._blend_and_broadcast(vals, mode, alpha, relative, keep_value,
                                                                     nbytes, pending_err)
        self.view.note_buffer(nbytes)
        self.view.comm.wait_all(bworks, "write: broadcast to holders")
        # one agreement per round, before installing: nothing of a failed round is installed
        self.view.comm.agree(pending_err, "write: transfer")
        try:
            for k, (it, r, x, y, o, t) in enumerate(vals):
                self._install(it.entry, r, x, y, t, anchor=set_anchor and o == self.view.rank,
                              anchor_values=raw.get(k))
        except Exception as ex:  # noqa: BLE001 - reported at the next agreement
            pending_err = ex
        return pending_err

    def _blend_and_broadcast(self, vals, mode, alpha, relative, keep_value, nbytes, pending_err):
        """Owners turn rank 0's values into the values to install (anchor + change, blend with the current
        master) and broadcast them to the shard's holders. Returns (raw, works, nbytes, pending_err); raw:
        {position in vals: rank 0's value} kept by the owner for anchor="value"."""
        bworks = []
        raw = {}
        for k, (it, r, x, y, o, t) in enumerate(vals):
            if self.view.rank == o and relative:
                try:
                    t.add_(self.view.anchor_slice(it.entry, r, x, y))
                except Exception as ex:  # noqa: BLE001
                    pending_err = pending_err or ex
            if self.view.rank == o and mode == "blend":
                try:
                    if keep_value:
                        raw[k] = t.clone()
                        nbytes += t.numel() * _F32
                    cur = self.view.master_slice(it.entry, r, x, y)
                    if cur.device.type != "cpu" or cur.dtype != torch.float32:
                        cur = cur.to(device="cpu", dtype=torch.float32)
                    t.mul_(1.0 - alpha).add_(cur, alpha=alpha)
                except Exception as ex:  # noqa: BLE001
                    pending_err = pending_err or ex
            w = self.view.comm.broadcast(t, o, self.view.layout[it.entry].shards[r].holders, async_op=True)
            if w is not None:
                bworks.append(w)
        return raw, bworks, nbytes, pending_err

    def _install(self, e, r, x, y, t, anchor, anchor_values=None):
        lp = self.view.local_param(e, r, None)
        if lp is None:
            raise IslandError(f"internal: rank {self.view.rank} is a holder of "
                              f"'{self.view.manifest.entries[e].name}' shard {r} but has no local parameter")
        flat_view(lp.param.data)[x:y].copy_(t)
        m = self.view.master_ref(e, r)
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
            self.view.anchor_slice(e, r, x, y).copy_(t if anchor_values is None else anchor_values)
