"""One merge's record: the log line and the JSONL tape entry (``--tape``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...wire.text import printable

__all__ = ["MergeRecord"]


@dataclass
class MergeRecord:
    fragment: int
    version: int  # new version (or the unchanged one when ok is False)
    ok: bool
    responders: list
    total_weight: float
    bytes: int
    quorum_s: float
    merge_s: float
    grad_norm: float
    expected: list
    reason: str = ""
    t_wall: float = 0.0
    outer_lr: Optional[float] = None   # the learning rate the outer step used (None: refused)
    left_out: dict = field(default_factory=dict)   # expected island without an on-time push -> why not waited for

    def tape(self) -> dict:
        return {"time": self.t_wall, "fragment": self.fragment, "version": self.version, "ok": self.ok,
                "responders": self.responders, "total_weight": self.total_weight, "bytes": self.bytes,
                "quorum_s": round(self.quorum_s, 6), "merge_s": round(self.merge_s, 6),
                "outer_grad_norm": self.grad_norm if np.isfinite(self.grad_norm) else None,
                "expected": self.expected, "outer_lr": self.outer_lr,
                **({"left_out": self.left_out} if self.left_out else {}),
                **({"reason": self.reason} if self.reason else {})}

    def figures_for(self, island: str) -> dict:
        """What island `island` learns with this merge's base (BASE meta ``merge``; wire.values.merge_info): its
        share of the merge weight and its push's lag in versions (when it pushed), the pushes merged, the outer
        learning rate and gradient norm."""
        out = {"islands": len(self.responders)}
        if self.outer_lr is not None and np.isfinite(self.outer_lr):
            out["outer_lr"] = float(self.outer_lr)
        if np.isfinite(self.grad_norm):
            out["outer_grad_norm"] = float(self.grad_norm)
        me = next((r for r in self.responders if r.get("island") == island), None)
        total = float(self.total_weight or 0.0)
        out["weight"] = float(me["weight"]) / total if me is not None and total > 0 else 0.0
        out["weight"] = min(1.0, max(0.0, out["weight"]))
        if me is not None:
            out["lag"] = int(me["lag"])
        return out

    def line(self) -> str:
        who = " ".join(f"{r['island']}(lag {r['lag']}{', carried' if r['carried'] else ''}, w {r['weight']:g})"
                       for r in self.responders)
        if not self.ok:
            return f"merge of fragment {self.fragment} at v{self.version} REFUSED: {self.reason}; from {who}"
        return (f"merged fragment {self.fragment} -> v{self.version}: {len(self.responders)} push(es) [{who}], "
                f"{self.bytes / 1e6:.2f} MB in, waited {self.quorum_s:.2f}s, merged in {self.merge_s:.3f}s, "
                f"|g| {self.grad_norm:.4g}" + (f", outer lr {self.outer_lr:g}" if self.outer_lr is not None else "")
                + "".join(f"; without {printable(i)}: {why}" for i, why in sorted(self.left_out.items())))
