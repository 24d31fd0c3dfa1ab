"""An island's sync state beside each Megatron checkpoint: what a restarted island needs to continue its DiLoCo
rounds where the checkpoint left them (no pickle; written atomically).

Saved by island rank 0 when Megatron saves iteration N, as ``<save dir>/yeto_sync/iter_<N:07d>.bin``; read when
Megatron loads iteration N. Holds per fragment the base version its anchor is (the anchor's values are the
syncer's base of that version, so they are not stored), the steps and tokens since the anchor, the push still
waiting for its answer (its encoded body, to send again) and the error-feedback residual; and the syncer's run id
(each shard's), so that a restarted island refuses a syncer of another run (``saved_runs``); and whether the run
started from pretrained weights (a restart loads weights too, but its pushes go on saying how the run began).

File layout (little-endian)::

    b"YETOSYNC" | u32 format version (1) | u32 0 | u64 meta length | meta (UTF-8 JSON) | arrays

Each array starts on a 64-byte boundary; the meta lists ``{name, dtype, shape, offset, nbytes, xxh3}`` for each
(offset relative to the end of the meta) and every digest is checked on reading.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np
import xxhash

from yeto_patch.wire.codecs import DEFAULT_BLOCK

__all__ = ["SyncStateError", "state_path", "write_state", "read_state", "read_meta", "capture", "save", "mismatch", "load",
           "restore", "saved_runs"]

MAGIC = b"YETOSYNC"
FORMAT_VERSION = 1
log = logging.getLogger("yeto_patch")
_HEAD = struct.Struct("<8sIIQ")
_ALIGN = 64
_DTYPES = {"float32": np.float32, "uint8": np.uint8}


class SyncStateError(Exception):
    pass


def state_path(directory: str, iteration: int) -> str:
    return os.path.join(directory, "yeto_sync", f"iter_{int(iteration):07d}.bin")


def write_state(path: str, meta: dict, arrays: Dict[str, np.ndarray]) -> int:
    """Write atomically (temporary file, fsync, rename, fsync of the directory); returns the bytes written."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    table, off = [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.name not in _DTYPES:
            raise SyncStateError(f"array {name}: dtype {a.dtype} cannot be stored")
        off += (-off) % _ALIGN
        table.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": off,
                      "nbytes": int(a.nbytes), "xxh3": xxhash.xxh3_64_intdigest(memoryview(a).cast("B"))})
        off += a.nbytes
    raw = json.dumps({**meta, "arrays": table}, separators=(",", ":"), allow_nan=False).encode()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(raw)))
        f.write(raw)
        pos = 0
        for e, a in zip(table, arrays.values()):
            f.write(b"\0" * (e["offset"] - pos))
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            pos = e["offset"] + e["nbytes"]
        f.flush()
        os.fsync(f.fileno())
        total = f.tell()
    os.replace(tmp, path)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def read_meta(path: str) -> dict:
    """The meta alone (the arrays are not read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise SyncStateError(f"{path} is truncated ({len(head)} bytes)")
            magic, version, _, n = _HEAD.unpack(head)
            if magic != MAGIC or version != FORMAT_VERSION:
                raise SyncStateError(f"{path} is not a yeto-patch island sync state (format {FORMAT_VERSION})")
            raw = f.read(n)
    except OSError as e:
        raise SyncStateError(f"cannot read {path}: {e}") from None
    try:
        return json.loads(raw.decode())
    except ValueError as e:
        raise SyncStateError(f"{path}: bad meta: {e}") from None


def read_state(path: str) -> Tuple[dict, Dict[str, np.ndarray]]:
    """(meta, arrays); SyncStateError naming what is wrong with a damaged or foreign file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SyncStateError(f"cannot read {path}: {e}") from None
    if len(data) < _HEAD.size:
        raise SyncStateError(f"{path} is truncated ({len(data)} bytes)")
    magic, version, _, n = _HEAD.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise SyncStateError(f"{path} is not a yeto-patch island sync state (format {FORMAT_VERSION})")
    if _HEAD.size + n > len(data):
        raise SyncStateError(f"{path} is truncated in its meta")
    try:
        meta = json.loads(data[_HEAD.size:_HEAD.size + n].decode())
    except ValueError as e:
        raise SyncStateError(f"{path}: bad meta: {e}") from None
    base = _HEAD.size + n
    arrays = {}
    for e in meta.pop("arrays", []):
        a, b = base + int(e["offset"]), base + int(e["offset"]) + int(e["nbytes"])
        if b > len(data) or e["dtype"] not in _DTYPES:
            raise SyncStateError(f"{path}: array {e.get('name')} is truncated or of an unknown dtype")
        buf = data[a:b]
        if xxhash.xxh3_64_intdigest(buf) != e["xxh3"]:
            raise SyncStateError(f"{path}: array {e['name']} is corrupt (digest mismatch)")
        arrays[e["name"]] = np.frombuffer(buf, dtype=_DTYPES[e["dtype"]]).reshape(e["shape"]).copy()
    return meta, arrays



