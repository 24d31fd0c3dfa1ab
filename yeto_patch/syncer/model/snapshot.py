"""The coordinator's committed state as a checkpoint :class:`~.checkpoint.Snapshot`, and back (``--resume``)."""
from __future__ import annotations

import logging
import os
import secrets
import time
from typing import TYPE_CHECKING, Optional

from ...wire import auth
from ...wire.text import printable
from .checkpoint import FORMAT_VERSION, CheckpointError, Snapshot, read_checkpoint
from .guard import unusable
from .layout import manifest_to_json, normalize_manifest
from ..rounds.members import ledger_entry, member_from_ledger
from ...wire.schema import INT64_MAX, bounded_int

if TYPE_CHECKING:
    from ..rounds.coordinator import Coordinator

__all__ = ["capture", "restore", "open_checkpoint"]


def capture(coord: "Coordinator", extra: Optional[dict] = None) -> Snapshot:
    """A consistent snapshot of the committed state (call between merges)."""
    with coord.lock:
        mine = coord.mine()   # a shard writes the fragments it owns only
        frags = [{"index": f.index, "numel": f.numel, "version": f.version} for f in mine]
        arrays = [f.arrays() for f in mine]
        # pushes already merged (refused as duplicates after a resume); those of open rounds are not merged
        # and are lost with the process: their islands push them again
        unmerged = set()
        for f in mine:
            for c in coord.waiting_pushes(f.index):
                unmerged.add((c.island, f.index, c.push.base_version))
        merged = sorted([i, fr, b] for i, fr, b in coord.seen if (i, fr, b) not in unmerged)
        ledger = {i: ledger_entry(m) for i, m in coord.members.items()}
        meta = {"format": "yeto-syncer-checkpoint", "format_version": FORMAT_VERSION, "created_unix": time.time(),
                "manifest": manifest_to_json(coord.manifest),
                "manifest_digest": auth.manifest_digest(coord.manifest).hex(),
                "layout": coord.layout, "merge_config": coord.ms.resolved(), "merges_total": coord.merges_total,
                "shard": coord.shard.as_json(), "fragments": frags, "ledger": ledger, "merged_pushes": merged,
                "weight_book": coord.book.state(), **(extra or {})}
    return Snapshot(meta, arrays)


def _check_shard(coord: "Coordinator", have) -> None:
    """A shard resumes only its own checkpoint: the same shard index of the same shard count."""
    want = coord.shard.as_json()
    if have != want:
        have = "/".join(map(str, have)) if isinstance(have, list) else repr(have)
        raise CheckpointError(f"the checkpoint was written by syncer shard {have}; this is shard "
                              f"{coord.shard}: resume each shard from its own checkpoint, with the same "
                              f"--shard and --fragments as the run that wrote it")


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
    _check_shard(coord, meta.get("shard", [0, 1]))
    with coord.lock:
        coord.set_manifest(manifest, len(layout))
        if coord.layout != layout:
            raise CheckpointError("checkpoint layout differs from the layout this syncer computes for its manifest")
        if [fm.get("index") for fm in meta["fragments"]] != coord.owned or len(arrays) != len(coord.owned):
            raise CheckpointError(f"checkpoint holds fragments {[fm.get('index') for fm in meta['fragments']]}; "
                                  f"shard {coord.shard} owns {coord.owned}")
        for f, fm, arr in zip(coord.mine(), meta["fragments"], arrays):
            if fm["numel"] != f.numel or arr.get("base") is None or arr["base"].size != f.numel:
                raise CheckpointError(f"checkpoint fragment {f.index} has the wrong size")
            if not bounded_int(fm["version"]):
                raise CheckpointError(f"checkpoint fragment {f.index} has an invalid version")
            # islands rejoin with the full shadow; without one: shadow = base
            f.restore(arr, int(fm["version"]), shadow=coord.down_codec is not None)
            coord.opt.ensure_state(f.t)
        coord.reset_rounds()
        now = coord.clock()
        # members of the resumed run are expected again for one lease (they reconnect with back-off)
        members = {island: member_from_ledger(island, e, now, len(coord.frags))
                   for island, e in meta.get("ledger", {}).items()}
        merged = {(str(i), int(fr), int(b)) for i, fr, b in meta.get("merged_pushes", [])}
        total = meta.get("merges_total", 0)
        coord.book.load(meta.get("weight_book"))
        coord.resumed(max(0, min(INT64_MAX, int(total))) if isinstance(total, int) else 0, members, merged)


def new_run_id() -> str:
    """A run id for a run started without --run-id (kept in its checkpoints, named in every handshake)."""
    return "run-" + secrets.token_hex(8)


def open_checkpoint(coord: "Coordinator", cfg) -> str:
    """The server's checkpoint at start-up: its directory must be writable; with --resume the checkpoint is read,
    checked (fragment count, shard, run id, usable values) and installed into `coord`; without it an existing file
    is refused. Returns the run id: --run-id, else the resumed checkpoint's, else a new one."""
    if not cfg.checkpoint:
        return cfg.run_id or new_run_id()
    d = os.path.dirname(os.path.abspath(cfg.checkpoint))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise CheckpointError(f"checkpoint directory {d} does not exist or is not writable")
    if not cfg.resume:
        if os.path.exists(cfg.checkpoint):
            raise CheckpointError(f"checkpoint {cfg.checkpoint} already exists: pass --resume to continue that run, "
                                  "or move it away to start a new one")
        return cfg.run_id or new_run_id()
    meta, arrays = read_checkpoint(cfg.checkpoint)
    if len(meta["layout"]) != cfg.fragments:
        raise CheckpointError(f"checkpoint {cfg.checkpoint} has {len(meta['layout'])} fragments; "
                              f"--fragments is {cfg.fragments}")
    have = meta.get("run_id")
    if cfg.run_id is not None and have != cfg.run_id:
        raise CheckpointError(f"checkpoint {cfg.checkpoint} belongs to run {printable(str(have))!r}, not --run-id "
                              f"{printable(cfg.run_id)!r}: resume it with its own run id, or start a new run")
    restore(coord, meta, arrays)
    for fm, fa in zip(meta["fragments"], arrays):
        for name, a in sorted(fa.items()):
            why = unusable(f"fragment {fm['index']} {name}", a)
            if why:
                raise CheckpointError(f"checkpoint {cfg.checkpoint} is not usable: {why}; resume from an "
                                      "earlier checkpoint")
    run = have if isinstance(have, str) and have else new_run_id()   # (a checkpoint written before run ids)
    logging.getLogger("yeto.syncer").info(
        "resumed run %s from %s: %d fragments at versions %s, %d merges so far", printable(run), cfg.checkpoint,
        len(coord.owned), coord.versions(), coord.merges_total)
    return run
