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
  background sender: training goes on without waiting for the network. With tau >= 1 the training thread only
  queues the push: each rank's own shard of the FP32 masters is copied beside training (done before the next
  update, which waits for it), then the delta, its gather and the encoding run beside the next steps on a gloo
  group of their own (``push_pipeline.py``), and rank 0 hands the finished push to the sender at a later step.
- Rank 0 decides and broadcasts a plan before the optimizer step's update (``before_optimizer_step``), only on
  steps where something can happen (a fragment is due, a push awaits its base, or it is the last step), so most
  steps cost no collective at all; the pushes and waits it plans run after the update. A merged base arriving
  in the background is staged at the first plan after it arrived: every rank's worker takes part in sending it
  to the ranks with a FP32 master of it, beside training (``base_stager.py``); a later plan arms it and, inside
  that step, after the leaf optimizer's update and just before Megatron casts its masters into the model
  params (and gathers them to the replicas), each rank installs it into its own masters in one pass
  (``before_param_copy``): ``alpha * local + (1 - alpha) * base`` when tau > 0, the base itself when tau = 0;
  the base becomes the fragment's anchor (``engine_installs.py``). A base nobody on this island asked for
  (merged by a quorum without it) waits for the next such step. If tau steps pass after a push without its
  base, the island waits for it (bounded by YETO_DILOCO_TIMEOUT, with a log line saying what it waits for)
  and installs it after the step, params and replicas included.
- Final cut, at the last step: pending bases are awaited and installed, every fragment's final delta is
  pushed, the syncer's final model is awaited and installed exactly (replace), and ``finished`` turns True.
  The train_step hook then makes Megatron save and stop. A custom loop that has only the optimizer hook asks
  ``yeto_patch.island.engine.finished()`` after each step and stops when it is True; a step after the final
  cut raises.

Failures of the link or the syncer: a lost connection (or one silent for a lease) is replaced by rank 0
(``SyncerLink.reconnect``: same incarnation, bounded back-off, unanswered pushes sent again, bases merged
meanwhile taken) for up to YETO_DILOCO_TIMEOUT. A restarted island restores the sync state saved beside the
Megatron checkpoint it loaded (``sync_state.py``; ``save_sync_state`` / ``set_resume``, called by the checkpoint hooks).

