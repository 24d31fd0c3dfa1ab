"""One fragment of the model as the syncer holds it, and the only code that touches its arrays.

A :class:`GlobalFragment` (the global model's copy; an island's own state of a fragment is
island/boundary/fragment.Fragment) owns the fragment's committed tensors (base, momentum, delay buffer, and with
``--base-wire int8/int4/topk:F+intB`` the shadow base the islands hold), its version, the encoded update from the
previous shadow, the per-tensor digests islands compare with what they declared, and the readers-writer lock that
lets base streams read the live base while a merge waits to write it, and whether it takes pushes at all (``closed``:
total rounds reached, final cut done). Its open round is not here: rounds/round.py owns it, and the coordinator
keeps one per fragment.

Thread-safety: the caller holds the coordinator's lock for :meth:`install_init` / :meth:`drop_init` /
:meth:`restore`; base readers hold :meth:`reading`; a merge holds :meth:`writing` while it changes the arrays.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import numpy as np
import xxhash

from ...wire import codecs
from ...wire.frames import CodecError
from .outer import FragmentTensors
from .rwlock import RWLock

__all__ = ["GlobalFragment"]

log = logging.getLogger("yeto.syncer")


class GlobalFragment:
    def __init__(self, index: int, numel: int):
        self.index = index
        self.numel = numel
        self.t = FragmentTensors(base=None)  # type: ignore[arg-type]
        self.version = 0
        self.rw = RWLock()
        self.closed = False         # total rounds reached / final cut done
        self._down: Optional[np.ndarray] = None   # encoded update shadow(version - 1) -> shadow(version)
        self._down_version = -1
        self._digests: Optional[tuple] = None     # ((version, id(array)), per-tensor xxh3 hex) for 'held' checks

    # ------------------------------------------------------------------------------------------- INIT
    @property
    def has_base(self) -> bool:
        return self.t.base is not None

    def check_init(self, values: np.ndarray) -> None:
        """Raise ValueError unless ``values`` are this fragment's INIT: ``numel`` finite float32 values."""
        if values.dtype != np.float32 or values.size != self.numel:
            raise ValueError(f"INIT of fragment {self.index} must hold {self.numel} float32 values, "
                             f"got {values.size} {values.dtype}")

    def install_init(self, values: np.ndarray, shadow: bool) -> None:
        """Take INIT values as the base (kept, not copied, when writeable); ``shadow``: base updates go out, so
        the islands' shadow starts equal to the base."""
        self.t.base = values if values.flags.writeable else values.copy()
        if shadow:
            self.t.shadow = self.t.base.copy()

    def drop_init(self) -> None:
        """Forget a partial INIT (its island left before the run was initialized; another one sends it)."""
        self.t.base = None
        self.t.shadow = None
        self._digests = None

    # -------------------------------------------------------------------------------------- checkpoint
    def arrays(self) -> dict:
        """The committed arrays by checkpoint name (call between merges)."""
        d = {"base": self.t.base}
        for name in ("momentum", "delay_buf", "shadow"):
            a = getattr(self.t, name)
            if a is not None:
                d[name] = a
        return d

    def restore(self, arrays: dict, version: int, shadow: bool) -> None:
        """Install checkpointed arrays (sizes checked by the caller). ``shadow``: base updates go out; without a
        checkpointed shadow the islands rejoin with the full base, so it starts equal to the base."""
        self.t.base = arrays["base"]
        self.t.momentum = arrays.get("momentum")
        self.t.delay_buf = arrays.get("delay_buf")
        if shadow:
            sh = arrays.get("shadow")
            self.t.shadow = sh if sh is not None and sh.size == self.numel else self.t.base.copy()
        self.version = version

    # ----------------------------------------------------------------------------------------- streams
    @contextlib.contextmanager
    def reading(self) -> Iterator["GlobalFragment"]:
        """Hold the base unchanged (a merge of this fragment waits) while it is streamed."""
        self.rw.acquire_read()
        try:
            yield self
        finally:
            self.rw.release_read()

    @contextlib.contextmanager
    def writing(self, wait: bool = True) -> Iterator[bool]:
        """Hold the write lock (streams in flight finish first); ``wait=False`` yields False at once instead of
        waiting when a stream holds the base."""
        if wait:
            self.rw.acquire_write()
        elif not self.rw.try_acquire_write():
            yield False
            return
        try:
            yield True
        finally:
            self.rw.release_write()

    def outgoing(self, final: bool) -> np.ndarray:
        """(reading) What islands install: the shadow when bases go out as updates, the base itself otherwise
        and always for the final model."""
        return self.t.base if final or self.t.shadow is None else self.t.shadow

    def update_for(self, held_version: Optional[int]) -> Optional[np.ndarray]:
        """(reading) The encoded update to the current version for an island holding ``held_version``, or None
        when it cannot use one (it holds another version, or the last update was not encodable)."""
        if self._down is not None and self._down_version == self.version and held_version == self.version - 1:
            return self._down
        return None

    def digests(self, arr: np.ndarray, sizes: list) -> list:
        """(reading) xxh3_64 hex of each tensor in ``arr`` (float32 little-endian bytes; tensors of ``sizes``
        values in layout order), cached per version and array."""
        key = (self.version, id(arr))
        if self._digests is not None and self._digests[0] == key:
            return self._digests[1]
        out, off = [], 0
        for n in sizes:
            out.append(xxhash.xxh3_64_hexdigest(memoryview(arr[off:off + n]).cast("B")))
            off += n
        self._digests = (key, out)
        return out

    # ------------------------------------------------------------------------------------ base updates
    def encode_update(self, codec: str, block: int, scratch: np.ndarray, version: int, threads: int) -> None:
        """(writing) shadow += decode(encode(base - shadow)); the encoded update goes to islands holding the
        previous shadow. ``scratch`` is a spent accumulator of ``numel`` values."""
        t = self.t
        try:
            np.subtract(t.base, t.shadow, out=scratch)
            body = codecs.encode(codec, scratch, block, name=f"fragment {self.index} base update", threads=threads)
            codecs.decode(codec, body, self.numel, block, out=scratch, threads=threads)
            np.add(t.shadow, scratch, out=t.shadow)
            self._down, self._down_version = body, version
        except CodecError as e:   # not expected (base and shadow are finite): islands get the full base instead
            log.error("fragment %d: base update to v%d not encodable (%s); sending the full base", self.index,
                      version, e)
            np.copyto(t.shadow, t.base)
            self._down, self._down_version = None, -1
