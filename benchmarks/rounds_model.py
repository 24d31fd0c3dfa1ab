#!/usr/bin/env python
"""The syncer's round rules in virtual time: the real coordinator (yeto_patch.syncer.rounds.coordinator.Coordinator,
with its roster, pace window and weights) fed by simulated islands, to compare settings of the rules without the
machine's load in the figures (benchmarks/chaos.py runs the real processes and link code).

Islands at speeds 1.0, 1.0, 1.0, 0.7, 0.5, 0.35 (step 0.1 s at speed 1), 4 fragments, H=20 (with
YETO_DILOCO_SYNC_EVERY=auto: H x speed / the fastest, and the phase catch-up of island/boundary/schedule.py),
tau=5: an island pushes each fragment at its boundaries, trains on up to tau steps and then waits for a base
newer than its push; a base merged without it is installed at its next step. Pushes and bases take 20 ms. The
chaos schedule is chaos.py's (per 180 s: 8 kills, each island down 1-5 of its boundary intervals and restarted
from its last checkpoint, every 20 steps; 16 link outages of 1-5 s, pushes made meanwhile sent at the reconnect;
19 pauses of 0.5-4 s, heartbeats stopped too). Figures as chaos.py's: goodput (tokens merged per fragment / tokens
computed; weighted: each push at its merge weight relative to an on-time push), utilisation (computing / up),
merges per minute, the longest interval without a merge, the mean lag of merged pushes and the pushes per merge.

By default step times are exact, pushes arrive 20 ms after their boundary and the syncer hears every step: real
islands are noisier, and the rhythm of a pinned H looked better here than on Megatron-LM islands until --jitter
(lognormal step times, rates from the median of the last 8 steps), --lane (boundary to arrival) and --beat
(heartbeat period) were added; `--jitter 0.2 --lane 0.08 --beat 7` is about this machine's islands.

    python benchmarks/rounds_model.py                        # the default rule against its neighbours
    python benchmarks/rounds_model.py --seeds 5 --quorums 1,2,3 --fixed-h
    python benchmarks/rounds_model.py --speeds 1.0,0.52 --h 10 --quorums 1 --fixed-h --no-chaos --jitter 0.2 \
        --lane 0.08 --beat 7
"""
from __future__ import annotations

import argparse
import collections
import heapq
import os
import random
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from yeto_patch.island.boundary.schedule import (Cadence, aim_floor, catch_up, follow,  # noqa: E402
                                                 hold, keep_rhythm, rhythm_period, suggest)
from yeto_patch.syncer.rounds import settings as syncer_settings  # noqa: E402
from yeto_patch.syncer.model.runner import ChunkRunner  # noqa: E402
from yeto_patch.syncer.rounds.coordinator import Coordinator  # noqa: E402
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings  # noqa: E402
from yeto_patch.syncer.rounds.pushes import ReceivedPush, PushRefused
from yeto_patch.wire import codecs  # noqa: E402
from yeto_patch.wire.values import Schedule  # noqa: E402

P, TOKENS, LATENCY, LEASE = 4, 4096, 0.02, 2.0
BODY = codecs.encode("f32", np.zeros(8, np.float32))


class Island:
    def __init__(self, k: int, speed: float, a):
        self.name, self.speed, self.dt, self.auto = f"i{k}", speed, a.step_s / speed, a.auto
        self.stretch = getattr(a, "stretch", True) and not a.auto
        self.h = max(a.tau + 1, round(a.h * speed / max(a.speeds))) if a.auto else a.h
        self.step, self.inc, self.up, self.paused_until, self.next_beat = 0, 0, True, 0.0, 0.0
        self.cadence = Cadence(self.h, P, 0)
        self.anchor, self.pending, self.count = [0] * P, [None] * P, [0] * P
        self.blocked, self.blocked_at, self.offline, self.queued = None, 0.0, False, []
        self.compute = self.wait = self.up_s = 0.0
        self.up_since = 0.0
        self.seen = {}                       # fragment -> (newest merged version, when it arrived)
        self.checkpoint = (0, [0] * P, [0] * P)
        self.took = collections.deque(maxlen=8)   # its last step times (what it says its rate is from)
        self.held = {}                            # fragment -> steps its aimed boundary waited (schedule.hold)

    def rate(self) -> float:
        """Its compute rate as a real island says it: from the median of its last step times."""
        return 1.0 / statistics.median(self.took) if self.took else 1.0 / self.dt