Parts: ``fragments.py`` (one state per fragment), ``plan.py`` (what happens at a step, pure), ``link.py`` (rank 0's
link to the syncer: connect and reconnect with one back-off policy, refusals, arrived bases), ``channel.py`` (rank
0's decisions broadcast to the island), ``data_path.py`` (masters <-> encoded pushes and installed bases) and
``sync_state.py`` (restart state), ``push_pipeline.py`` (pushes off the training thread), ``base_stager.py`` (bases
staged off it) and ``engine_installs.py`` (the installs). This module coordinates them.

Errors: anything else that goes wrong on rank 0 (a refused push, a syncer gone for longer than the timeout, a bad
key) is raised on every rank with rank 0's message; errors inside collectives are agreed island-wide by
``IslandComm``. After a failure the engine stays failed and every later step raises the same error.
"""
from __future__ import annotations

import atexit
import logging
import time
from typing import Optional

from yeto_patch.island.boundary.installs import Installs
from yeto_patch.island.errors import EngineError  # public here: raised on every rank

log = logging.getLogger("yeto_patch")

_current: Optional["Engine"] = None


def finished() -> bool:
    """True once this process's island installed the syncer's final model (for custom training loops)."""
    return _current is not None and _current.finished


def current() -> Optional["Engine"]:
    return _current


class Engine(Installs):
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
        self.comm = self.channel = self.manifest = self.view = self.data = None
        self.frags = None             # island.fragments.Fragments, once the syncer's layout is known
        self.cadence = None           # island/boundary/schedule.Cadence: when each fragment is due
        self.link = None              # rank 0: island.shard_link.ShardedLink (one SyncerLink per shard)
        self.pipeline = None          # tau >= 1: island.push_pipeline.PushPipeline (pushes off the training thread)
        self.stager = None            # island.base_stager.BaseStager (merged bases staged off the training thread)
        self.log = None               # rank 0: the boundary log
        self._warned_tokens = False
        self._resume: Optional[tuple] = None   # (directory, iteration) of the Megatron checkpoint loaded
        self.init_sent: list = []     # rank 0: fragments this island sent INIT of (in the WELCOME or later)
        self._ahead = None            # (step, Plan, plan seconds): the plan made before that step's update
        self._armed: dict = {}        # fragment -> its staged base taken for installing in this step
        self._copy_error = None       # a failure at an install point inside the step (raised after it)
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
        if self.pipeline is not None:   # the update changes the masters: last boundary's snapshots first
            self._guarded(lambda: self.pipeline.wait_snapshots(f"step {self.step + 1}"))
        self._guarded(self._plan_ahead)

    def on_optimizer_step(self, update_successful=True, tokens=None):
        self._alive()
        if tokens is None and update_successful and not self._warned_tokens:
            self._warned_tokens = True
            if self.rank == 0:
                log.warning("yeto-patch: tokens per step are unknown here (no train_step hook): pushes report 0 "
                            "tokens; weight islands by 'equal' or 'steps' on the syncer")
        self.step += 1
        self.frags.count_step(0 if not update_successful else int(tokens or 0))
        if self.link is not None:   # (rank 0) heartbeats carry the step and the compute rate
            self.link.stepped(self.step)
        self._guarded(self._boundary)
        self.cadence.passed(self.step)   # (every rank: the fragments due at this step move on by H)

    def close(self):
        """Stop talking to the syncer (BYE); idempotent. Called at exit and by tests."""
        for lane in (self.pipeline, self.stager):
            if lane is not None:
                lane.close()
        if self.link is not None:
            self.link.close(graceful=self.failed is None)
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
                if self.link is not None:
                    self.link.shutdown_quietly()
            raise

    # ================================================================================ start
    def _start(self):
        from yeto_patch.island import auto_settings
        from yeto_patch.island.boundary.channel import IslandChannel
        from yeto_patch.island.masters.collective import IslandComm
        from yeto_patch.island.boundary.data_path import DataPath, model_chunks
        from yeto_patch.island.masters.view import MasterView
        from yeto_patch.island.masters.names import VOCAB_NAMES, build_manifest, vocab_rows_message
        from yeto_patch.island.boundary.plan import final_step
        s = self.settings
        t0 = time.time()
        chunks = model_chunks(self.model, self.optimizer)
        self.comm = IslandComm(timeout_s=s.timeout + 60.0)
        self.rank = self.comm.rank
        self.channel = IslandChannel(self.comm)
        self.total = final_step(s.total_steps, self.train_iters, self.step)
        if self.rank == 0:
            from yeto_patch.island.boundary.log import BoundaryLog
            self.log = BoundaryLog(s.metrics_path, s.island_id)
        vocab_rows: dict = {}   # every padded row is merged unless the run's manifest has other vocabulary rows
        for _ in range(len(VOCAB_NAMES) + 1):
            self.manifest = build_manifest(chunks, real_vocab_size=self.vocab_size, vocab_rows=vocab_rows,
                                           merge_padding=True, comm=self.comm)
            s = self.settings = auto_settings.resolve(s, self.manifest.total_numel(), self.rank)
            self.view = MasterView(chunks, self.optimizer, self.manifest, chunk_bytes=s.chunk_bytes, comm=self.comm)
            self.data = DataPath(self.view, self.manifest, s, self.rank)
            declared = self.data.start_digests() if s.start_digest else None
            welcome = self.channel.rank0(lambda: self._connect(declared), f"connect to the syncer at {s.syncer}")
            if "vocab_rows" not in welcome:
                break
            for name, rows in welcome["vocab_rows"].items():   # said on every rank
                log.warning("yeto-patch: %s", vocab_rows_message(self.manifest, name, int(rows)))
                vocab_rows[name] = int(rows)
        else:
            raise EngineError(f"the syncer at {s.syncer} keeps refusing this island's vocabulary rows {vocab_rows}")
        self._adopt_layout(welcome)
        from yeto_patch.island.boundary.schedule import Cadence
        self.cadence = Cadence(s.sync_every, len(self.frags), self.step)   # (H may follow the fleet: auto)
        if welcome["final"] and self.rank == 0:   # (an island back after the end: it takes the final model)
            log.warning("yeto-patch: the syncer at %s has already made its final cut; this island installs the "
                        "final model at its first step and stops there", s.syncer)
        self.pipeline = self._push_pipeline()
        self.stager = self._base_stager()
        state, arrays = self._read_sync_state()
        for f in welcome["needs_init"]:
            self._send_init(int(f))
        self._await(self._have_all_bases, "the initial base of every fragment", init_ok=True)
        plans = self._install_specs(range(len(self.frags)), "initial versions")
        v = {f: p[0] for f, p in plans.items()}
        keep = set()
        if state is not None:   # a restart: fragments whose anchor is still the syncer's base keep local progress
            keep = {st.index for st in self.frags if state["anchor_version"][st.index] == int(v[str(st.index)])}
        for st in self.frags:
            f = st.index
            self._install(f, int(v[str(f)]), mode="keep" if f in keep else "replace",
                          why="resume" if f in keep else "start", updates=plans[str(f)][1], held=plans[str(f)][2])
        if state is not None:
            self._restore(state, arrays, keep, v, welcome["fixed_roster"])
        self.started = True
        if self.rank == 0:
            self.link.resilient = True
            self._log_start(welcome, plans, time.time() - t0)
            atexit.register(self.close)

    def _log_start(self, welcome, plans, secs):
        s, P = self.settings, len(self.frags)
        log.info("yeto-patch: island %s joined the syncer at %s: %d tensors (%.1f M values) in %d fragments, "
                 "H=%d, push %s%s, tau=%d, final cut at step %d; start took %.1fs", s.island_id, s.syncer,
                 len(self.manifest), self.manifest.total_numel() / 1e6, P, s.sync_every, s.push_dtype,
                 " + error feedback" if s.error_feedback else "", s.overlap_steps, self.total, secs)
        self.log.write("start", step=self.step, fragments=P, versions=self.frags.anchors(),
                       init=sorted(set(self.init_sent)), seconds=round(secs, 3),
                       held=[f for f in range(P) if plans[str(f)][2]])

    def _connect(self, declared):
        """Rank 0: the link to the syncer, connected (waiting for a syncer not up yet, see ``link.py``)."""
        from yeto_patch.island.masters.names import run_vocab_rows
        from yeto_patch.island.link.sharded import ShardedLink
        from yeto_patch.wire.frames import PeerError
        self.link = ShardedLink(self.settings, self.manifest.wire_manifest(), held=declared, step=lambda: self.step,
                                record=self.log.write)
        try:
            w = self.link.open()
        except PeerError as e:   # the run pads the vocabulary otherwise: connect again with its rows
            rows = run_vocab_rows(e.message, self.manifest.wire_manifest()) if e.code == "manifest" else None
            if rows is None:
                raise
            return {"vocab_rows": rows}
        return dict(layout=w.layout, numels=w.numels, fragments=w.fragments, versions=w.versions,
                    needs_init=list(w.needs_init), final=bool(w.final), fixed_roster=bool(w.fixed_roster))

    def _push_pipeline(self):
        """Every rank (collective: a gloo group of its own): with tau >= 1 pushes leave the training thread after a
        snapshot of the rank's own shard (island/boundary/push_lane.py); tau = 0 waits for the base anyway."""
        s = self.settings
        if s.overlap_steps < 1:
            return None
        from yeto_patch.island.masters.collective import IslandComm
        from yeto_patch.island.boundary.push_lane import PushPipeline
        pipeline = PushPipeline(self.view, IslandComm(timeout_s=s.timeout + 60.0), self.rank,
                                self.data.push_encoder if self.rank == 0 else None, s.timeout)
        pipeline.reserve(max(self.view.own_numel(st.entries) for st in self.frags))
        return pipeline

    def _base_stager(self):
        """Every rank (collective: a gloo group of its own and its holder groups): bases merged during training are
        staged in the background and installed locally (island/boundary/base_lane.py)."""
        from yeto_patch.island.boundary.base_lane import BaseStager
        from yeto_patch.island.masters.collective import IslandComm
        return BaseStager(self.view, IslandComm(timeout_s=self.settings.timeout + 60.0), self.rank,
                          self.settings.timeout)

    def _handover(self):
        """Rank 0: the pushes whose background stage ended go to the link, in boundary order."""
        if self.pipeline is None:
            return
        for job in self.pipeline.take_finished():
            st, (body, gather_s, encode_s) = job.state, job.done
            rec = st.start_push(job.step, body, self.settings.push_dtype, gather_s, encode_s, False,
                                made=(job.base_version, job.steps, job.tokens))
            rec.update(snapshot_ms=round(job.snapshot_s * 1000, 2), own_bytes=job.nbytes,
                       snapshot_wait_ms=round(job.snapshot_wait_s * 1000, 2),
                       push_cpu_ms=round((job.cpu_s or 0.0) * 1000, 2),
                       boundary_ms=round((job.boundary_s or 0.0) * 1000, 2),
                       queued_ms=round((job.t_start - job.t_submit) * 1000, 2), handed_at=self.step)
            self.link.send_push(st)

    def _drain_pushes(self, what):
        """Every rank: wait for the pushes still in the background; rank 0 hands them to the link."""
        if self.pipeline is None:
            return
        if self.rank != 0:
            self.pipeline.wait_all(what)
            self.pipeline.take_finished()

        def drain():
            self.pipeline.wait_all(what)
            self._handover()
        self.channel.rank0(drain, what)

    def _adopt_layout(self, w):
        from yeto_patch.island.boundary.fragments import Fragments
        self.frags = Fragments(w["layout"], w["numels"], [e.numel for e in self.manifest.entries],
                               announced=w["fragments"])
        if self.link is not None:
            self.link.attach(self.frags)

    # ================================================================================ restart
    def save_sync_state(self, directory, iteration):
        """Every rank, after Megatron saved `iteration` into `directory`: rank 0 writes the island's sync state
        beside it (``sync_state.py``); a failure is raised on every rank."""
        if not self.started or self.failed is not None or self.finished or not directory:
            return
        from yeto_patch.island.boundary import sync_state

        self._guarded(lambda: self._drain_pushes(f"save the island's sync state for iteration {iteration}"))

        def write():
            return sync_state.save(directory, int(iteration), self.settings, self.step, self.manifest.digest(),
                                   self.frags)
        self._guarded(lambda: self.channel.rank0(write, f"save the island's sync state for iteration {iteration}"))

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
                                   manifest_digest=self.manifest.digest(), layout=self.frags.layout)
        state = self.channel.rank0(read, f"read the island's sync state of iteration {iteration}")
        return state, arrays

    def _restore(self, state, arrays, keep, versions, fixed_roster):
        from yeto_patch.island.boundary import sync_state
        for st in sync_state.restore(state, arrays, self.frags, versions, keep, self.rank,
                                     self.settings.error_feedback, fixed_roster):
            self.link.send_push(st)

    # ================================================================================ collective pieces
    def _have_all_bases(self):
        self.link.poll()
        return all(st.arrived is not None for st in self.frags)

    def _slice(self):
        """Longest time rank 0 blocks before the island's other ranks hear from it again (they wait in a gloo
        collective whose own timeout is YETO_DILOCO_TIMEOUT + 60 s)."""
        return max(1.0, min(30.0, self.settings.timeout / 4))

    def _await(self, ready, what, init_ok=False):
        """Every rank: loop until rank 0's `ready()` is True; it fails once the syncer has been unreachable for
        YETO_DILOCO_TIMEOUT (island/link/patience.py), and waits on while the syncer is alive, saying every minute
        what its rounds wait for. Rank 0 also answers the syncer's INIT requests meanwhile (init_ok)."""
        s = self.settings
        source = f"the syncer at {s.syncer}"
        patience = None
        if self.link is not None:   # (rank 0) YETO_DILOCO_TIMEOUT counts only while the syncer is unreachable
            from yeto_patch.island.link.patience import Patience
            patience = Patience(s.timeout, self.link, what, source, step=lambda: self.step)
        self.channel.await_ready(ready, what, timeout=s.timeout, slice_s=self._slice(),
                                 wait=lambda t: self.link.wait(t), source=source,
                                 step=lambda: self.step,
                                 requests=(lambda: self.link.init_requested()) if init_ok else None,
                                 serve=self._send_init, patience=patience)

    def _send_init(self, f):
        """Every rank: read fragment f's FP32 masters; rank 0 streams them to the syncer as INIT."""
        self.data.send_init(self.frags[f], lambda it: self.link.send_init(f, it))
        self.init_sent.append(f)

    def _push(self, f, final=False):
        """Every rank: stream fragment f's delta to rank 0, which encodes it and queues the push."""
        s, st = self.settings, self.frags[f]
        if self.pipeline is not None and not final:   # the snapshot only; the rest runs beside the next steps
            job = self.pipeline.submit(st, self.step)
            st.pending = ({"step": self.step, "fragment": f, "base_version": job.base_version, "_in_flight": True}
                          if self.rank == 0 else {"step": self.step})
            return
        out = self.data.encode_delta(st)
        if out is None:
            st.pending = {"step": self.step}
            return
        body, gather_s, encode_s = out
        st.start_push(self.step, body, s.push_dtype, gather_s, encode_s, final)
        self.link.send_push(st)
        log.debug("yeto-patch: step %d: pushed fragment %d (base v%d, %d bytes %s, gather %.0f ms, encode %.0f ms)",
                  self.step, f, st.anchor_version, body.nbytes, s.push_dtype, gather_s * 1000, encode_s * 1000)

    # ================================================================================ per step
    def _make_plan(self, step):
        """Every rank: rank 0's plan of `step` and the seconds it took, or None on a step where nothing can
        happen (no collective)."""
        from yeto_patch.island.boundary.plan import Plan, needs_plan, plan
        from yeto_patch.island.boundary.schedule import suggest
        due = self.cadence.due(step)
        if not needs_plan(step, self.total, due, bool(self.frags.pending())):
            return None
        t0 = time.perf_counter()

        def decide():
            self._handover()
            self.stager.check()
            self.link.poll()
            staged = {st.index for st in self.frags if self.stager.done(st.index)}
            p = plan(step, self.total, due, self.frags, self.link.final_cut, staged, stage=True)
            if self.settings.sync_auto:   # H at the fleet's pace and phase (island/boundary/schedule.py)
                p.sync_every = suggest(self.settings.sync_every, self.settings.overlap_steps, self.link.clock.rate,
                                       self.link.pace(), self.cadence.h)
                p.shift = {f: k for f in p.push if (k := self.link.catch_up(self.frags[f], self.cadence.h))}
            return p.as_json()
        p = Plan.from_json(self.channel.rank0(decide, f"plan step {step}"))
        return p, time.perf_counter() - t0

    def _begin(self, p):
        """Every rank: the plan's staged bases are armed for this step's install points, and its arrived bases
        handed to the background stage."""
        self.cadence.retune(p.sync_every)
        for f, k in p.shift.items():
            self.cadence.shift(f, k)
        for f in p.staged:
            self._arm(f, "arrived")
        for f, v, k in p.stage:
            self._stage(f, v, k)

    def _plan_ahead(self):
        """Every rank, before the optimizer step's update: the step's plan, so that its staged bases are
        installed inside the step (``before_param_copy``); the rest of the plan runs after the step."""
        self._ahead = None
        made = self._make_plan(self.step + 1)
        if made is not None:
            self._ahead = (self.step + 1, made[0], made[1])
            self._begin(made[0])

    def _boundary(self):
        from yeto_patch.island.boundary.plan import overdue
        s = self.settings
        tau = s.overlap_steps
        mode = "blend" if tau > 0 else "replace"
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self.step:
            p, plan_s = ahead[1], ahead[2]
        else:   # no plan before this step (a loop without the step hook's before-call): plan now
            self._finish_installs()
            made = self._make_plan(self.step)
            if made is None:
                return   # most steps: nothing can happen, no collective
            (p, plan_s) = made
            self._begin(p)
        for f in p.skip:
            self._skip_boundary(f)
        for f, v, k, held in p.install:
            self._install(f, v, mode, why="arrived", updates=k, held=held)
        self._finish_installs()
        if p.final:
            self._final_cut(by_syncer=p.by_syncer)
            return
        for f in p.push:
            if self.frags[f].pending is not None:   # its previous base never came within H steps (tau < H)
                self._await_answers([f], "the base answering fragment %d's previous push" % f)
            t_push = time.perf_counter()
            self._push(f)
            if self.pipeline is not None and self.rank == 0 and self.pipeline.in_flight(f):
                # the training thread's share of this push: the step's plan and the snapshot (the installs of
                # other fragments' bases this step are in their own records)
                self.pipeline.jobs[f].boundary_s = plan_s + time.perf_counter() - t_push
        late = overdue(self.step, tau, self.frags)
        if late:
            self._await_answers(late, None)

    def _skip_boundary(self, f):
        """Every rank: fragment f's round at this boundary was merged with this island's push before it
        restarted (the steps since were trained again): pushing again would count that progress twice."""
        self.frags[f].skip -= 1
        if self.rank == 0:
            log.info("yeto-patch: step %d: fragment %d's round at this boundary was merged before the restart "
                     "(with this island's push of then); not pushing it again", self.step, f)

    # ================================================================================ final cut
    def _final_cut(self, by_syncer=False):
        t0 = time.perf_counter()
        self._drain_pushes("the final cut")
        if by_syncer:
            if self.rank == 0:
                log.warning("yeto-patch: step %d: the syncer ended the run (its final cut) before this island's "
                            "last step %d; installing its final model and stopping here", self.step, self.total)
        else:
            pending = [st.index for st in self.frags.pending()]
            if pending:
                self._await_answers(pending, None)
            for st in self.frags:
                if st.skip:   # its final round was merged with this island's push before a restart
                    self._skip_boundary(st.index)
                else:
                    self._push(st.index, final=True)
            if self.rank == 0:
                log.info("yeto-patch: step %d: final cut: pushed the final deltas of %d fragments; waiting for "
                         "the final model", self.step, len(self.frags))
        self.stager.drop_all("the final cut")   # bases staged and not installed: the final model replaces them
        for st in self.frags:
            st.staging = None
        versions = self._final_versions(by_syncer)
        for st in self.frags:
            self._install(st.index, int(versions[str(st.index)]), "replace", why="final")
        self.finished = True
        if self.rank == 0:
            secs = time.perf_counter() - t0
            vs = [int(versions[str(f)]) for f in range(len(self.frags))]
            self.log.write("final", step=self.step, versions=vs, seconds=round(secs, 3))
            log.info("yeto-patch: step %d: installed the syncer's final model (versions %s) in %.1fs; training "
                     "ends here", self.step, vs, secs)
        self.close()

    def _final_versions(self, by_syncer):
        """Every rank: rank 0 waits (a slice at a time) for the syncer's final model and holds it as the arrived
        bases; returns {fragment: version}."""
        s = self.settings
        got = {}
        t_end = time.monotonic() + s.timeout

        def finish():
            out = self.link.final_model(self.step, t_end, self._slice(), drain=not by_syncer)
            if out is None:
                return None
            got.update(out)
            for st in self.frags:
                st.arrived = got.get(st.index)
            return {str(f): got[f].version for f in range(len(self.frags))}
        while True:
            versions = self.channel.rank0(finish, "the final model")
            if versions is not None:
                return versions
