"""The boundary engine: turns an island's optimizer steps into DiLoCo / Streaming DiLoCo rounds with the syncer.

The shim's hooks drive it (``yeto_patch.hooks``, through the ``api.IslandEngine`` contract); nothing here names
Megatron's training loop. One ``Engine`` per process, on every rank of the island; island rank 0 talks to the
syncer, and every decision is rank 0's, sent to the other ranks as JSON, so every rank runs the same collectives
in the same order (boundary/driver.py says why and how).

Life of an island:
- Start (first ``train_step`` before its forward, or else the first optimizer step before its update): the
  ranks build the global manifest and the master view; rank 0 connects, authenticates and says hello with the
  manifest; every rank learns the syncer's fragment layout; fragments the syncer asks for are sent as INIT
  (read from the FP32 masters, streamed); then the base of every fragment is installed (masters and model
  parameters) and becomes that fragment's anchor, before the first update.
- Every optimizer step calls ``on_optimizer_step`` once (a skipped update counts as a step with zero tokens).
  Fragment f reaches a boundary every H steps, the fragments spread evenly over H (boundary/schedule.py). Each
  fragment's boundary, from snapshot to installed base, is a state machine of its own (boundary/fragment.py),
  driven by rank 0's plans (boundary/plan.py) through ONE push route (a snapshot of each rank's own shard, the
  gather and encoding beside training: boundary/push_lane.py) and ONE install route during training (the base
  staged beside training, then installed into each rank's own masters inside the optimizer step just before
  Megatron casts them: boundary/base_lane.py, boundary/installs.py). With tau > 0 a base answering a push is
  installed exactly at the push's step + tau, blended ``alpha * local + (1 - alpha) * base``; at tau = 0 it
  replaces the masters at the push's own step. If the base is not there at that step, the island waits for it:
  while the syncer is alive as long as its round waits (a line a minute saying whom it waits for), failing only
  once the syncer has been unreachable for YETO_DILOCO_TIMEOUT (link/patience.py). With
  YETO_DILOCO_SYNC_EVERY=auto rank 0's plans retune H to the fleet's pace and bring a late fragment's next
  boundary forward (boundary/schedule.py ``Cadence``, kept by boundary/driver.py on every rank).
- Final cut, at the last step: pending bases are awaited and installed, every fragment's final delta is
  pushed, the syncer's final model is awaited and installed exactly (replace), and ``finished`` turns True.
  The train_step hook then makes Megatron save and stop. A custom loop that has only the optimizer hook asks
  ``yeto_patch.island.engine.finished()`` after each step and stops when it is True; a step after the final
  cut raises.

Failures of the link or the syncer: a lost connection (or one silent for a lease) is replaced by rank 0 in the
background while the island trains on (link/syncer.py: same incarnation, bounded back-off, every unanswered push
sent again, bases merged meanwhile taken) for up to YETO_DILOCO_TIMEOUT. A syncer that already made its final cut
(an island back after the end) gives the island its final model at its first step. A restarted island restores
the sync state saved beside the Megatron checkpoint it loaded (boundary/sync_state.py; ``save_sync_state`` /
``set_resume``, called by the checkpoint hooks).

Errors: anything else that goes wrong on rank 0 (a refused push, a syncer gone for longer than the timeout, a bad
key) is raised on every rank with rank 0's message; errors inside collectives are agreed island-wide by
``IslandComm``. After a failure the engine stays failed and every later step raises the same error.
"""
from __future__ import annotations

import atexit
import logging
import time
from dataclasses import asdict
from typing import Optional

from yeto_patch.island.errors import EngineError  # public here: raised on every rank

log = logging.getLogger("yeto_patch")

_current: Optional["Engine"] = None


def finished() -> bool:
    """True once this process's island installed the syncer's final model (for custom training loops)."""
    return _current is not None and _current.finished


def current() -> Optional["Engine"]:
    return _current


