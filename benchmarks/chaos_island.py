#!/usr/bin/env python
"""One simulated island of benchmarks/chaos.py (a process the driver starts, kills, pauses and restarts).

Everything but the compute is the product's island code: the link to the syncer (``island/link``: connect with
back-off, heartbeats with the step and compute rate, reconnects, background pushes, refusals), the waits
(``island/link/patience.py``: YETO_DILOCO_TIMEOUT only while the syncer is unreachable), the fragments' states,
plans and tau rules (``island/boundary/{fragment,plan}.py``), the schedule (``schedule.Cadence``, with
``YETO_DILOCO_SYNC_EVERY=auto``) and the restart state (``island/boundary/sync_state.py``), configured by the same
``YETO_*`` variables (``yeto_patch.config``). The compute is a sleep of ``--step-s / --speed`` per step and a
step on a quadratic of the island's own (per-island target).

    python benchmarks/chaos_island.py --island i0 --speed 1.0 --step-s 0.1 --end-file PATH --out DIR [--restart]

The final cut is at the unix time written in --end-file (the driver writes it once every island has started).

Writes DIR/stats.jsonl: {"ev": "tick"|"end"|"error", "inc", "t", "compute_s", "wait_s", "steps", "tokens", ...}
(cumulative per process, every TICK_S and at the end) and DIR/ckpt/ (a checkpoint every --checkpoint-every steps).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from yeto_patch import config  # noqa: E402
from yeto_patch.island.boundary import sync_state  # noqa: E402
from yeto_patch.island.boundary.fragment import Fragments, PushPhase, PushWire  # noqa: E402
from yeto_patch.island.boundary.plan import InstallRule, install_due, overdue, plan  # noqa: E402
from yeto_patch.island.boundary.schedule import (Cadence, aim_floor, catch_up, follow, hold,  # noqa: E402
                                                 keep_rhythm, reply_aims, rhythm_period, suggest)
from yeto_patch.island.link.patience import Patience  # noqa: E402
from yeto_patch.island.link.sharded import ShardedLink  # noqa: E402
from yeto_patch.wire import auth, codecs  # noqa: E402

TENSORS, SIZE = 8, 8192     # the simulated model: 8 tensors of 8,192 values
TOKENS_PER_STEP = 4096
TICK_S = 0.5
FAR = 1 << 40               # (no step count ends the run: the wall clock does)


def manifest():
    return [(f"decoder.layers.{i}.mlp.linear_fc1.weight", (SIZE,), "float32") for i in range(TENSORS)]


class Island:
    def __init__(self, a):
        self.a = a
        self.s = config.from_env()
        self.rule = InstallRule.of(self.s)
        self.man = manifest()
        self.rng = np.random.default_rng(abs(hash(a.island)) % (1 << 31))
        self.target = [self.rng.standard_normal(SIZE).astype(np.float32) for _ in range(TENSORS)]
        self.step, self.compute_s, self.wait_s, self.tokens = 0, 0.0, 0.0, 0
        self.t_start = time.time()
        self.stats = open(os.path.join(a.out, "stats.jsonl"), "a", buffering=1)
        self.inc = None
        self.next_tick = 0.0
        self.ckpt = os.path.join(a.out, "ckpt")
        self.end = None

    def end_time(self) -> float:
        """The unix time of the final cut, once the driver wrote it (infinity before)."""
        if self.end is None:
            try:
                with open(self.a.end_file) as f:
                    self.end = float(f.read().strip())
            except (OSError, ValueError):
                return float("inf")
        return self.end

    # ------------------------------------------------------------------------------------------ records
    def record(self, ev, **kw):
        self.stats.write(json.dumps({"ev": ev, "run": self.a.run, "inc": self.inc, "t": round(time.time(), 3),
                                     "compute_s": round(self.compute_s, 4), "wait_s": round(self.wait_s, 4),
                                     "steps": self.step, "tokens": self.tokens,
                                     "up_s": round(time.time() - self.t_start, 3), **kw}) + "\n")

    # ------------------------------------------------------------------------------------------ start
    def start(self):
        self.link = ShardedLink(self.s, self.man, step=lambda: self.step)
        w = self.link.open()
        self.inc = str(self.link.links[0].client.incarnation)
        if w.final:
            raise SystemExit(0)
        self.frags = Fragments(w.layout, w.numels, [SIZE] * TENSORS, announced=w.fragments)
        self.link.attach(self.frags)
        init = [self.rng.standard_normal(SIZE).astype(np.float32) * 0 + 0.5 for _ in range(TENSORS)]
        for f in w.needs_init:
            self.link.send_init(f, [init[i] for i in self.frags[f].entries])
        state, arrays, saved = self.read_checkpoint() if self.a.restart else (None, {}, None)
        self.wait_for(lambda: self.all_arrived(init), "the initial bases")
        self.x, self.anchor = {}, {}
        versions = {}
        for st in self.frags:
            b = self.take(st)
            versions[st.index] = b.version
            self.anchor[st.index] = np.array(b.values, np.float32)
            keep = state is not None and state["anchor_version"][st.index] == b.version
            self.x[st.index] = saved[f"x{st.index}"].copy() if keep else self.anchor[st.index].copy()
            st.installed(b.version, keep_counts=keep)
        if state is not None:
            keep = {st.index for st in self.frags if state["anchor_version"][st.index] == versions[st.index]}
            self.step = int(saved["step"])
            for st in sync_state.restore(state, arrays, self.frags, versions, keep, 0, False, w.fixed_roster):
                self.link.send_push(st.outgoing(self.blend, again=True))
        self.link.resilient = True
        # the codec's compiled kernels load before the run is timed (the product encodes in its background push
        # lane, off the training thread; this island encodes inline)
        codecs.encode(self.s.push_dtype, np.zeros(codecs.DEFAULT_BLOCK, np.float32))
        self.cadence = Cadence(self.s.sync_every, len(self.frags), self.step)
        self.aimed = {}   # (a pinned H) fragment -> (base version, step) of the push whose reply aimed its boundary
        self.held = {}    # (a pinned H) fragment -> steps its aimed boundary waited for the rhythm island (hold)
        self.t_start = time.time()   # (up from here: joined, with every base)
        self.record("start", restart=bool(self.a.restart), step0=self.step)

    def all_arrived(self, init):
        for f in self.link.init_requested():
            self.link.send_init(f, [init[i] for i in self.frags[f].entries])
        self.frags.receive(self.link.poll())
        return all(st.side.arrived is not None for st in self.frags)

    def wait_for(self, ready, what):
        t0 = time.monotonic()
        p = Patience(self.s.timeout, self.link, what, f"the syncer at {self.s.syncer}", step=lambda: self.step)
        while not ready():
            p.check()
            self.link.wait(0.2)
            self.tick()
        self.wait_s += time.monotonic() - t0

    # ------------------------------------------------------------------------------------------ steps
    def compute(self):
        t0 = time.monotonic()
        time.sleep(self.a.step_s / self.a.speed)
        for st in self.frags:   # a step towards this island's own target (the simulated work)
            x = self.x[st.index]
            for k, e in enumerate(st.entries):
                seg = x[st.shape.starts[k]:st.shape.starts[k] + SIZE]
                seg -= 0.01 * (seg - self.target[e])
        self.compute_s += time.monotonic() - t0
        self.step += 1
        self.tokens += TOKENS_PER_STEP
        self.frags.count_step(TOKENS_PER_STEP)
        self.link.stepped(self.step)

    @property
    def blend(self) -> bool:
        return self.s.overlap_steps > 0

    @staticmethod
    def take(st):
        """The base that arrived for fragment state `st` (it leaves the fragment's hands)."""
        b = st.side.arrived
        return st.take_arrived(b.version, len(b.deltas) if b.relative else 0, bool(b.held))

    def install(self, f, final=False):
        st = self.frags[f]
        answers = st.answers(st.side.arrived)
        b = self.take(st)
        blend = self.blend and not final
        base = np.array(b.values, np.float32)
        a = self.s.merge_alpha
        self.x[f] = a * self.x[f] + (1 - a) * base if blend else base.copy()
        self.anchor[f] = base
        st.installed(b.version, keep_counts=blend, answers=answers)

    def push(self, f, final=False):
        st = self.frags[f]
        body = codecs.encode(self.s.push_dtype, self.anchor[f] - self.x[f])
        push = st.begin_push(self.step, final)
        st.push_handed(PushWire(body, self.s.push_dtype))
        self.link.send_push(st.outgoing(self.blend))
        self.record("push", fragment=f, base=push.base_version, final=final)   # (chaos.py: every push ends)

    def await_answers(self, fs):
        """Wait for the answers of the pushes of `fs`, as the engine's wait does (island/boundary/driver.py): a
        newer base that does not answer goes in at once and the wait goes on; a push whose round merged without it
        is sent again (link.ask_again); a refused push settles."""
        def ready():
            self.frags.receive(self.link.poll())
            out = True
            for f in fs:
                st = self.frags[f]
                if st.push is None or st.answered():
                    continue
                newer = st.newer_at_hand()
                if newer or st.anchor_version > st.push.base_version:
                    self.link.ask_again(f, st.push.base_version)
                if newer:
                    self.install(f)
                out = False
            return out
        self.wait_for(ready, "the bases answering fragments %s (tau=%d)" % (sorted(fs), self.s.overlap_steps))
        for f in fs:
            st = self.frags[f]
            if st.push is None:
                continue
            if st.side.arrived is not None and st.answers(st.side.arrived):
                self.install(f)
            elif st.side.refused is not None or st.side.carried:
                st.settle()

    def boundary(self, final=False):
        due = self.cadence.due(self.step)
        if not self.s.sync_auto:
            due = self.follow_rhythm(due)
        if not (due or final or self.frags.pushing()):
            return False
        self.frags.receive(self.link.poll())
        p = plan(self.step, self.step if final else FAR, due, self.frags, self.link.final_cut, self.rule)
        if p.final:
            return True
        if self.s.sync_auto:   # (as the engine's plan does: H at the fleet's pace and phase)
            self.cadence.retune(suggest(self.s.sync_every, self.s.overlap_steps, self.link.rate(), self.link.pace(),
                                        self.cadence.h))
            rate, now = self.link.rate(), time.monotonic()
            for f in p.push:
                at = self.frags[f].behind_by()
                self.cadence.shift(f, 0 if at is None else catch_up(now - at, 1.0 / rate if rate else None,
                                                                     self.cadence.h, self.s.overlap_steps))
        else:   # (a pinned H: the fleet's rhythm, as the engine's plan keeps it)
            h, shift = keep_rhythm(self.s.sync_every, self.s.overlap_steps, self.link.rate(), self.link.rhythm(),
                                   self.cadence.h, p.push, self.step, len(self.frags))
            self.cadence.retune(h)
            for f, k in shift.items():
                self.cadence.shift(f, k)
            pushes = {fr.index: (fr.push.base_version, fr.push.step) for fr in self.frags
                      if fr.push is not None and fr.push.phase is PushPhase.AT_SYNCER and fr.index not in p.push}
            for f, at in reply_aims(self.link.aims(), pushes, self.aimed, self.link.rate(),
                                    aim_floor(self.s.sync_every, self.s.overlap_steps), 2 * h, self.step).items():
                self.cadence.aim(f, at)
        for f in p.skip:
            self.frags[f].skipped()
        for spec in p.install:   # (no background lane here: a base to stage goes in once it is due)
            self.install(spec.fragment)
        for spec in p.stage:
            if install_due(self.frags[spec.fragment], self.step, self.rule):
                self.install(spec.fragment)
        for f in p.push:
            if self.frags[f].push is not None:
                self.await_answers([f])
            self.push(f)
        late = overdue(self.step, self.rule, self.frags)
        if late:
            self.await_answers(late)
        return False

    def follow_rhythm(self, due):
        """(a pinned H, as the engine's plan does) The fragments due now that push: a round the rhythm island's push
        opened pulls a near boundary to the next step (schedule.follow); one due that it has not opened yet waits a
        step more (schedule.hold)."""
        period = rhythm_period(self.link.rhythm())
        if period is None:
            return due
        opened = {f: age for f, age in self.link.opened().items() if age <= period / 2}
        held = hold(due, opened, self.held, self.s.sync_every)   # not opened yet: a step more (schedule.hold)
        for f in held:
            self.cadence.aim(f, self.step + 1)
        for f, at in follow({f: a for f, a in opened.items() if f not in due}, self.cadence, self.step,
                            aim_floor(self.s.sync_every, self.s.overlap_steps), period).items():
            self.cadence.aim(f, at)
        return [f for f in due if f not in held]

    def run(self):
        self.start()
        while time.time() < self.end_time():
            self.compute()
            if self.boundary():
                break
            self.cadence.passed(self.step)
            self.link.scheduled(self.cadence.h, self.cadence.next)   # (as the engine does: heartbeats say it)
            if self.step % self.a.checkpoint_every == 0:
                self.checkpoint()
            self.tick()
        self.final_cut()

    def final_cut(self):
        pending = [st.index for st in self.frags.pushing()]
        if pending and not self.link.final_cut:
            self.await_answers(pending)
        if not self.link.final_cut:
            for st in self.frags:
                if st.skip:
                    st.skipped()
                else:
                    self.push(st.index, final=True)
        t0 = time.monotonic()
        deadline = t0 + self.s.timeout
        while True:
            got = self.link.final_model(self.step, deadline, 2.0, drain=True)
            self.tick()
            if got is not None:
                break
        self.wait_s += time.monotonic() - t0
        self.link.close()
        self.record("end", versions=[got[f].version for f in sorted(got)])

    def tick(self):
        now = time.monotonic()
        if now >= self.next_tick:
            self.next_tick = now + TICK_S
            self.record("tick", h=self.cadence.h if hasattr(self, "cadence") else None)

    # ------------------------------------------------------------------------------------------ restarts
    def checkpoint(self):
        os.makedirs(self.ckpt, exist_ok=True)
        digest = auth.manifest_digest(self.man).hex()
        sync_state.save(self.ckpt, self.step, self.s, self.step, digest, self.frags)
        tmp = os.path.join(self.ckpt, "x.tmp.npz")
        np.savez(tmp, step=self.step, **{f"x{f}": v for f, v in self.x.items()})
        os.replace(tmp, os.path.join(self.ckpt, "x.npz"))

    def read_checkpoint(self):
        path = os.path.join(self.ckpt, "x.npz")
        if not os.path.exists(path):
            return None, {}, None
        saved = dict(np.load(path))
        it = int(saved["step"])
        arrays = {}
        state = sync_state.load(sync_state.state_path(self.ckpt, it), it, arrays, self.s,
                                manifest_digest=auth.manifest_digest(self.man).hex(), layout=self.frags.layout)
        return state, arrays, saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--island", required=True)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--step-s", type=float, default=0.1, help="seconds per step at speed 1")
    ap.add_argument("--end-file", required=True, help="file the driver writes the unix time of the final cut to")
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--restart", action="store_true", help="resume from the checkpoint in --out")
    ap.add_argument("--run", type=int, default=0, help="the driver's number for this process (in every record)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    isl = Island(a)
    try:
        isl.run()
    except BaseException as e:  # noqa: BLE001 - recorded: a healthy island that stops is what chaos.py counts
        if isinstance(e, SystemExit) and not e.code:
            return 0
        isl.record("error", msg=f"{type(e).__name__}: {e}"[:2000])
        logging.getLogger("yeto_patch").exception("island stopped")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