class Model:
    def __init__(self, a, seed):
        self.a, self.rng, self.t = a, random.Random(seed), 0.0
        rs = RoundSettings(islands=len(a.speeds), quorum=a.quorum, grace_s=a.grace, timeout_s=20.0, lease_s=LEASE,
                           min_quorum=a.min_quorum)
        self.c = Coordinator(MergeSettings(weights="tokens", outer="avg", max_base_lag=a.max_base_lag), rs,
                             ChunkRunner(1), clock=lambda: self.t)
        self.c.roster.heartbeat_s = LEASE / 4
        self.c.set_manifest([(f"t{f}", (8,), "float32") for f in range(P)], P)
        for f in range(P):
            self.c.init_fragment(f, np.zeros(8, np.float32))
        self.isl = [Island(k, s, a) for k, s in enumerate(a.speeds)]
        for i in self.isl:
            self.c.join(i.name, "0")
        self.events, self.n, self.merges, self.computed, self.refused = [], 0, [], 0, 0
        for k, i in enumerate(self.isl):
            self.at(i.dt * self.rng.uniform(0.5, 1.5), k, "step")
        if a.chaos:
            self.chaos()

    def at(self, t, k, what, d=0.0):
        self.n += 1
        heapq.heappush(self.events, (t, self.n, k, what, d))

    def chaos(self):
        a, rng, n = self.a, self.rng, len(self.isl)
        scale = a.seconds / 180.0
        for _ in range(round(8 * scale)):
            k = rng.randrange(n)
            self.at(rng.uniform(0.1, 0.75) * a.seconds, k, "kill", rng.uniform(1, 5) * self.isl[k].h * self.isl[k].dt)
        for _ in range(round(16 * scale)):
            self.at(rng.uniform(0.05, 0.85) * a.seconds, rng.randrange(n), "outage", rng.uniform(1, 5))
        for _ in range(round(19 * scale)):
            self.at(rng.uniform(0.05, 0.85) * a.seconds, rng.randrange(n), "pause", rng.uniform(0.5, 4))

    # ------------------------------------------------------------------------------------------ the syncer
    def merge_due(self):
        while True:
            due = self.c.due()
            if not due:
                return
            for f in due:
                rec = self.c.merge(f)
                if rec is not None and rec.ok:
                    self.merges.append((self.t, rec))
                    for i in self.isl:
                        i.seen[f] = (rec.version, self.t + LATENCY)
            for k, i in enumerate(self.isl):
                if i.blocked is not None and self.answered(i, i.blocked):
                    i.wait += self.t - i.blocked_at
                    i.blocked = None
                    self.at(self.t + self.dt(i), k, "step")

    def answered(self, i, f) -> bool:
        p = i.pending[f]
        return p is None or self.c.frags[f].version > p[0]

    def send(self, i, f, base, steps, step=None, patience=None):
        p = ReceivedPush(i.name, f, base, "f32", 256, BODY, local_step=i.step if step is None else step, steps=steps,
                         tokens=steps * TOKENS, incarnation=str(i.inc),
                         patience=self.a.tau * i.dt if patience is None else patience,
                         rate=i.rate(), pinned=i.stretch)
        try:
            self.c.accept(p)
        except PushRefused:
            self.refused += 1

    # ------------------------------------------------------------------------------------------ an island
    def island_step(self, k):
        a, i, c = self.a, self.isl[k], self.c
        i.step += 1
        i.compute += i.dt
        self.computed += TOKENS
        i.count = [x + 1 for x in i.count]
        if self.t >= i.next_beat:   # its heartbeat (every --beat s; every step without)
            said = None if getattr(a, "no_schedule", False) else Schedule(   # its H and next boundaries after this
                i.cadence.h, tuple(s if s > i.step else s + i.cadence.h for s in i.cadence.next))   # step (as the engine's)
            c.touch(i.name, i.step, i.rate(), i.stretch, said)
            i.next_beat = self.t + a.beat
        due = i.cadence.due(i.step)
        limit = getattr(self.a, "hold", None)
        limit = a.h if limit is None else limit   # (the engine's: N, the user's H)
        if i.stretch and limit and c.rhythm(i.name):   # not yet opened by the rhythm island: a step more
            held = hold(due, {f: a for f, a in c.round_status(i.name).opened}, i.held, limit)
            due = [f for f in due if f not in held]
            for f in held:
                i.cadence.aim(f, i.step + 1)
        for f in range(P):   # a base merged since: installed unless this fragment pushes now
            if f not in due and self.answered(i, f):
                i.anchor[f], i.pending[f] = max(i.anchor[f], c.frags[f].version), None
        for f in due:
            if i.pending[f] is not None and not self.answered(i, f):
                i.blocked, i.blocked_at = f, self.t
                return
            got = i.seen.get(f)
            if i.auto and got and got[0] > i.anchor[f]:
                i.cadence.shift(f, catch_up(self.t - got[1], i.dt, i.cadence.h, a.tau))
            elif i.stretch:   # a pinned H: the fleet's rhythm, as the island's plan keeps it
                rh = {x[0]: (x[1], x[2]) for x in c.rhythm(i.name)}
                h, shift = keep_rhythm(a.h, a.tau, i.rate(), rh, i.cadence.h, [f], i.step,
                                       0 if getattr(a, "no_respread", False) else P)
                i.cadence.retune(h)
                for g, steps in shift.items():
                    i.cadence.shift(g, steps)
            i.anchor[f] = max(i.anchor[f], c.frags[f].version) if i.pending[f] is not None else i.anchor[f]
            if i.offline:
                i.queued.append((f, i.anchor[f], i.count[f]))
            elif a.lane:   # gathered, encoded and sent: it arrives --lane s (x 0.7-1.3) after the boundary
                lane = a.lane * self.rng.uniform(0.7, 1.3)
                self.at(self.t + lane, k, "arrive", (f, i.anchor[f], i.count[f], i.step, i.inc,
                                                     max(0.0, a.tau * i.dt - lane)))
            else:
                self.send(i, f, i.anchor[f], i.count[f])
            i.pending[f], i.count[f] = (i.anchor[f], i.step), 0
        late = [f for f in range(P) if i.pending[f] is not None and i.step - i.pending[f][1] >= a.tau
                and not self.answered(i, f)]
        if i.auto:
            i.cadence.retune(suggest(a.h, a.tau, i.rate(), c.pace(), i.cadence.h))
        elif i.stretch and not c.rhythm(i.name):
            i.cadence.retune(keep_rhythm(a.h, a.tau, i.rate(), {}, i.cadence.h, [])[0])
        if i.stretch:   # a round the rhythm island's push opened: its boundary comes at once (schedule.follow)
            period = rhythm_period({x[0]: (x[1], x[2]) for x in c.rhythm(i.name)})
            if period is not None:
                st = c.round_status(i.name)
                for f, at in follow({f: age for f, age in st.opened if f not in due}, i.cadence, i.step,
                                    aim_floor(a.h, a.tau), period).items():
                    i.cadence.aim(f, at)
        i.cadence.passed(i.step)
        if i.step % a.checkpoint_every == 0:
            i.checkpoint = (i.step, list(i.anchor), list(i.count))
        if late:
            i.blocked, i.blocked_at = late[0], self.t
        else:
            self.at(self.t + self.dt(i), k, "step")

    def dt(self, i) -> float:
        """The next step's duration: the island's step time, times a lognormal factor with --jitter."""
        dt = i.dt * (self.rng.lognormvariate(0.0, self.a.jitter) if self.a.jitter else 1.0)
        i.took.append(dt)
        return dt

    def handle(self, k, what, d):
        i, c = self.isl[k], self.c
        if what == "step":
            if i.up and i.blocked is None:
                if self.t < i.paused_until:
                    self.at(i.paused_until, k, "step")
                else:
                    self.island_step(k)
        elif what == "kill" and i.up and self.t + d < self.a.seconds:
            i.up, i.blocked = False, None
            i.up_s += self.t - i.up_since
            c.disconnected(i.name, bye=False)
            self.at(self.t + d, k, "restart")
        elif what == "restart":
            i.up, i.inc, i.up_since, i.offline, i.queued = True, i.inc + 1, self.t, False, []
            c.join(i.name, str(i.inc))
            step, anchors, counts = i.checkpoint
            versions = [f.version for f in c.frags]
            i.step = step
            i.count = [counts[f] if anchors[f] == versions[f] else 0 for f in range(P)]
            i.anchor, i.pending = versions, [None] * P
            i.cadence = Cadence(i.cadence.h, P, step)
            self.at(self.t + self.dt(i), k, "step")
        elif what == "outage" and i.up and not i.offline:
            i.offline = True
            c.disconnected(i.name, bye=False)
            self.at(self.t + d, k, "reconnect")
        elif what == "reconnect" and i.up and i.offline:
            i.offline = False
            c.join(i.name, str(i.inc))
            for f, base, steps in i.queued:
                self.send(i, f, base, steps)
            i.queued = []
        elif what == "arrive" and i.up and d[4] == i.inc:
            f, base, steps, step, _, patience = d
            if i.offline:
                i.queued.append((f, base, steps))
            else:
                self.send(i, f, base, steps, step, patience)
        elif what == "pause" and i.up:
            i.paused_until = max(i.paused_until, self.t + d)

    def run(self) -> dict:
        a = self.a
        while True:
            t = self.events[0][0] if self.events else a.seconds
            while True:   # rounds that become due by time before the next event (or the end, when every island waits)
                dl = self.c.next_deadline()
                if dl is None or dl > min(t, a.seconds):
                    break
                self.t = dl
                self.merge_due()
            if not self.events or self.events[0][0] > a.seconds:
                break
            t, _, k, what, d = heapq.heappop(self.events)
            self.t = t
            self.handle(k, what, d)
            self.merge_due()
        return self.figures()

    def figures(self) -> dict:
        a = self.a
        for i in self.isl:
            if i.up:
                i.up_s += a.seconds - i.up_since
                if i.blocked is not None:
                    i.wait += a.seconds - i.blocked_at
        resp = [r for _, m in self.merges for r in m.responders]
        merged = sum(r["tokens"] for r in resp)
        weighted = sum(r["tokens"] * r["weight"] / r["on_time_weight"] for r in resp if r["on_time_weight"])
        times = [0.0] + [t for t, _ in self.merges] + [a.seconds]
        everyone = sum(1 for _, m in self.merges if set(m.expected) <= {r["island"] for r in m.responders})
        twice = sum(1 for _, m in self.merges if len({r["island"] for r in m.responders}) < len(m.responders))
        return dict(goodput=merged / (P * self.computed), weighted=weighted / (P * self.computed),
                    utilisation=sum(i.compute for i in self.isl) / sum(i.up_s for i in self.isl),
                    merges_per_min=len(self.merges) / (a.seconds / 60), downtime_s=max(np.diff(times)),
                    lag=statistics.mean(r["lag"] for r in resp), per_merge=len(resp) / len(self.merges),
                    refused=self.refused, everyone=everyone / len(self.merges), twice=twice / len(self.merges))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--quorums", default="1,2,3", help="minimum quorums of elastic rounds to compare")
    ap.add_argument("--fixed-h", action="store_true", help="also every island at H=20 (no auto)")
    ap.add_argument("--speeds", type=lambda x: tuple(float(v) for v in x.split(",")),
                    default=(1.0, 1.0, 1.0, 0.7, 0.5, 0.35), help="the islands' speeds")
    ap.add_argument("--h", type=int, default=20, help="YETO_DILOCO_SYNC_EVERY (auto: of the fastest island)")
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--no-chaos", action="store_true", help="only the rows without chaos")
    ap.add_argument("--jitter", type=float, default=0.0, help="sigma of a lognormal factor on each step's time "
                    "(real islands: about 0.1-0.3 on this shared machine)")
    ap.add_argument("--lane", type=float, default=0.0, help="seconds (x 0.7-1.3) from a boundary until its push "
                    "arrives at the syncer (gather, encode, send); 0: at once")
    ap.add_argument("--hold", type=int, default=None, help="steps an aimed boundary may wait for the rhythm "
                    "island's push (island/boundary/schedule.hold; default: N, as the engine; 0: none)")
    ap.add_argument("--beat", type=float, default=0.0, help="seconds between an island's heartbeats (the syncer "
                    "learns its step from them and its pushes; real islands: --lease / 4 = 15 s); 0: every step")
    ap.add_argument("--no-schedule", action="store_true", help="heartbeats without the island's H and next "
                    "boundaries (the rule before: the syncer learns an island's schedule from its second push)")
    a = ap.parse_args(argv)
    base = dict(speeds=a.speeds, step_s=0.1, h=a.h, tau=a.tau, checkpoint_every=20,
                max_base_lag=4, seconds=a.seconds, quorum=None, grace=None, chaos=True, auto=True, min_quorum=None,
                jitter=a.jitter, lane=a.lane, beat=a.beat, hold=a.hold,
                no_schedule=a.no_schedule)
    default = syncer_settings.default_min_quorum(len(base["speeds"]))
    quorums = [int(x) for x in a.quorums.split(",")]
    rows = [(f"elastic, minimum quorum {q}{' (default)' if q == default else ''}", dict(base, min_quorum=None if q == default else q))
            for q in quorums]
    if a.fixed_h:
        rows += [(f"elastic, minimum quorum {q}, pinned H", dict(base, auto=False, min_quorum=None if q == default else q))
                 for q in quorums]
        rows += [(f"elastic, minimum quorum {q}, pinned H not stretched", dict(base, auto=False, stretch=False,
                                                                            min_quorum=None if q == default else q)) for q in quorums]
    rows += [("fixed roster", dict(base, quorum=len(base["speeds"]))), ("defaults, no chaos", dict(base, chaos=False)),
             ("defaults, no chaos, pinned H", dict(base, chaos=False, auto=False)),
             ("defaults, no chaos, pinned H not stretched", dict(base, chaos=False, auto=False, stretch=False))]
    if a.no_chaos:
        rows = [r for r in rows if not r[1]["chaos"]]
    print(f"rounds_model: {len(base['speeds'])} islands at speeds {base['speeds']}, H={base['h']} "
          f"(auto unless said), tau={base['tau']}, {a.seconds:.0f} virtual s, {a.seeds} seeds; means")
    print("| rules | goodput | weighted | utilisation | merges/min | downtime (s) | lag | pushes/merge | refused | "
          "merges holding every island up | merges holding an island twice |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, kw in rows:
        figs = [Model(argparse.Namespace(**kw), s).run() for s in range(a.seeds)]
        m = {k: statistics.mean(f[k] for f in figs) for k in figs[0]}
        print(f"| {name} | {m['goodput']:.3f} | {m['weighted']:.3f} | {m['utilisation']:.3f} | "
              f"{m['merges_per_min']:.0f} | {m['downtime_s']:.1f} | {m['lag']:.2f} | {m['per_merge']:.2f} | "
              f"{m['refused']:.1f} | {m['everyone']:.2f} | {m['twice']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