# ------------------------------------------------------------------------------------------ the island's side
def capture(settings, iteration: int, step: int, manifest_digest: str, fragments, run_ids=None,
            pretrained: bool = False) -> Tuple[dict, Dict]:
    """Rank 0: (meta, arrays) of what a restart from this step needs (`fragments`: ``boundary.fragment``'s, every
    push handed to the link: the engine drains the push lane first; `run_ids`: each syncer shard's run id, in shard
    order; `pretrained`: the run started from pretrained weights, which a restart keeps saying)."""
    pending, arrays = {}, {}
    for frag in fragments.pushing():
        push, wire = frag.push, frag.side.wire
        if wire is None:
            raise SyncStateError(f"internal: fragment {frag.index}'s push is still in the background lane")
        pending[str(frag.index)] = {"step": push.step, "fragment": frag.index, "base_version": push.base_version,
                                    "steps": push.steps, "tokens": push.tokens, "final": push.final,
                                    "codec": wire.codec, "bytes": int(wire.body.nbytes)}
        arrays[f"push.{frag.index}"] = np.frombuffer(memoryview(wire.body).cast("B"), dtype=np.uint8)
    for frag in fragments:
        if frag.side.residual is not None:
            arrays[f"residual.{frag.index}"] = frag.side.residual
    meta = {"format": "yeto-island-sync-state", "island_id": settings.island_id, "iteration": iteration,
            "step": step, "manifest_digest": manifest_digest, "layout": fragments.layout,
            "push_dtype": settings.push_dtype, "block": settings.block, "error_feedback": bool(settings.error_feedback),
            "anchor_version": fragments.anchors(), "steps_since": [frag.steps_since for frag in fragments],
            "tokens_since": [frag.tokens_since for frag in fragments], "pending": pending,
            "run_ids": list(run_ids) if run_ids is not None else None, "pretrained": bool(pretrained)}
    return meta, arrays


def save(directory: str, iteration: int, settings, step: int, manifest_digest: str, fragments, run_ids=None,
         pretrained: bool = False) -> bool:
    """Rank 0: write the island's sync state for `iteration` beside Megatron's checkpoint in `directory`."""
    path = state_path(directory, iteration)
    meta, arrays = capture(settings, iteration, step, manifest_digest, fragments, run_ids, pretrained)
    n = write_state(path, meta, arrays)
    log.info("yeto-patch: saved the island's sync state for iteration %d (%.1f MB) to %s", iteration, n / 1e6, path)
    return True


def mismatch(meta: dict, *, manifest_digest: str, layout, iteration: int, island_id: str) -> Optional[str]:
    """Why a saved state does not belong to this run (None when it does)."""
    if meta.get("manifest_digest") != manifest_digest:
        return "its parameter manifest differs from this run's"
    if meta.get("layout") != layout:
        return "it was saved with another fragment layout (--fragments)"
    if meta.get("iteration") != iteration:
        return f"it belongs to iteration {meta.get('iteration')}, not {iteration}"
    if meta.get("island_id") != island_id:
        return f"it belongs to island {meta.get('island_id')!r}"
    return None


