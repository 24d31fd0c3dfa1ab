"""The boundary engine: turns an island's optimizer steps into DiLoCo / Streaming DiLoCo rounds with the syncer.

The shim's hooks drive it (``yeto_patch.hooks``); nothing here names Megatron's training loop. One ``Engine`` per
process, on every rank of the island; island rank 0 talks to the syncer, and every decision is rank 0's, sent
to the other ranks as a JSON plan, so every rank runs the same collectives in the same order.

Life of an island:
- Start (first ``train_step`` before its forward, or else the first optimizer step before its update): the
  ranks build the global manifest and the master view; rank 0 connects, authenticates and says hello with the
  manifest; every rank learns the syncer's fragment layout; fragments the syncer asks for are sent as INIT
  (read from the FP32 masters, streamed); then the base of every fragment is installed (masters and model
  parameters) and becomes that fragment's anchor, before the first update.
- Every optimizer step calls ``on_optimizer_step`` once (a skipped update counts as a step with zero tokens).
  Fragment f reaches a boundary every H steps, the fragments spread evenly over H (``schedule.py``). At a
  boundary the fragment's delta (anchor minus current FP32 masters) is computed where the data lives, streamed
  to rank 0 in bounded chunks, encoded there (``push_encoder.py``, with error feedback if on) and handed to a
  background sender: training goes on without waiting for the network.
- A merged base arriving in the background is installed at the first step boundary after it arrived:
  ``alpha * local + (1 - alpha) * base`` when tau > 0, the base itself when tau = 0; the base becomes the
  fragment's anchor. Rank 0 decides and broadcasts a plan only on steps where something can happen (a fragment
  is due, a push awaits its base, or it is the last step), so most steps cost no collective at all; a base
  nobody on this island asked for (merged by a quorum without it) waits for the next such step. If tau steps
  pass after a push without its base, the island waits for it (bounded by YETO_DILOCO_TIMEOUT, with a log line
  saying what it waits for).
- Final cut, at the last step: pending bases are awaited and installed, every fragment's final delta is
  pushed, the syncer's final model is awaited and installed exactly (replace), and ``finished`` turns True.
  The train_step hook then makes Megatron save and stop. A custom loop that has only the optimizer hook asks
  ``yeto_patch.island.engine.finished()`` after each step and stops when it is True; a step after the final
  cut raises.

Failures of the link or the syncer: a lost connection (or one silent for a lease) is replaced by rank 0
(``_reconnect``: same incarnation, bounded back-off, unanswered pushes sent again, bases merged meanwhile taken)
for up to YETO_DILOCO_TIMEOUT. A restarted island restores the sync state saved beside the Megatron checkpoint it
loaded (``sync_state.py``; ``save_sync_state`` / ``set_resume``, called by the checkpoint hooks).

Errors: anything else that goes wrong on rank 0 (a refused push, a syncer gone for longer than the timeout, a bad
key) is raised on every rank with rank 0's message; errors inside collectives are agreed island-wide by
``IslandComm``. After a failure the engine stays failed and every later step raises the same error.
"""
from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import threading
import time
from typing import Dict, List, Optional

import numpy as np

log = logging.getLogger("yeto_patch")

_current: Optional["Engine"] = None


def finished() -> bool:
    """True once this process's island installed the syncer's final model (for custom training loops)."""
    return _current is not None and _current.finished


def current() -> Optional["Engine"]:
    return _current


class EngineError(RuntimeError):
    """A DiLoCo boundary failed; raised on every rank of the island with the cause."""


