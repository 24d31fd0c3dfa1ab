"""Syncer checkpoints: a self-describing, versioned binary file (no pickle), written atomically.

Layout (little-endian)::

    offset 0   magic b"YETOCKPT", format version u32 (= 1), flags u32 (= 0)          16 bytes
    ...        raw arrays (float32, C order), each starting on a 64-byte boundary
    meta_off   meta: UTF-8 JSON object (manifest, its digest, layout, per-fragment version and array
               table {offset, nbytes, dtype, xxh3_64}, merge configuration, per-island ledger, counters)
    end - 32   footer: meta offset u64, meta length u64, xxh3_64 of the meta u64, b"YETOEND\\0"

Every array carries its xxh3_64 digest; loading verifies the footer, the meta digest and every array digest
and names what is wrong.  Writes go to ``<path>.tmp``, are fsync'ed, renamed over ``<path>`` and the
directory is fsync'ed, so a crash at any point leaves the previous checkpoint loadable.

Background writes (``CheckpointWriter(background=True)``) save a *snapshot*: array references taken between
merges; before a merge changes a fragment the writer has not written yet, :meth:`Snapshot.protect` copies
that fragment's arrays (only those), so merging never waits for the disk.  At most one write runs at a time;
the next one (and every synchronous save) waits for it.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from typing import Optional

import numpy as np
import xxhash

__all__ = ["FORMAT_VERSION", "CheckpointError", "Snapshot", "write_checkpoint", "read_checkpoint",
           "CheckpointWriter"]

log = logging.getLogger("yeto.syncer")
MAGIC = b"YETOCKPT"
END = b"YETOEND\0"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sII")
_FOOT = struct.Struct("<QQQ8s")
_ALIGN = 64
_IO_CHUNK = 8 << 20
ARRAY_NAMES = ("base", "momentum", "delay_buf", "shadow")


class CheckpointError(Exception):
    pass


class Snapshot:
    """A consistent cut: ``meta`` (JSON-able) and per-fragment {name: float32 array} references."""

    def __init__(self, meta: dict, arrays: list):
        self.meta = meta
        self.arrays = arrays
        self._state = ["pending"] * len(arrays)
        self._c = threading.Condition()

    def protect(self, i: int) -> None:
        """Called before fragment ``i`` changes: copy it unless the writer already wrote it."""
        with self._c:
            while self._state[i] == "writing":
                self._c.wait()
            if self._state[i] == "pending":
                self.arrays[i] = {k: v.copy() for k, v in self.arrays[i].items()}
                self._state[i] = "copied"

    def _take(self, i: int) -> dict:
        with self._c:
            self._state[i] = "writing"
            return self.arrays[i]

    def _done(self, i: int) -> None:
        with self._c:
            self._state[i] = "done"
            self.arrays[i] = {}
            self._c.notify_all()

    def release(self) -> None:
        with self._c:
            self._state = ["done"] * len(self._state)
            self.arrays = [{} for _ in self.arrays]
            self._c.notify_all()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_checkpoint(path: str, snap: Snapshot) -> int:
    """Write ``snap`` atomically to ``path``; returns the file size."""
    tmp = path + ".tmp"
    meta = json.loads(json.dumps(snap.meta))  # private copy, filled with the array table below
    frag_meta = meta["fragments"]
    with open(tmp, "wb") as fh:
        fh.write(_HEAD.pack(MAGIC, FORMAT_VERSION, 0))
        pos = _HEAD.size
        for i in range(len(snap.arrays)):
            arrays = snap._take(i)
            table = {}
            try:
                for name in ARRAY_NAMES:
                    a = arrays.get(name)
                    if a is None:
                        continue
                    pad = (-pos) % _ALIGN
                    if pad:
                        fh.write(b"\0" * pad)
                        pos += pad
                    h = xxhash.xxh3_64()
                    flat = np.ascontiguousarray(a, dtype="<f4").reshape(-1)
                    mv = memoryview(flat).cast("B")
                    for o in range(0, mv.nbytes, _IO_CHUNK):
                        piece = mv[o:o + _IO_CHUNK]
                        h.update(piece)
                        fh.write(piece)
                    table[name] = {"offset": pos, "nbytes": mv.nbytes, "dtype": "<f4", "numel": int(flat.size),
                                   "xxh3_64": h.hexdigest()}
                    pos += mv.nbytes
            finally:
                snap._done(i)
            frag_meta[i]["arrays"] = table
        mb = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
        fh.write(mb)
        fh.write(_FOOT.pack(pos, len(mb), xxhash.xxh3_64_intdigest(mb), END))
        fh.flush()
        os.fsync(fh.fileno())
        size = fh.tell()
    os.replace(tmp, path)
    _fsync_dir(path)
    return size


def read_checkpoint(path: str) -> tuple[dict, list]:
    """Load and verify a checkpoint: (meta, per-fragment {name: float32 array})."""
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot open checkpoint {path}: {e}") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size < _HEAD.size + _FOOT.size:
            raise CheckpointError(f"{path}: too short ({size} bytes) to be a syncer checkpoint")
        magic, ver, _flags = _HEAD.unpack(fh.read(_HEAD.size))
        if magic != MAGIC:
            raise CheckpointError(f"{path}: not a yeto-patch syncer checkpoint (magic {magic!r})")
        if ver != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format version {ver}; this syncer reads {FORMAT_VERSION}")
        fh.seek(size - _FOOT.size)
        moff, mlen, mdig, end = _FOOT.unpack(fh.read(_FOOT.size))
        if end != END or moff + mlen + _FOOT.size != size:
            raise CheckpointError(f"{path}: truncated or corrupt footer (incomplete write?)")
        fh.seek(moff)
        mb = fh.read(mlen)
        if xxhash.xxh3_64_intdigest(mb) != mdig:
            raise CheckpointError(f"{path}: metadata digest mismatch (corrupt file)")
        try:
            meta = json.loads(mb)
        except ValueError as e:
            raise CheckpointError(f"{path}: unreadable metadata: {e}") from None
        arrays = []
        for fm in meta.get("fragments", []):
            d = {}
            for name, t in fm.get("arrays", {}).items():
                if t.get("dtype") != "<f4" or t["offset"] + t["nbytes"] > moff or t["nbytes"] != 4 * t["numel"]:
                    raise CheckpointError(f"{path}: fragment {fm['index']} {name}: bad array table entry {t}")
                fh.seek(t["offset"])
                a = np.empty(t["numel"], np.float32)
                mv = memoryview(a).cast("B")
                got = fh.readinto(mv)
                if got != t["nbytes"]:
                    raise CheckpointError(f"{path}: fragment {fm['index']} {name}: short read")
                if xxhash.xxh3_64_hexdigest(mv) != t["xxh3_64"]:
                    raise CheckpointError(f"{path}: fragment {fm['index']} {name}: digest mismatch (corrupt data)")
                d[name] = a
            arrays.append(d)
    return meta, arrays


class CheckpointWriter:
    """Writes snapshots to one path; at most one write at a time (background or not)."""

    def __init__(self, path: str, background: bool = False):
        self.path = path
        self.background = background
        self._thread: Optional[threading.Thread] = None
        self._snap: Optional[Snapshot] = None
        self._err: Optional[BaseException] = None
        self._lock = threading.Lock()
        self.writes = 0
        self.last_seconds = 0.0
        self.last_bytes = 0

    def protect(self, i: int) -> None:
        snap = self._snap
        if snap is not None:
            snap.protect(i)

    def wait(self) -> None:
        """Wait for the running write; re-raise its failure."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        if self._err is not None:
            e, self._err = self._err, None
            raise CheckpointError(f"checkpoint write to {self.path} failed: {e}") from e

    def _run(self, snap: Snapshot) -> None:
        t0 = time.monotonic()
        try:
            self.last_bytes = write_checkpoint(self.path, snap)
            self.last_seconds = time.monotonic() - t0
            self.writes += 1
            log.info("checkpoint written: %s (%.1f MB in %.2fs)", self.path, self.last_bytes / 1e6, self.last_seconds)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self._err = e
            log.error("checkpoint write to %s failed: %s (the previous checkpoint is intact)", self.path, e)
        finally:
            snap.release()
            self._snap = None

    def save(self, snap: Snapshot, background: Optional[bool] = None) -> None:
        with self._lock:
            self.wait()
            bg = self.background if background is None else background
            self._snap = snap
            if bg:
                self._thread = threading.Thread(target=self._run, args=(snap,), name="yeto-checkpoint",
                                                daemon=True)
                self._thread.start()
            else:
                self._run(snap)
                self.wait()
