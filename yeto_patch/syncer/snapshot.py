"""The coordinator's committed state as a checkpoint :class:`~.checkpoint.Snapshot`, and back (``--resume``)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from ..wire import auth
from .checkpoint import FORMAT_VERSION, CheckpointError, Snapshot
from .layout import manifest_to_json, normalize_manifest
from .members import ledger_entry, member_from_ledger
from .settings import INT64_MAX, bounded_int

if TYPE_CHECKING:
    from .rounds import Coordinator

__all__ = ["capture", "restore"]


def capture(coord: "Coordinator", extra: Optional[dict] = None) -> Snapshot:
    """A consistent snapshot of the committed state (call between merges)."""
    with coord.lock:
        frags = [{"index": f.index, "numel": f.numel, "version": f.version} for f in coord.frags]
        arrays = [f.arrays() for f in coord.frags]
        # pushes already merged (refused as duplicates after a resume); those of open rounds are not merged
        # and are lost with the process: their islands push them again
        unmerged = set()
        for f in coord.frags:
            for c in list(f.round.contribs.values()) + list(f.carry):
                unmerged.add((c.island, f.index, c.push.base_version))
        merged = sorted([i, fr, b] for i, fr, b in coord.seen if (i, fr, b) not in unmerged)
        ledger = {i: ledger_entry(m) for i, m in coord.members.items()}
        meta = {"format": "yeto-syncer-checkpoint", "format_version": FORMAT_VERSION, "created_unix": time.time(),
                "manifest": manifest_to_json(coord.manifest),
                "manifest_digest": auth.manifest_digest(coord.manifest).hex(),
                "layout": coord.layout, "merge_config": coord.ms.resolved(), "merges_total": coord.merges_total,
                "fragments": frags, "ledger": ledger, "merged_pushes": merged, **(extra or {})}
    return Snapshot(meta, arrays)


def restore(coord: "Coordinator", meta: dict, arrays: list) -> None:
    """Install a loaded checkpoint into a fresh coordinator (refuses a different merge configuration).

    Counters are clamped to int64 on the way in (a checkpoint written before they were bounded may hold any
    integer), so the resumed run can always write its next checkpoint."""
    want = coord.ms.resolved()
    have = meta.get("merge_config", {})
    diff = [k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
    if diff:
        raise CheckpointError("the checkpoint was written with a different merge configuration: " + ", ".join(
            f"{k}={have.get(k)!r} (now {want.get(k)!r})" for k in diff) + "; resume with the same settings")
    manifest = normalize_manifest(meta["manifest"])
    if auth.manifest_digest(manifest).hex() != meta.get("manifest_digest"):
        raise CheckpointError("checkpoint manifest digest does not match its manifest")
    layout = meta["layout"]
    with coord.lock:
        coord.set_manifest(manifest, len(layout))
        if coord.layout != layout:
            raise CheckpointError("checkpoint layout differs from the layout this syncer computes for its manifest")
        for f, fm, arr in zip(coord.frags, meta["fragments"], arrays):
            if fm["numel"] != f.numel or arr.get("base") is None or arr["base"].size != f.numel:
                raise CheckpointError(f"checkpoint fragment {f.index} has the wrong size")
            if not bounded_int(fm["version"]):
                raise CheckpointError(f"checkpoint fragment {f.index} has an invalid version")
            # islands rejoin with the full shadow; without one: shadow = base
            f.restore(arr, int(fm["version"]), shadow=coord.down_codec is not None)
            coord.opt.ensure_state(f.t)
            f.round = type(f.round)(f.version)
        now = coord.clock()
        # members of the resumed run are expected again for one lease (they reconnect with back-off)
        members = {island: member_from_ledger(island, e, now, len(coord.frags))
                   for island, e in meta.get("ledger", {}).items()}
        merged = {(str(i), int(fr), int(b)) for i, fr, b in meta.get("merged_pushes", [])}
        total = meta.get("merges_total", 0)
        coord.resumed(max(0, min(INT64_MAX, int(total))) if isinstance(total, int) else 0, members, merged)