class Engine:
    def __init__(self, settings, optimizer=None, model=None):
        global _current
        self.settings = settings
        self.optimizer = optimizer
        self.model = model
        self.started = False
        self.finished = False
        self.failed: Optional[BaseException] = None
        self.step = 0                 # optimizer steps done (Megatron's iteration when it tells us)
        self.total: Optional[int] = None
        self.train_iters: Optional[int] = None
        self.vocab_size: Optional[int] = settings.vocab_size
        self.client = None
        self.sender = None
        self.log = None
        self._warned_tokens = False
        self._resume: Optional[tuple] = None   # (directory, iteration) of the Megatron checkpoint loaded
        self.init_sent: List[int] = []   # rank 0: fragments this island sent INIT of (in the WELCOME or later)
        _current = self

    def set_resume(self, directory, iteration):
        """Megatron loaded the checkpoint of `iteration` from `directory` (before the first step): the island's
        sync state saved beside it is restored at start."""
        self._resume = (directory, int(iteration)) if directory and iteration else None

    # ================================================================================ hook entry points
    def on_train_step_start(self, iteration=None, train_iters=None, tokens=None, vocab_size=None):
        self._alive()
        if train_iters is not None:
            self.train_iters = int(train_iters)
        if vocab_size is not None and self.settings.vocab_size is None:
            self.vocab_size = int(vocab_size)
        if iteration is not None:
            self.step = int(iteration)
        if not self.started:
            self._guarded(self._start)

    def before_optimizer_step(self, optimizer=None):
        self._alive()
        if self.finished:
            self._fail_local(EngineError(
                f"yeto-patch: an optimizer step after the final cut (step {self.step}); the global model was "
                f"installed at step {self.total}. Stop the training loop when "
                f"yeto_patch.island.engine.finished() is True"))
        if not self.started:
            if optimizer is not None and self.optimizer is None:
                self.optimizer = optimizer
            self._guarded(self._start)

    def on_optimizer_step(self, update_successful=True, tokens=None):
        self._alive()
        if tokens is None and update_successful and not self._warned_tokens:
            self._warned_tokens = True
            if getattr(self, "rank", 0) == 0:
                log.warning("yeto-patch: tokens per step are unknown here (no train_step hook): pushes report 0 "
                            "tokens; weight islands by 'equal' or 'steps' on the syncer")
        self.step += 1
        n = 0 if not update_successful else int(tokens or 0)
        for f in range(self.P):
            self.steps_since[f] += 1
            self.tokens_since[f] += n
        self._guarded(self._boundary)

    def close(self):
        """Stop talking to the syncer (BYE); idempotent. Called at exit and by tests."""
        sender, client, self.sender, self.client = self.sender, self.client, None, None
        if sender is not None and self.failed is None:
            try:
                sender.close(5.0)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
        if self.log is not None:
            self.log.close()

    # ================================================================================ error handling
    def _alive(self):
        if self.failed is not None:
            raise self.failed

    def _fail_local(self, err):
        self.failed = err
        raise err

    def _guarded(self, fn):
        try:
            fn()
        except BaseException as e:
            if self.failed is None:
                self.failed = e if isinstance(e, Exception) else EngineError(str(e))
                self._shutdown_quietly()
            raise

    def _shutdown_quietly(self):
        try:
            if self.client is not None:
                self.client.close()
        except Exception:  # noqa: BLE001
            pass

    def _rank0(self, fn, what):
        """Run fn on rank 0 and broadcast its JSON result (or its error) to every rank."""
        out = None
        if self.rank == 0:
            try:
                out = {"ok": fn()}
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                out = {"error": _describe(e, what)}
        out = self._broadcast_json(out, f"yeto-patch: {what}")
        if "error" in out:
            raise EngineError(out["error"] + ("" if self.rank == 0 else " [island rank 0]"))
        return out["ok"]

    _SMALL = 4096

    def _broadcast_json(self, obj, what):
        """Rank 0's JSON object to every rank in one gloo broadcast when it fits in 4 KiB (plans almost always
        do), else a second one for the rest; errors and timeouts name the call."""
        import json
        import torch
        import torch.distributed as dist
        data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == 0 else b""
        head = torch.zeros(self._SMALL, dtype=torch.uint8)
        if self.rank == 0:
            n = len(data)
            head[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
            k = min(n, self._SMALL - 8)
            if k:
                head[8:8 + k] = torch.frombuffer(bytearray(data[:k]), dtype=torch.uint8)
        try:
            dist.broadcast(head, src=0, group=self.comm.group)
            raw = head.numpy().tobytes()
            n = int.from_bytes(raw[:8], "little")
            if n <= self._SMALL - 8:
                body = raw[8:8 + n]
            else:
                rest = torch.zeros(n - (self._SMALL - 8), dtype=torch.uint8)
                if self.rank == 0:
                    rest.copy_(torch.frombuffer(bytearray(data[self._SMALL - 8:]), dtype=torch.uint8))
                dist.broadcast(rest, src=0, group=self.comm.group)
                body = raw[8:] + rest.numpy().tobytes()
        except Exception as e:  # gloo timeout or a peer that went away
            raise EngineError(f"{what}: the island's broadcast failed on rank {self.rank} (timeout "
                              f"{self.comm.timeout_s:.0f}s): {type(e).__name__}: {e}") from e
        return json.loads(body.decode())

    # ================================================================================ start
    def _start(self):
        from yeto_patch.island.collective import IslandComm
        from yeto_patch.island.masters import MasterView
        from yeto_patch.island.names import VOCAB_NAMES, build_manifest, vocab_rows_message
        s = self.settings
        t0 = time.time()
        chunks = self._model_chunks()
        self.comm = IslandComm(timeout_s=s.timeout + 60.0)
        self.rank = self.comm.rank
        self.total = self._resolve_total()
        if self.rank == 0:
            from yeto_patch.island.boundary_log import BoundaryLog
            self.log = BoundaryLog(s.metrics_path, s.island_id)
        vocab_rows: dict = {}   # every padded row is merged unless the run's manifest has other vocabulary rows
        for _ in range(len(VOCAB_NAMES) + 1):
            self.manifest = build_manifest(chunks, real_vocab_size=self.vocab_size, vocab_rows=vocab_rows,
                                           merge_padding=True, comm=self.comm)
            self.view = MasterView(chunks, self.optimizer, self.manifest, chunk_bytes=s.chunk_bytes, comm=self.comm)
            self._declared = self._start_digests() if s.start_digest else None
            welcome = self._rank0(self._connect, f"connect to the syncer at {s.syncer}")
            if "vocab_rows" not in welcome:
                break
            for name, rows in welcome["vocab_rows"].items():   # said on every rank
                log.warning("yeto-patch: %s", vocab_rows_message(self.manifest, name, int(rows)))
                vocab_rows[name] = int(rows)
        else:
            raise EngineError(f"the syncer at {s.syncer} keeps refusing this island's vocabulary rows {vocab_rows}")
        self._adopt_layout(welcome)
        if welcome["final"]:
            raise EngineError(f"the syncer at {s.syncer} has already ended its run (final cut done); start a new "
                              f"syncer run for this training")
        state, arrays = self._read_sync_state()
        for f in welcome["needs_init"]:
            self._send_init(f)
        self._await(lambda: self._have_all_bases(), "the initial base of every fragment", init_ok=True)
        plans = self._rank0(lambda: {str(f): self._install_plan(f)[1:] for f in range(self.P)}, "initial versions")
        v = {f: p[0] for f, p in plans.items()}
        keep = set()
        if state is not None:   # a restart: fragments whose anchor is still the syncer's base keep local progress
            keep = {f for f in range(self.P) if state["anchor_version"][f] == int(v[str(f)])}
        for f in range(self.P):
            self._install(f, int(v[str(f)]), mode="keep" if f in keep else "replace",
                          why="resume" if f in keep else "start", updates=plans[str(f)][1], held=plans[str(f)][2])
        if state is not None:
            self._restore(state, arrays, keep, v)
        self.started = True
        if self.rank == 0:
            log.info("yeto-patch: island %s joined the syncer at %s: %d tensors (%.1f M values) in %d fragments, "
                     "H=%d, push %s, tau=%d, final cut at step %d; start took %.1fs", s.island_id, s.syncer,
                     len(self.manifest), self.manifest.total_numel() / 1e6, self.P, s.sync_every, s.push_dtype,
                     s.overlap_steps, self.total, time.time() - t0)
            self.log.write("start", step=self.step, fragments=self.P, versions=[self.anchor_version[f]
                                                                                for f in range(self.P)],
                           init=sorted(set(self.init_sent)), seconds=round(time.time() - t0, 3),
                           held=[f for f in range(self.P) if plans[str(f)][2]])
            atexit.register(self.close)

    # ================================================================================ restart
    def save_sync_state(self, directory, iteration):
        """Every rank, after Megatron saved `iteration` into `directory`: rank 0 writes the island's sync state
        beside it (``sync_state.py``); a failure is raised on every rank."""
        if not self.started or self.failed is not None or self.finished or not directory:
            return
        from yeto_patch.island import sync_state

        def write():
            path = sync_state.state_path(directory, iteration)
            meta, arrays = self._sync_state(int(iteration))
            n = sync_state.write_state(path, meta, arrays)
            log.info("yeto-patch: saved the island's sync state for iteration %d (%.1f MB) to %s", iteration, n / 1e6,
                     path)
            return True
        self._guarded(lambda: self._rank0(write, f"save the island's sync state for iteration {iteration}"))

    def _sync_state(self, iteration):
        """Rank 0: (meta, arrays) of what a restart from this step needs."""
        s = self.settings
        pending, arrays = {}, {}
        for f, rec in self.pending.items():
            pending[str(f)] = {k: v for k, v in rec.items() if not k.startswith("_")}
            arrays[f"push.{f}"] = np.frombuffer(memoryview(rec["_body"]).cast("B"), dtype=np.uint8)
        for f, r in self.residual.items():
            arrays[f"residual.{f}"] = r
        meta = {"format": "yeto-island-sync-state", "island_id": s.island_id, "iteration": iteration,
                "step": self.step, "manifest_digest": self.manifest.digest(), "layout": self.layout,
                "push_dtype": s.push_dtype, "block": s.block, "error_feedback": bool(s.error_feedback),
                "anchor_version": list(self.anchor_version), "steps_since": list(self.steps_since),
                "tokens_since": list(self.tokens_since), "pending": pending}
        return meta, arrays

    def _read_sync_state(self):
        """Every rank: the sync state saved with the Megatron checkpoint this process loaded, checked against
        this run (rank 0 reads it and sends the meta; the arrays stay on rank 0). (None, {}) when there is none
        or it does not fit, with a warning saying why."""
        if self._resume is None:
            return None, {}
        directory, iteration = self._resume
        from yeto_patch.island import sync_state
        arrays = {}

        def read():
            path = sync_state.state_path(directory, iteration)
            if not os.path.exists(path):
                log.warning("yeto-patch: Megatron resumed from iteration %d but %s does not exist (a checkpoint "
                            "saved without yeto-patch?): this island starts from the syncer's current bases",
                            iteration, path)
                return None
            meta, arr = sync_state.read_state(path)
            why = None
            if meta.get("manifest_digest") != self.manifest.digest():
                why = "its parameter manifest differs from this run's"
            elif meta.get("layout") != self.layout:
                why = "it was saved with another fragment layout (--fragments)"
            elif meta.get("iteration") != iteration:
                why = f"it belongs to iteration {meta.get('iteration')}, not {iteration}"
            elif meta.get("island_id") != self.settings.island_id:
                why = f"it belongs to island {meta.get('island_id')!r}"
            if why:
                log.warning("yeto-patch: ignoring the sync state %s: %s; this island starts from the syncer's "
                            "current bases", path, why)
                return None
            if (meta.get("push_dtype"), meta.get("block")) != (self.settings.push_dtype, self.settings.block):
                arr = {k: v for k, v in arr.items() if not k.startswith("push.")}   # re-encoded pushes differ
                meta["pending"] = {}
            arrays.update(arr)
            log.info("yeto-patch: resuming the island's sync state of iteration %d from %s (anchors at versions "
                     "%s, %d push(es) awaiting their answer)", iteration, path, meta["anchor_version"],
                     len(meta["pending"]))
            return {k: meta[k] for k in ("anchor_version", "steps_since", "tokens_since", "pending")}
        state = self._rank0(read, f"read the island's sync state of iteration {iteration}")
        return state, arrays

    def _restore(self, state, arrays, keep, versions):
        """Every rank, after the start's installs: counters and unanswered pushes of the fragments that keep their
        local progress; the error-feedback residuals (rank 0). A fragment the syncer merged past the saved anchor
        (with this island's pushes made before it died, whose steps it now trains again) skips that many of its
        next boundaries, so the island's rounds line up with the other islands' again."""
        for f in range(self.P):
            ahead = int(versions[str(f)]) - int(state["anchor_version"][f])
            if f not in keep and ahead > 0:
                self._skip[f] = ahead
        for f in keep:
            self.steps_since[f] = int(state["steps_since"][f])
            self.tokens_since[f] = int(state["tokens_since"][f])
            rec = state["pending"].get(str(f))
            if rec is None:
                continue
            if self.rank != 0:
                self.pending[f] = {"step": int(rec["step"])}
                continue
            rec = dict(rec, _send={}, _body=arrays[f"push.{f}"])
            self.pending[f] = rec
            self._repushed.add((f, int(rec["base_version"])))
            self._send_push(f, rec)
        if self.rank == 0 and self.settings.error_feedback:
            for f in range(self.P):
                r = arrays.get(f"residual.{f}")
                if r is not None and r.size == self.frag_numel[f]:
                    self.residual[f] = r.astype(np.float32, copy=True)

    def _model_chunks(self):
        chunks = self.model
        if chunks is None and self.optimizer is not None:
            chunks = getattr(self.optimizer, "model_chunks", None) or None
        if chunks is None:
            raise EngineError("yeto-patch cannot find the model: the optimizer has no model_chunks and no "
                              "train_step hook told it. Use Megatron's train_step, or a megatron-core optimizer "
                              "built by get_megatron_optimizer (which knows its model chunks)")
        if self.optimizer is None:
            raise EngineError("yeto-patch cannot find the optimizer of this training run")
        return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]

    def _resolve_total(self) -> int:
        s = self.settings
        total = s.total_steps if s.total_steps is not None else self.train_iters
        if total is None:
            raise EngineError("YETO_DILOCO_TOTAL_STEPS is not set and the training loop does not say how many "
                              "steps it runs: set YETO_DILOCO_TOTAL_STEPS to the step of the final cut")
        if self.train_iters is not None and total > self.train_iters:
            raise EngineError(f"YETO_DILOCO_TOTAL_STEPS={total} is beyond Megatron's train_iters="
                              f"{self.train_iters}: the final cut would never happen")
        if total <= self.step:
            raise EngineError(f"this run resumes at step {self.step}, at or past the final cut at step {total} "
                              f"(YETO_DILOCO_TOTAL_STEPS or train_iters)")
        return int(total)

    def _connect(self):
        from yeto_patch.wire import auth
        from yeto_patch.wire.client import SyncerClient
        from yeto_patch.wire.sender import BackgroundSender
        from yeto_patch.wire.frames import PeerError
        from yeto_patch.island.names import run_vocab_rows
        s = self.settings
        key = auth.load_key(s.key_file) if (s.key_file or s.key_from_env) else None
        if key is None and not s.insecure:
            raise EngineError("no key: set YETO_DILOCO_KEY_FILE (or YETO_KEY)")
        retries, spent, b = 0, 0.0, 0.5   # connection back-off bounded by half the timeout
        while spent + b <= s.timeout / 2 and retries < 30:
            spent += b
            b = min(b * 2, 10.0)
            retries += 1
        self._key = key
        self.client = SyncerClient(s.syncer, key, s.island_id, self.manifest.wire_manifest(),
                                   timeout=s.timeout, insecure=s.insecure, connect_retries=retries,
                                   backoff=0.5, max_backoff=10.0, held=self._declared)
        try:
            w = self.client.connect()
        except PeerError as e:   # the run pads the vocabulary otherwise: connect again with its rows
            rows = run_vocab_rows(e.message, self.manifest.wire_manifest()) if e.code == "manifest" else None
            if rows is None:
                raise
            self.client.close()
            return {"vocab_rows": rows}
        self.sender = BackgroundSender(s.send_queue_bytes, name="yeto-push-sender")
        return dict(layout=w.layout, numels=w.numels, fragments=w.fragments, versions=w.versions,
                    needs_init=list(w.needs_init), final=bool(w.final))

    def _adopt_layout(self, w):
        n = len(self.manifest)
        layout = [[int(i) for i in frag] for frag in w["layout"]]
        seen = sorted(i for frag in layout for i in frag)
        if seen != list(range(n)):
            raise EngineError(f"the syncer's fragment layout does not cover this island's {n} tensors exactly "
                              f"once")
        self.P = int(w["fragments"])
        if len(layout) != self.P:
            raise EngineError(f"the syncer announced {self.P} fragments but sent {len(layout)}")
        self.layout = layout
        self.frag_offsets: List[Dict[int, int]] = []
        self.frag_numel: List[int] = []
        self.frag_starts: List[List[int]] = []
        for f, idx in enumerate(layout):
            off, offs, starts = 0, {}, []
            for e in idx:
                offs[e] = off
                starts.append(off)
                off += self.manifest.entries[e].numel
            if off != int(w["numels"][f]):
                raise EngineError(f"fragment {f}: the syncer counts {w['numels'][f]} values, this island "
                                  f"{off}")
            self.frag_offsets.append(offs)
            self.frag_numel.append(off)
            self.frag_starts.append(starts)
        self.anchor_version = [-1] * self.P
        self.steps_since = [0] * self.P
        self.tokens_since = [0] * self.P
        self.pending: Dict[int, dict] = {}   # fragment -> the push awaiting its base (rank 0 keeps the timings)
        self.arrived: Dict[int, object] = {}  # rank 0: newest base received per fragment, not yet installed
        self.residual: Dict[int, np.ndarray] = {}
        self._outage: Optional[float] = None  # rank 0: when the link to the syncer was lost (None: it is up)
        self._repushed: set = set()           # rank 0: (fragment, base) sent again after a reconnect
        self._adopt: set = set()              # rank 0: fragments whose (older) syncer base replaces the anchor
        self._skip: Dict[int, int] = {}       # boundaries (final push included) to skip after a restart
        self._refusals = collections.deque()  # rank 0: refusals the sender thread met (raised by _poll)

    def _have_all_bases(self):
        self._poll()
        return len(self.arrived) == self.P

    # ================================================================================ collective pieces
    def _poll(self):
        """Rank 0: move what the client received into `arrived` (newest per fragment); surface failures. A lost
        link is replaced (``_reconnect``) within YETO_DILOCO_TIMEOUT instead of failing the island."""
        from yeto_patch.wire.client import SyncerRefusal, recoverable
        while True:
            try:
                if self._refusals:
                    raise self._refusals.popleft()
                if self.sender is not None:
                    self.sender.check()
                bases = self.client.poll()
                break
            except SyncerRefusal as e:
                if e.code == "duplicate":   # sent again after a lost link, or by this island before a restart:
                    if (e.fragment, e.base_version) not in self._repushed:   # the syncer counts the first once
                        log.info("yeto-patch: step %d: the syncer already holds this island's push of fragment %s "
                                 "relative to v%s (made before a restart); it counts once", self.step, e.fragment,
                                 e.base_version)
                    self._repushed.discard((e.fragment, e.base_version))
                    continue
                if e.code == "stale":   # merged past it without this island: the newer base answers the push
                    log.warning("yeto-patch: step %d: the syncer refused the push of fragment %s relative to v%s "
                                "as stale (it merged on without this island); pulling its current base", self.step,
                                e.fragment, e.base_version)
                    continue
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if not self.started or not recoverable(e):
                    raise
                self._reconnect(e)
        self._outage = None
        for b in bases:
            cur = self.arrived.get(b.fragment)
            if b.relative:   # an update of the previous base (--base-wire int8/int4): applied in order
                self.arrived[b.fragment] = b if cur is None else cur.then(b)
            elif cur is None or b.version >= cur.version or b.fragment in self._adopt:
                self.arrived[b.fragment] = b

    def _reconnect(self, cause):
        """Rank 0: the link to the syncer is gone (syncer restart, cut link, dead peer). Reconnect with the same
        incarnation and bounded back-off, then reconcile: a push whose base is still the syncer's current one
        is sent again (the syncer refuses it as a duplicate if it had it: counted once either way); a push the
        syncer merged meanwhile is answered by the current base, which the syncer sends on every welcome; a
        fragment where the syncer is behind this island (it resumed from an older checkpoint) adopts the
        syncer's base. Gives up YETO_DILOCO_TIMEOUT after the link was lost."""
        from yeto_patch.wire.client import SyncerClient, recoverable
        from yeto_patch.wire.sender import BackgroundSender
        s = self.settings
        now = time.monotonic()
        if self._outage is None:
            self._outage = now
        deadline = self._outage + s.timeout
        log.warning("yeto-patch: step %d: lost the syncer at %s (%s: %s); reconnecting for up to %.0fs",
                    self.step, s.syncer, type(cause).__name__, cause, deadline - now)
        old_client, old_sender = self.client, self.sender
        if old_sender is not None:
            old_sender.abort(timeout=2.0)
        if old_client is not None:
            old_client.abort()
        wait, attempt = 0.5, 0
        while True:
            attempt += 1
            c = SyncerClient(s.syncer, self._key, s.island_id, self.manifest.wire_manifest(),
                             incarnation=old_client.incarnation, timeout=min(s.timeout, 60.0),
                             insecure=s.insecure, connect_retries=0)
            try:
                w = c.connect()
                break
            except Exception as e:  # noqa: BLE001
                c.abort()
                left = deadline - time.monotonic()
                if not recoverable(e) or left <= 0:
                    raise EngineError(f"yeto-patch: lost the syncer at {s.syncer} at step {self.step} "
                                      f"({type(cause).__name__}: {cause}) and could not reconnect"
                                      f"{' within YETO_DILOCO_TIMEOUT=%.0fs' % s.timeout if left <= 0 else ''}: "
                                      f"{_describe(e, 'reconnect')}") from e
                time.sleep(min(wait, max(0.0, left)))
                wait = min(wait * 2, 10.0)
        if [[int(i) for i in frag] for frag in w.layout] != self.layout or list(w.numels) != self.frag_numel:
            c.abort()
            raise EngineError(f"yeto-patch: the syncer at {s.syncer} came back with a different fragment layout "
                              f"(another --fragments or another run); this island cannot continue with it")
        if w.versions is None:
            c.abort()
            raise EngineError(f"yeto-patch: the syncer at {s.syncer} came back without this run's state (no "
                              f"checkpoint, or restarted without --resume); restart it with --checkpoint ... "
                              f"--resume")
        self.client = c
        self.sender = BackgroundSender(s.send_queue_bytes, name="yeto-push-sender")
        repush, adopt = [], []
        for f in range(self.P):
            v = int(w.versions[f])
            rec = self.pending.get(f)
            if v < self.anchor_version[f]:
                adopt.append(f)
                self._adopt.add(f)
            elif rec is not None and rec["base_version"] == v and "_body" in rec:
                repush.append(f)
                self._repushed.add((f, v))
                self._send_push(f, rec)
        if adopt:
            log.warning("yeto-patch: the syncer at %s is behind this island for fragments %s (it resumed from an "
                        "older checkpoint: run it with --checkpoint-every 1 to lose nothing); adopting its bases",
                        s.syncer, adopt)
        log.warning("yeto-patch: step %d: reconnected to the syncer at %s after %.1fs (attempt %d, versions %s); "
                    "pushing again fragments %s", self.step, s.syncer, time.monotonic() - self._outage, attempt,
                    w.versions, repush)
        if self.log is not None:
            self.log.write("reconnect", step=self.step, cause=f"{type(cause).__name__}: {cause}",
                           seconds=round(time.monotonic() - self._outage, 3), versions=list(w.versions),
                           repushed=repush, adopted=adopt)

    def _slice(self):
        """Longest time rank 0 blocks before the island's other ranks hear from it again (they wait in a gloo
        collective whose own timeout is YETO_DILOCO_TIMEOUT + 60 s)."""
        return max(1.0, min(30.0, self.settings.timeout / 4))

    def _await(self, ready, what, init_ok=False):
        """Every rank: loop until rank 0's `ready()` is True, bounded by YETO_DILOCO_TIMEOUT. Rank 0 also answers
        the syncer's INIT requests meanwhile (init_ok), and logs once what it waits for."""
        s = self.settings
        t_end = time.monotonic() + s.timeout
        logged = False
        while True:
            def probe():
                nonlocal logged
                t_slice = time.monotonic() + self._slice()
                while True:
                    if ready():
                        return {"done": True}
                    if init_ok:
                        req = self.client.init_requested()
                        if req:
                            return {"init": req}
                    now = time.monotonic()
                    if now >= t_end:
                        raise EngineError(f"yeto-patch: timed out after {s.timeout:.0f}s (YETO_DILOCO_TIMEOUT) "
                                          f"waiting for {what} from the syncer at {s.syncer}")
                    if now >= t_slice:
                        return {"wait": True}
                    if not logged:
                        log.info("yeto-patch: step %d: waiting for %s (up to %.0fs)", self.step, what, t_end - now)
                        logged = True
                    self._wait_any(min(t_end, t_slice) - now)
            out = self._rank0(probe, f"wait for {what}")
            if out.get("done"):
                return
            for f in out.get("init", []):
                self._send_init(int(f))

    def _wait_any(self, timeout):
        """Rank 0: block up to `timeout` for the next message from the syncer (bases, INIT requests)."""
        c = self.client
        cv = getattr(c, "_cv", None)   # the client notifies it on every message; fall back to a short nap
        if cv is not None:
            with cv:
                cv.wait(min(timeout, 0.5))
        else:
            time.sleep(min(timeout, 0.05))
        # (a lost link, or a refusal, surfaces from the next _poll, which knows how to handle it)

    def _send_init(self, f):
        """Every rank: read fragment f's FP32 masters; rank 0 streams them to the syncer as INIT."""
        idx = self.layout[f]
        if self.rank != 0:
            self.view.read(idx, None)
            return
        bridge = _StreamBridge(lambda it: self.client.send_init(f, it), self.settings.timeout,
                               f"INIT of fragment {f}")
        try:
            self.view.read(idx, lambda e, off, arr: bridge.put(arr))
        except BaseException:
            bridge.abort()
            raise
        bridge.close()
        self.init_sent.append(f)
        log.info("yeto-patch: sent INIT of fragment %d (%.1f M values)", f, self.frag_numel[f] / 1e6)

    def _start_digests(self):
        """Every rank: one read of the model; rank 0 gets the xxh3_64 digest of each tensor's float32 values (the
        syncer skips sending initial bases this island already holds)."""
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

    def _install_plan(self, f):
        """Rank 0: [fragment, version, number of base updates, held] for installing the base rank 0 holds for f
        (held: the base is the weights this island already holds, plus the updates)."""
        b = self.arrived[f]
        if not b.relative:
            return [f, b.version, 0, False]
        if b.held:
            return [f, b.version, len(b.deltas), True]
        if b.start != self.anchor_version[f]:
            raise EngineError(f"yeto-patch: fragment {f}: the syncer's base update applies to v{b.start}, but this "
                              f"island's anchor is v{self.anchor_version[f]}")
        return [f, b.version, len(b.deltas), False]

    def _install(self, f, version, mode, why, answered=None, updates=0, held=False):
        """Every rank: install the base of fragment f held by rank 0 (version `version`). With `updates` > 0
        rank 0 holds that many quantized changes of the anchor (--base-wire int8/int4), not the base: each
        owner adds them to its anchor, the first ones to the anchor only, the last one as the install."""
        s = self.settings
        t0 = time.perf_counter()
        idx = self.layout[f]
        base = None
        sources = [None] * max(1, updates)
        if self.rank == 0:
            base = self.arrived.pop(f)
            if base.version != version or (len(base.deltas) if base.relative else 0) != updates \
                    or base.held != held:
                raise EngineError(f"internal: fragment {f} base v{base.version} is not the planned v{version}")
            offs = self.frag_offsets[f]
            if base.relative:
                def update(i):
                    return lambda e, off, n: base.delta_range(i, offs[e] + off, n)
                sources = [update(i) for i in range(updates)]
            else:
                values = base.values

                def full(e, off, n):
                    a = offs[e] + off
                    return values[a:a + n]
                sources = [full]
        if held:   # the island's weights are the base (digests matched): they become the anchor
            self.view.snapshot_anchor(idx)
            sources = sources if updates else []
        rel = {"relative": True} if updates else {}
        for src in sources[:-1]:   # intermediate updates: anchors only (alpha 1 keeps every master as it is)
            self.view.write(idx, src, mode="blend", alpha=1.0, set_anchor=True, anchor="value", **rel)
        if sources:
            if mode == "replace":
                self.view.write(idx, sources[-1], mode="replace", set_anchor=True, **rel)
            else:   # blend: masters := alpha * local + (1 - alpha) * base, anchor := base (the next push's base);
                # keep (a restart where the syncer is still at this anchor): alpha 1, local masters stay
                alpha = 1.0 if mode == "keep" else s.merge_alpha
                self.view.write(idx, sources[-1], mode="blend", alpha=alpha, set_anchor=True, anchor="value", **rel)
        self.anchor_version[f] = int(version)
        self._adopt.discard(f)
        self.steps_since[f] = 0
        self.tokens_since[f] = 0
        if self.rank == 0:
            ms = (time.perf_counter() - t0) * 1000
            rec = self.pending.pop(f, None) if answered is None else answered
            if rec is not None:
                rec.update(version=int(version), installed=True, mode=mode, install_ms=round(ms, 2),
                           pull_lag=self.step - rec["step"], updates=updates)
                rec["send_ms"] = rec.pop("_send", {}).get("ms")
                rec.pop("_body", None)
                self.log.write("boundary", **rec)
                log.info("yeto-patch: step %d: installed fragment %d v%d (%s, pushed at step %d, lag %d steps, "
                         "waited %.0f ms)", self.step, f, version, mode, rec["step"], rec["pull_lag"],
                         rec.get("wait_ms", 0.0))
            elif why != "start":
                self.log.write("install", step=self.step, fragment=f, version=int(version), mode=mode,
                               install_ms=round(ms, 2), reason=why, updates=updates)
        elif f in self.pending:
            self.pending.pop(f)

    def _push(self, f, final=False):
        """Every rank: stream fragment f's delta to rank 0, which encodes it and queues the push."""
        s = self.settings
        idx = self.layout[f]
        if self.rank != 0:
            self.view.read_delta(idx, None)
            self.pending[f] = {"step": self.step}
            return
        from yeto_patch.island.push_encoder import PushEncoder
        residual = None
        if s.error_feedback:
            residual = self.residual.get(f)
            if residual is None:
                residual = self.residual[f] = np.zeros(self.frag_numel[f], dtype=np.float32)
        enc = PushEncoder(s.push_dtype, s.block, self.frag_numel[f], piece_elems=max(s.chunk_bytes // 4, s.block),
                          residual=residual, what=f"fragment {f} delta",
                          entry_starts=self.frag_starts[f],
                          entry_names=[self.manifest.entries[e].name for e in idx])
        t0 = time.perf_counter()
        self.view.read_delta(idx, lambda e, off, arr: enc.feed(arr))
        body = enc.finish()
        gather_ms = (time.perf_counter() - t0 - enc.encode_s) * 1000
        base_version, step = self.anchor_version[f], self.step
        steps, tokens = self.steps_since[f], self.tokens_since[f]
        # the encoded body stays until the push is answered: after a reconnect it is sent again
        rec = self.pending[f] = {"step": step, "fragment": f, "base_version": base_version,
                                 "bytes": int(body.nbytes), "codec": s.push_dtype, "steps": steps, "tokens": tokens,
                                 "gather_ms": round(gather_ms, 2), "encode_ms": round(enc.encode_s * 1000, 2),
                                 "wait_ms": 0.0, "installed": False, "final": final, "_send": {}, "_body": body}
        self._send_push(f, rec)
        log.debug("yeto-patch: step %d: pushed fragment %d (base v%d, %d bytes %s, gather %.0f ms, encode %.0f ms)",
                  step, f, base_version, body.nbytes, s.push_dtype, gather_ms, enc.encode_s * 1000)

    def _send_push(self, f, rec):
        """Rank 0: queue the push recorded in `rec` on the background sender (a lost link: reconnect, which
        sends it again)."""
        from yeto_patch.wire.client import SyncerRefusal, recoverable
        s = self.settings
        client, body, timing = self.client, rec["_body"], rec["_send"]

        def send():
            t = time.perf_counter()
            while True:
                try:
                    client.push(f, base_version=rec["base_version"], local_step=rec["step"], steps=rec["steps"],
                                tokens=rec["tokens"], codec=rec["codec"], block=s.block, body=body,
                                final=rec["final"])
                    break
                except SyncerRefusal as e:   # an earlier push's refusal, raised before this one went out:
                    self._refusals.append(e)  # the training thread handles it (_poll); send this push still
            timing["ms"] = round((time.perf_counter() - t) * 1000, 2)
        try:
            self.sender.submit(send, int(body.nbytes), timeout=s.timeout)
        except Exception as e:  # noqa: BLE001
            if not recoverable(e):
                raise
            self._reconnect(e)   # sends every unanswered push again, this one included

    # ================================================================================ per step
    def _boundary(self):
        s = self.settings
        tau = s.overlap_steps
        mode = "blend" if tau > 0 else "replace"
        # Every rank knows the schedule and what is pending: on a step where no fragment is due, no push awaits
        # its base and it is not the last step, there is nothing to decide and the island skips the plan (no
        # collective on most steps). A base that arrives unasked (merged by a quorum without this island) is
        # installed at the next step that has a plan: the next boundary at the latest.
        if not self.pending and self.step < self.total and not self._due():
            return

        def decide():
            self._poll()
            by_syncer = self.client.final_cut
            final = self.step >= self.total or by_syncer
            due = [] if final else self._due()
            skip = [f for f in due if self._skip.get(f)]   # merged before this island's restart: done
            due = [f for f in due if f not in skip]
            # a fragment due now (or at the final cut) pushes its local progress first, relative to its anchor
            # (late, so carried or refused as stale by the syncer), and takes a newer base as the answer:
            # installing that base before the push would throw the progress away. (A syncer that is behind this
            # island lacks the anchor's version: its base is installed first.)
            pushing = set(range(self.P)) if final else set(due)
            installs = [] if by_syncer else [self._install_plan(f) for f, b in sorted(self.arrived.items())
                                             if f in self._adopt or (b.version > self.anchor_version[f]
                                                                     and f not in pushing)]
            return {"install": installs, "push": due, "skip": skip, "final": final, "by_syncer": by_syncer}
        plan = self._rank0(decide, f"plan step {self.step}")
        for f in plan["skip"]:
            self._skip_boundary(int(f))
        for f, v, k, held in plan["install"]:
            self._install(int(f), int(v), mode, why="arrived", updates=int(k), held=bool(held))
        if plan["final"]:
            self._final_cut(by_syncer=plan["by_syncer"])
            return
        for f in plan["push"]:
            f = int(f)
            if f in self.pending:   # its previous base never came within H steps (tau < H guarantees time)
                self._await_answers([f], "the base answering fragment %d's previous push" % f)
            self._push(f)
        overdue = [f for f, p in sorted(self.pending.items()) if self.step - p["step"] >= tau]
        if overdue:
            self._await_answers(overdue, None)

    def _skip_boundary(self, f):
        """Every rank: fragment f's round at this boundary was merged with this island's push before it
        restarted (the steps since were trained again): pushing again would count that progress twice."""
        self._skip[f] -= 1
        if self.rank == 0:
            log.info("yeto-patch: step %d: fragment %d's round at this boundary was merged before the restart "
                     "(with this island's push of then); not pushing it again", self.step, f)

    def _due(self):
        from yeto_patch.island.schedule import due_fragments
        return due_fragments(self.step, self.settings.sync_every, self.P)

    def _await_answers(self, frags, what):
        """Every rank: wait until rank 0 holds a base newer than each pending push's base, then install it."""
        s = self.settings
        mode = "blend" if s.overlap_steps > 0 else "replace"
        need = {f: (self.pending[f]["step"] if f in self.pending else self.step) for f in frags}
        if self.rank == 0:
            want = {f: self.pending[f]["base_version"] for f in frags}
            desc = what or ", ".join(f"the base of fragment {f} newer than v{want[f]} (pushed at step {need[f]})"
                                     for f in frags) + f" [tau={s.overlap_steps}]"
        else:
            want, desc = {}, what or "bases"
        t0 = time.perf_counter()

        def ready():
            self._poll()
            return all(f in self.arrived and (self.arrived[f].version > want[f] or f in self._adopt) for f in frags)
        self._await(ready, desc)
        waited = (time.perf_counter() - t0) * 1000
        v = self._rank0(lambda: {str(f): self._install_plan(f)[1:] for f in frags}, "answered versions")
        for f in frags:
            if self.rank == 0 and f in self.pending:
                self.pending[f]["wait_ms"] = round(waited, 2)
            self._install(f, int(v[str(f)][0]), mode, why="answer", updates=int(v[str(f)][1]),
                          held=bool(v[str(f)][2]))

    # ================================================================================ final cut
    def _final_cut(self, by_syncer=False):
        s = self.settings
        t0 = time.perf_counter()
        if by_syncer:
            if self.rank == 0:
                log.warning("yeto-patch: step %d: the syncer ended the run (its final cut) before this island's "
                            "last step %d; installing its final model and stopping here", self.step, self.total)
        else:
            if self.pending:
                self._await_answers(sorted(self.pending), None)
            for f in range(self.P):
                if self._skip.get(f):   # its final round was merged with this island's push before a restart
                    self._skip_boundary(f)
                else:
                    self._push(f, final=True)
            if self.rank == 0:
                log.info("yeto-patch: step %d: final cut: pushed the final deltas of %d fragments; waiting for "
                         "the final model", self.step, self.P)
        from yeto_patch.wire.client import recoverable
        from yeto_patch.wire.frames import WireTimeout
        got = {}
        t_end = time.monotonic() + s.timeout
        while True:
            def finish():
                now = time.monotonic()
                if now >= t_end:
                    raise EngineError(f"yeto-patch: timed out after {s.timeout:.0f}s (YETO_DILOCO_TIMEOUT) waiting "
                                      f"for the final model from the syncer at {s.syncer}")
                sl = min(self._slice(), t_end - now)
                try:
                    if self.sender is not None and not by_syncer:
                        self.sender.drain(sl)
                    got.update(self.client.finish(last_step=self.step, timeout=max(0.1, sl)))
                except Exception as e:  # noqa: BLE001
                    if isinstance(e, WireTimeout) and not self.client.conn_lost():
                        return None
                    if not recoverable(e):
                        raise
                    self._reconnect(e)   # final pushes the syncer lacks are sent again; FINAL again
                    return None
                self.arrived = dict(got)
                return {str(f): got[f].version for f in range(self.P)}
            versions = self._rank0(finish, "the final model")
            if versions is not None:
                break
        finals = {}
        if self.rank == 0:
            finals = dict(self.pending)
        for f in range(self.P):
            rec = finals.get(f)
            if rec is not None:
                self.pending.pop(f, None)
            self._install(f, int(versions[str(f)]), "replace", why="final", answered=rec)
        self.finished = True
        if self.rank == 0:
            secs = time.perf_counter() - t0
            self.log.write("final", step=self.step, versions=[int(versions[str(f)]) for f in range(self.P)],
                           seconds=round(secs, 3))
            log.info("yeto-patch: step %d: installed the syncer's final model (versions %s) in %.1fs; training "
                     "ends here", self.step, [int(versions[str(f)]) for f in range(self.P)], secs)
        self.close()


class _StreamBridge:
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


def _describe(e: BaseException, what: str) -> str:
    text = str(e) or type(e).__name__
    name = type(e).__name__
    if name in ("SyncerRefusal",):
        code = getattr(e, "code", "refused")
        hint = " (the island's base is too old: it must pull the current base)" if code == "stale" else ""
        return f"yeto-patch: the syncer refused a push ({code}): {text}{hint}"
    if name in ("AuthError",):
        return f"yeto-patch: authentication with the syncer failed: {text} (check YETO_DILOCO_KEY_FILE / YETO_KEY)"
    if name in ("PeerError",):
        return f"yeto-patch: the syncer reported an error while trying to {what}: {text}"
    if name in ("ConnectError",):
        return f"yeto-patch: cannot {what}: {text} (is the syncer running? check YETO_DILOCO_SYNCER)"
    if text.startswith("yeto-patch"):
        return text
    return f"yeto-patch: failed to {what}: {name}: {text}"