class Engine:
    """See the module docstring; implements ``yeto_patch.island.api.IslandEngine``."""
    __slots__ = ("settings", "optimizer", "model", "started", "finished", "failed", "step", "total", "train_iters",
                 "vocab_size", "rank", "parts", "boundaries", "installer", "init_sent", "_resume", "_warned_tokens",
                 "pretrained", "_weights_loaded", "__weakref__")

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
        self.rank = 0
        self.parts = None             # boundary.parts.IslandParts, once started
        self.boundaries = None        # boundary.driver.Boundaries
        self.installer = None         # boundary.installs.Installer
        self.init_sent: list = []     # rank 0: fragments this island sent INIT of (in the WELCOME or later)
        self._resume: Optional[tuple] = None   # (directory, iteration) of the Megatron checkpoint loaded
        self._weights_loaded = False  # the launcher loaded the model's weights from a checkpoint before training
        self.pretrained = False       # the run started from pretrained weights (decided at the start: _started_from)
        self._warned_tokens = False
        _current = self

    @property
    def boundary_log(self):
        """Island rank 0's boundary log once started (None on the other ranks and before the start)."""
        return None if self.parts is None else self.parts.log

    def set_resume(self, directory, iteration, weights=False):
        """Megatron loaded the checkpoint of `iteration` from `directory` (before the first step): the island's
        sync state saved beside it is restored at start, and (not started yet) the step count continues from
        `iteration`: a loop with only the optimizer hooks (no train_step telling the iteration) keeps its boundaries
        and its final cut where they were. `weights`: the model's weights came from that checkpoint (a resume's
        always do); without a sync state of this run beside it, the run starts from pretrained weights."""
        self._resume = (directory, int(iteration)) if directory and iteration else None
        self._weights_loaded = bool(weights) or self._resume is not None
        if self._resume is not None and not self.started:
            self.step = self._resume[1]

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
        # the update changes the masters: the last boundary's snapshots first
        self._guarded(lambda: self.parts.pushes.wait_snapshots(f"step {self.step + 1}"))
        self._guarded(self.boundaries.plan_ahead)

    def before_param_copy(self, optimizer):
        """Inside a counted optimizer step, before the leaf `optimizer` casts its FP32 masters into the model
        params: the bases armed for this step go into its masters (never raises here: a failure is raised on
        every rank after the step)."""
        if self.failed is None and self.installer is not None:
            self.installer.into_leaf(optimizer)

    def on_optimizer_step(self, update_successful=True, tokens=None):
        self._alive()
        if tokens is None and update_successful and not self._warned_tokens:
            self._warned_tokens = True
            if self.rank == 0:
                log.warning("yeto-patch: tokens per step are unknown here (no train_step hook): pushes report 0 "
                            "tokens; weight islands by 'equal' or 'steps' on the syncer")
        self.step += 1
        self.parts.frags.count_step(0 if not update_successful else int(tokens or 0))
        if self.parts.link is not None:   # (rank 0, no collective) heartbeats carry the step and the compute rate
            self.parts.link.stepped(self.step)
        self._guarded(self._after_step)
        cadence = self.boundaries.cadence
        cadence.passed(self.step)   # (every rank: the fragments due at this step move on by H)
        if self.parts.link is not None:   # (rank 0) its heartbeats say when its next pushes are due; the next
            self.parts.link.scheduled(cadence.h, cadence.next)   # step's time (its compute) counts from here
            self.parts.link.resumed()

    def close(self):
        """Stop talking to the syncer (BYE); idempotent. Called at exit and by tests."""
        p = self.parts
        if p is None:
            return
        for lane in (p.pushes, p.bases):
            lane.close()
        if p.link is not None:
            p.link.close(graceful=self.failed is None)
        if p.log is not None:
            p.log.close()

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
                if self.parts is not None and self.parts.link is not None:
                    self.parts.link.shutdown_quietly()
            raise

    # ================================================================================ start
    def _start(self):
        from yeto_patch.island.boundary.plan import final_step
        from yeto_patch.island.startup import join
        t0 = time.time()
        self.total = final_step(self.settings.total_steps, self.train_iters, self.step)
        from yeto_patch.island.boundary.sync_state import saved_runs
        runs = saved_runs(*self._resume) if self._resume is not None else None   # (used by rank 0)
        joined = join(self.settings, self.model, self.optimizer, self.vocab_size, lambda: self.step, self.total,
                      runs=runs)
        self.settings, self.parts, self.rank = joined.settings, joined.parts, joined.parts.rank
        self.installer, self.boundaries = joined.installer, joined.boundaries
        state, arrays = self._read_sync_state()
        self._started_from(state)
        for f in joined.needs_init:
            self._send_init(int(f))
        self.parts.await_ready(self._have_all_bases, "the initial base of every fragment", serve_init=self._send_init)
        specs = self._initial_specs()
        keep = set()
        if state is not None:   # a restart: fragments whose anchor is still the syncer's base keep local progress
            keep = {frag.index for frag in self.parts.frags
                    if state["anchor_version"][frag.index] == specs[frag.index].version}
        for spec in specs:
            resumed = spec.fragment in keep
            self.installer.now(spec, "keep" if resumed else "replace", why="resume" if resumed else "start")
        if state is not None:
            self._restore(state, arrays, keep, {spec.fragment: spec.version for spec in specs}, joined.fixed_roster)
        self.started = True
        if self.rank == 0:
            self.parts.link.resilient = True
            self._log_start(specs, time.time() - t0)
            atexit.register(self.close)

    def _started_from(self, state) -> None:
        """Every rank: whether the run started from pretrained weights (every push says it; the syncer's outer lr
        auto takes its fine-tune value). A restart keeps what its sync state saved; otherwise weights loaded from a
        checkpoint before training (a fine-tune's --load --finetune, ms-swift's model, a run continued from a
        Megatron checkpoint saved without yeto-patch) are a pretrained start."""
        self.pretrained = bool(state.get("pretrained")) if state is not None else self._weights_loaded
        if self.rank == 0:
            self.parts.link.started_from(self.pretrained)

    def _initial_specs(self) -> list:
        """Every rank: rank 0's specs of the initial bases it holds, one per fragment."""
        from yeto_patch.island.boundary.plan import BaseSpec, base_spec
        got = self.parts.channel.rank0(lambda: [asdict(base_spec(frag)) for frag in self.parts.frags],
                                       "initial versions")
        return [BaseSpec.from_json(d) for d in got]

    def _log_start(self, specs, secs):
        s, p = self.settings, self.parts
        log.info("yeto-patch: island %s joined the syncer at %s: %d tensors (%.1f M values) in %d fragments, "
                 "H=%d, push %s%s, tau=%d, final cut at step %d%s; start took %.1fs", s.island_id, s.syncer,
                 len(p.view.manifest), p.view.manifest.total_numel() / 1e6, len(p.frags), s.sync_every,
                 s.push_dtype, " + error feedback" if s.error_feedback else "", s.overlap_steps, self.total,
                 ", from pretrained weights" if self.pretrained else "", secs)
        p.log.write("start", step=self.step, fragments=len(p.frags), versions=p.frags.anchors(),
                    init=sorted(set(self.init_sent)), seconds=round(secs, 3), pretrained=self.pretrained,
                    held=[spec.fragment for spec in specs if spec.own_weights])

    def _have_all_bases(self):
        self.parts.frags.receive(self.parts.link.poll())
        return all(frag.side.arrived is not None for frag in self.parts.frags)

    def _send_init(self, f):
        """Every rank: read fragment f's FP32 masters; rank 0 streams them to the syncer as INIT."""
        p = self.parts
        p.io.send_init(p.frags[f], (lambda it: p.link.send_init(f, it)) if p.rank == 0 else None)
        self.init_sent.append(f)

    # ================================================================================ restart
    def save_sync_state(self, directory, iteration):
        """Every rank, after Megatron saved `iteration` into `directory`: rank 0 writes the island's sync state
        beside it (boundary/sync_state.py); a failure is raised on every rank."""
        if not self.started or self.failed is not None or self.finished or not directory:
            return
        from yeto_patch.island.boundary import sync_state
        what = f"save the island's sync state for iteration {iteration}"
        self._guarded(lambda: self.boundaries.drain(what))

        def write():
            return sync_state.save(directory, int(iteration), self.settings, self.step,
                                   self.parts.view.manifest.digest(), self.parts.frags,
                                   run_ids=self.parts.link.run_ids, pretrained=self.pretrained)
        self._guarded(lambda: self.parts.channel.rank0(write, what))

    def _read_sync_state(self):
        """Every rank: the sync state saved with the Megatron checkpoint this process loaded, checked against
        this run (rank 0 reads it and sends the meta; the arrays stay on rank 0). (None, {}) when there is none
        or it does not fit, with a warning saying why."""
        if self._resume is None:
            return None, {}
        directory, iteration = self._resume
        from yeto_patch.island.boundary import sync_state
        arrays = {}

        def read():
            return sync_state.load(sync_state.state_path(directory, iteration), iteration, arrays, self.settings,
                                   manifest_digest=self.parts.view.manifest.digest(),
                                   layout=self.parts.frags.layout)
        state = self.parts.channel.rank0(read, f"read the island's sync state of iteration {iteration}")
        return state, arrays

    def _restore(self, state, arrays, keep, versions, fixed_roster):
        from yeto_patch.island.boundary import sync_state
        for frag in sync_state.restore(state, arrays, self.parts.frags, versions, keep, self.rank,
                                       self.settings.error_feedback, fixed_roster):
            self.parts.link.send_push(frag.outgoing(self.parts.rule.blend, again=True))

    # ================================================================================ per step
    def _after_step(self):
        planned = self.boundaries.take_plan()
        if planned is None:
            return   # most steps: nothing can happen, no collective
        if planned.plan.final:
            self._final_cut(by_syncer=planned.plan.by_syncer)
            return
        self.boundaries.after_step(planned)

    # ================================================================================ final cut
    def _final_cut(self, by_syncer=False):
        from yeto_patch.island.boundary.plan import BaseSpec
        t0 = time.perf_counter()
        p, b = self.parts, self.boundaries
        self.installer.finish()   # (bases armed for this step went in inside it)
        b.drain("the final cut")
        if by_syncer:
            if self.rank == 0:
                log.warning("yeto-patch: step %d: the syncer ended the run (its final cut) before this island's "
                            "last step %d; installing its final model and stopping here", self.step, self.total)
        else:
            pushing = [frag.index for frag in p.frags.pushing()]
            if pushing:
                b.await_answers(pushing, None)
            for frag in p.frags:
                if frag.skip:   # its final round was merged with this island's push before a restart
                    b.skip(frag.index)
                else:
                    b.push(frag.index, final=True)
            b.drain("the final pushes")
            if self.rank == 0:
                log.info("yeto-patch: step %d: final cut: pushed the final deltas of %d fragments; waiting for "
                         "the final model", self.step, len(p.frags))
        self.installer.drop_staged("the final cut")
        versions = self._final_versions(by_syncer)
        for frag in p.frags:   # (the syncer sends the final model whole: absolute bases)
            self.installer.now(BaseSpec(frag.index, versions[frag.index]), "replace", why="final")
        self.finished = True
        if self.rank == 0:
            secs = time.perf_counter() - t0
            p.log.write("final", step=self.step, versions=versions, seconds=round(secs, 3))
            log.info("yeto-patch: step %d: installed the syncer's final model (versions %s) in %.1fs; training "
                     "ends here", self.step, versions, secs)
        self.close()

    def _final_versions(self, by_syncer) -> list:
        """Every rank: rank 0 waits (a slice at a time) for the syncer's final model and holds it as the arrived
        bases; returns the version of each fragment."""
        p = self.parts
        got = {}
        t_end = time.monotonic() + self.settings.timeout

        def finish():
            out = p.link.final_model(self.step, t_end, p.slice_s(), drain=not by_syncer)
            if out is None:
                return None
            got.update(out)
            for frag in p.frags:
                frag.final_base(got.get(frag.index))
            return [got[f].version for f in range(len(p.frags))]
        while True:
            versions = p.channel.rank0(finish, "the final model")
            if versions is not None:
                return [int(v) for v in versions]

