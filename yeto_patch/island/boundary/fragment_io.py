"""A fragment's values between the FP32 masters (``MasterView``) and the syncer's link.

- push: the encoder of a fragment's delta on rank 0 (``push_encoder.py``, with error feedback if on); the delta
  itself is gathered by the push lane (push_lane.py);
- INIT: stream the fragment's masters to the syncer from rank 0 without holding the fragment (``send_init``);
- install: write a base (or the encoded updates of the anchor, --base-wire int8/int4/topk) into masters, model
  parameters and anchors (``install``: at start, the final cut and restarts); bases merged during training are
  staged in the background (``base_lane.py``, ``base_sources``) and installed by ``installs.Installer``;
- the start digests of every tensor (the syncer skips initial bases this island already holds).

Every function runs on every rank (the view's reads and writes are collectives); only rank 0 sees values.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Optional

import numpy as np

from yeto_patch.island.errors import EngineError

log = logging.getLogger("yeto_patch")


def model_chunks(model, optimizer) -> list:
    """The model chunks the island trains: those the train_step hook named, else the optimizer's."""
    chunks = model
    if chunks is None and optimizer is not None:
        chunks = getattr(optimizer, "model_chunks", None) or None
    if chunks is None:
        raise EngineError("yeto-patch cannot find the model: the optimizer has no model_chunks and no "
                          "train_step hook told it. Use Megatron's train_step, or a megatron-core optimizer "
                          "built by get_megatron_optimizer (which knows its model chunks)")
    if optimizer is None:
        raise EngineError("yeto-patch cannot find the optimizer of this training run")
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


class FragmentIO:
    def __init__(self, view, manifest, settings, rank: int):
        self.view, self.manifest, self.settings, self.rank = view, manifest, settings, rank

    def push_encoder(self, frag):
        """Rank 0: the encoder of fragment `frag`'s next push (with error feedback the fragment's residual is
        carried, created here)."""
        from yeto_patch.island.boundary.push_encoder import PushEncoder
        s = self.settings
        residual = frag.residual_buffer() if s.error_feedback else None
        return PushEncoder(s.push_dtype, s.block, frag.numel, piece_elems=max(s.chunk_bytes // 4, s.block),
                           residual=residual, what=f"fragment {frag.index} delta", entry_starts=frag.shape.starts,
                           entry_names=[self.manifest.entries[e].name for e in frag.entries])

    def send_init(self, frag, send) -> None:
        """Every rank: read fragment `frag`'s FP32 masters; rank 0 streams them to `send(iterator of arrays)`."""
        if self.rank != 0:
            self.view.read(frag.entries, None)
            return
        bridge = StreamBridge(send, self.settings.timeout, f"INIT of fragment {frag.index}")
        try:
            self.view.read(frag.entries, lambda e, off, arr: bridge.put(arr))
        except BaseException:
            bridge.abort()
            raise
        bridge.close()
        log.info("yeto-patch: sent INIT of fragment %d (%.1f M values)", frag.index, frag.numel / 1e6)

    def install(self, frag, base, alpha, updates: int, own_weights: bool) -> None:
        """Every rank: install `base` (rank 0; None elsewhere) into fragment `frag`; the base becomes the anchor.
        `alpha` None: the base replaces the masters; else masters := alpha * local + (1 - alpha) * base (1.0
        keeps the local masters: a restart where the syncer is still at this anchor). With `updates` > 0 the base
        holds that many quantized changes of the anchor: each owner adds them to its anchor, the first ones to
        the anchor only, the last one as the install. `own_weights`: the island's weights are the base (digests
        matched): they become the anchor first."""
        idx = frag.entries
        sources = self.base_sources(frag, base, updates) if base is not None else [None] * max(1, updates)
        if own_weights:
            self.view.snapshot_anchor(idx)
            sources = sources if updates else []
        rel = {"relative": True} if updates else {}
        for src in sources[:-1]:   # intermediate updates: anchors only (alpha 1 keeps every master as it is)
            self.view.write(idx, src, mode="blend", alpha=1.0, set_anchor=True, anchor="value", **rel)
        if sources:
            if alpha is None:
                self.view.write(idx, sources[-1], mode="replace", set_anchor=True, **rel)
            else:
                self.view.write(idx, sources[-1], mode="blend", alpha=alpha, set_anchor=True, anchor="value", **rel)

    @staticmethod
    def base_sources(frag, base, updates: int) -> list:
        """Rank 0: ``source(index, offset, count)`` callables of `base` for fragment `frag`: one per base update
        (`updates` of them), or the one absolute base."""
        offs = frag.shape.offsets
        if base.relative:
            def update(i):
                return lambda e, off, n: base.delta_range(i, offs[e] + off, n)
            return [update(i) for i in range(updates)]
        values = base.values

        def full(e, off, n):
            a = offs[e] + off
            return values[a:a + n]
        return [full]

    def start_digests(self) -> Optional[list]:
        """Every rank: one read of the model; rank 0 gets the xxh3_64 digest of each tensor's float32 values."""
        import xxhash
        n = len(self.manifest)
        hs = [xxhash.xxh3_64() for _ in range(n)]
        pos = [0] * n

        def sink(e, off, arr):
            if off != pos[e]:
                raise EngineError(f"internal: start digest of tensor {e} read out of order")
            a = np.ascontiguousarray(arr, dtype="<f4")
            hs[e].update(memoryview(a).cast("B"))
            pos[e] += a.size
        t0 = time.perf_counter()
        self.view.read(None, sink if self.rank == 0 else None)
        if self.rank != 0:
            return None
        log.info("yeto-patch: start digests of %d tensors in %.1fs", n, time.perf_counter() - t0)
        return [h.hexdigest() for h in hs]


class StreamBridge:
    """Feeds arrays produced on this thread (a collective read's sink) to `consume(iterator)` on another
    thread, holding at most two chunks; a failure on either side ends both."""
    _END = object()

    def __init__(self, consume, timeout, what):
        self.q = queue.Queue(maxsize=2)
        self.timeout, self.what = timeout, what
        self.error: Optional[BaseException] = None
        self.t = threading.Thread(target=self._run, args=(consume,), name="yeto-stream", daemon=True)
        self.t.start()

    def _items(self):
        while True:
            item = self.q.get(timeout=self.timeout)
            if item is self._END:
                return
            yield item

    def _run(self, consume):
        try:
            consume(self._items())
        except BaseException as e:  # noqa: BLE001 - handed to the producer
            self.error = e
            while True:   # unblock a producer waiting on a full queue
                try:
                    self.q.get_nowait()
                except queue.Empty:
                    break

    def put(self, arr):
        deadline = time.monotonic() + self.timeout
        while True:
            if self.error is not None:
                raise self.error
            if not self.t.is_alive():
                raise EngineError(f"{self.what}: the sender stopped")
            try:
                self.q.put(arr, timeout=0.5)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.what}: the syncer did not take data for {self.timeout:.0f}s")

    def close(self):
        if self.error is None:
            self.q.put(self._END, timeout=self.timeout)
        self.t.join(self.timeout)
        if self.error is not None:
            raise self.error
        if self.t.is_alive():
            raise EngineError(f"{self.what}: not finished within {self.timeout:.0f}s")

    def abort(self):
        try:
            self.q.put_nowait(self._END)
        except queue.Full:
            pass