def restore(state: dict, arrays: Dict[str, np.ndarray], fragments, versions: Dict[int, int], keep, rank: int,
            error_feedback: bool, fixed_roster: bool = True) -> List:
    """Every rank, after the start's installs: counters and unanswered pushes of the fragments in `keep` (their
    anchor is still the syncer's base), the error-feedback residuals (rank 0). With a fixed roster (every round
    holds one push of every island) a fragment the syncer merged past the saved anchor (with this island's pushes
    made before it died, whose steps it now trains again) skips that many of its next boundaries, so the island's
    rounds line up with the other islands' again; the first of those merges answered the push saved unanswered
    with the state (made before the checkpoint, tau >= 1): its boundary is not trained again, so it is not
    skipped. Elastic rounds merged without it while it was down: it skips none (it trains again on the steps since
    its checkpoint from the current base; their tokens are used twice).
    The saved pushes are every rank's (the meta is broadcast); only rank 0 holds their bodies. Returns (rank 0)
    the fragments whose saved push must be sent again."""
    from yeto_patch.island.boundary.fragment import Push, PushWire
    for frag in fragments:
        anchor = int(state["anchor_version"][frag.index])
        saved = state["pending"].get(str(frag.index))
        answered = 1 if saved is not None and int(saved["base_version"]) == anchor else 0
        trained_again = int(versions[frag.index]) - anchor - answered
        if frag.index not in keep and trained_again > 0 and fixed_roster:
            frag.skip_boundaries(trained_again)
    resend = []
    for f in sorted(keep):
        frag = fragments[f]
        frag.restore(state["steps_since"][f], state["tokens_since"][f])
        rec = state["pending"].get(str(f))
        if rec is None:
            continue
        push = Push(int(rec["step"]), int(rec["base_version"]), int(rec["steps"]), int(rec["tokens"]),
                    bool(rec.get("final", False)))
        wire = None
        if rank == 0:
            wire = PushWire(arrays[f"push.{f}"], str(rec["codec"]), {"bytes": int(rec.get("bytes", 0))},
                            block=int(state.get("block") or DEFAULT_BLOCK))
            resend.append(frag)
        frag.resume_push(push, wire)
    if rank == 0 and error_feedback:
        for frag in fragments:
            r = arrays.get(f"residual.{frag.index}")
            if r is not None and r.size == frag.numel:
                frag.restore_residual(r.astype(np.float32, copy=True))
    return resend


def saved_runs(directory: Optional[str], iteration: Optional[int]) -> Optional[list]:
    """Rank 0, before connecting: the syncer run ids (one per shard) saved with the sync state of the Megatron
    checkpoint this process resumed from, if there is one that names them; the link refuses a syncer of another
    run (island/link/syncer.py)."""
    if directory is None or iteration is None:
        return None
    path = state_path(directory, iteration)
    if not os.path.exists(path):
        return None
    runs = read_meta(path).get("run_ids")
    return [r if isinstance(r, str) else None for r in runs] if isinstance(runs, list) else None


def load(path: str, iteration: int, arrays: Dict[str, np.ndarray], settings, *, manifest_digest: str,
         layout) -> Optional[dict]:
    """Rank 0: the state saved at `path` for a restart from `iteration` (its arrays added to `arrays`), or None
    with a warning saying why this run starts from the syncer's current bases instead."""
    if not os.path.exists(path):
        log.warning("yeto-patch: Megatron resumed from iteration %d but %s does not exist (a checkpoint "
                    "saved without yeto-patch?): this island starts from the syncer's current bases",
                    iteration, path)
        return None
    meta, arr = read_state(path)
    why = mismatch(meta, manifest_digest=manifest_digest, layout=layout, iteration=iteration,
                   island_id=settings.island_id)
    if why:
        log.warning("yeto-patch: ignoring the sync state %s: %s; this island starts from the syncer's "
                    "current bases", path, why)
        return None
    if (meta.get("push_dtype"), meta.get("block")) != (settings.push_dtype, settings.block):
        arr = {k: v for k, v in arr.items() if not k.startswith("push.")}   # re-encoded pushes differ
        meta["pending"] = {}
    arrays.update(arr)
    log.info("yeto-patch: resuming the island's sync state of iteration %d from %s (anchors at versions "
             "%s, %d push(es) awaiting their answer)", iteration, path, meta["anchor_version"],
             len(meta["pending"]))
    state = {k: meta.get(k) for k in ("anchor_version", "steps_since", "tokens_since", "pending", "block")}
    state["pretrained"] = meta.get("pretrained") is True   # (absent in states saved before it existed: False)
    return state
