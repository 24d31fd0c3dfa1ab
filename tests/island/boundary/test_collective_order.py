"""Every rank runs the same collectives in the same order: the real engine, plans, installs and the real
IslandChannel, driven on several ranks (threads) whose collectives go through a recording hub, with fakes for the
view, the lanes and the syncer (rank 0's link answers pushes after random delays, sometimes with bases nobody
asked for, sometimes with the island's own weights). The hub fails at once when two ranks' n-th collective on a
group differs, or when a rank waits in one that another rank never reaches; so a rank-dependent branch that
contains a collective fails here, not as a hang in a run (the last test plants one to show that it does)."""
import json
import random
import threading
import time
import types

import numpy as np
import pytest

from yeto_patch.island.boundary.channel import IslandChannel
from yeto_patch.island.boundary.driver import Boundaries
from yeto_patch.island.boundary.fragment import Fragments
from yeto_patch.island.boundary.fragment_io import FragmentIO
from yeto_patch.island.boundary.installs import Installer
from yeto_patch.island.boundary.parts import IslandParts
from yeto_patch.island.boundary.plan import InstallRule
from yeto_patch.island.boundary.push_lane import NOTHING, Encoded
from yeto_patch.island.engine import Engine
from yeto_patch.island.records import ArrivedBase, Inbox
from yeto_patch.wire.values import Base

NUMEL = 4


class Mismatch(AssertionError):
    pass


class Hub:
    """Rendezvous of the ranks' collectives, per group, in call order; records each rank's sequence."""

    def __init__(self, n, timeout=5.0):
        self.n, self.timeout = n, timeout
        self.cv = threading.Condition()
        self.slots, self.seqs, self.error = {}, {}, None
        self.logs = {r: [] for r in range(n)}

    def collective(self, rank, group, name, payload=None):
        with self.cv:
            seq = self.seqs.get((group, rank), 0)
            self.seqs[(group, rank)] = seq + 1
            self.logs[rank].append((group, name))
            slot = self.slots.setdefault((group, seq), {})
            slot[rank] = (name, payload)
            self.cv.notify_all()
            deadline = time.monotonic() + self.timeout
            while self.error is None:
                names = {v[0] for v in slot.values()}
                if len(names) > 1:
                    self.error = f"ranks disagree at {group} #{seq}: " + "; ".join(
                        f"rank {r}: {v[0]}" for r, v in sorted(slot.items()))
                elif len(slot) == self.n:
                    return {r: v[1] for r, v in slot.items()}
                elif time.monotonic() > deadline:
                    self.error = (f"ranks {sorted(slot)} wait in {group} #{seq} ({name}); ranks "
                                  f"{sorted(set(range(self.n)) - set(slot))} never came")
                self.cv.notify_all()
                self.cv.wait(0.05)
            raise Mismatch(self.error)


class Channel(IslandChannel):
    def __init__(self, hub, rank):
        super().__init__(types.SimpleNamespace(rank=rank, group=None, timeout_s=5.0))
        self.hub = hub

    def broadcast_json(self, obj, what):
        got = self.hub.collective(self.rank, "island", what, json.dumps(obj) if self.rank == 0 else None)
        return json.loads(got[0])


class Comm:
    def __init__(self, hub, rank):
        self.hub, self.rank = hub, rank

    def agree_flags(self, error, flags, what):
        got = self.hub.collective(self.rank, "island", what, (error is not None, list(flags)))
        if any(e for e, _ in got.values()):
            raise RuntimeError(f"{what} failed")
        return [any(got[r][1][i] for r in got) for i in range(len(flags))]


class Staged:
    def __init__(self, entries):
        self.entries, self.uninstalled, self.alpha = entries, True, None


class View:
    """Collectives: write, refresh (on the island's group). Local: installs into masters, anchors."""

    def __init__(self, hub, rank):
        self.hub, self.rank = hub, rank

    def write(self, idx, source, **kw):
        self.hub.collective(self.rank, "island", f"write {list(idx)} {kw.get('mode')}")

    def snapshot_anchor(self, idx=None):
        pass

    def install_masters(self, staged, leaf=None, params=True):
        if leaf is None or self.rank % 2 == 0:   # (ranks hold different leaves: some install in the step)
            staged.uninstalled = False

    def needs_refresh(self):
        return True

    def refresh_holders(self, entries):
        self.hub.collective(self.rank, "island", f"refresh {list(entries)}")

    def own_numel(self, entries):
        return NUMEL


class Job:
    def __init__(self, fragment, push=None, version=None):
        self.fragment, self.push, self.version = fragment, push, version
        self.result, self.work_s, self.cpu_s, self.nbytes, self.ticks = None, 0.0, 0.0, 16, 0

    def figures(self, enc, step):
        return {"bytes": 16, "handed_at": step}


class Lane:
    """A lane whose jobs pair up on their own group in submission order, and end after random ticks (rank 0)."""

    def __init__(self, hub, rank, group, rng):
        self.hub, self.rank, self.group, self.rng = hub, rank, group, rng
        self.jobs = {}

    def _enqueue(self, f, job, what):
        self.hub.collective(self.rank, self.group, what)
        job.ticks = self.rng.randint(0, 3) if self.rank == 0 else 0
        self.jobs[f] = job

    def _tick(self):
        for job in self.jobs.values():
            job.ticks -= 1
            if job.ticks < 0 and job.result is None:
                job.result = self._result(job)

    def check(self):
        pass

    def close(self):
        pass

    def wait_for(self, fragments, what):
        for job in self.jobs.values():
            job.result = job.result or self._result(job)

    wait_all = wait_for


class PushLane(Lane):
    def _result(self, job):
        return Encoded(np.zeros(NUMEL, np.uint8), 0.0, 0.0) if self.rank == 0 else NOTHING

    def submit(self, frag, push):
        self._enqueue(frag.index, Job(frag, push), f"gather fragment {frag.index} step {push.step}")

    def take_finished(self):
        self._tick()
        out = []
        for f, job in list(self.jobs.items()):
            if job.result is None:
                break
            out.append(self.jobs.pop(f))
        return out

    def release(self, f, what):
        self.jobs.pop(f)

    def wait_snapshots(self, what):
        pass

    def note_boundary(self, f, seconds):
        pass

    def behind(self, f):
        return "the fake lane"


class BaseLane(Lane):
    def _result(self, job):
        return Staged([job.fragment.index])

    def submit(self, frag, version, updates, sources, alpha):
        self._enqueue(frag.index, Job(frag, version=version), f"stage fragment {frag.index} v{version}")

    def finished(self, f):
        self._tick()
        return f in self.jobs and self.jobs[f].result is not None

    def take(self, f, what):
        job = self.jobs.pop(f)
        job.result = job.result or self._result(job)
        return job

    def drop_all(self, what):
        self.jobs.clear()


class Link:
    """Rank 0's syncer: answers each push after 0-4 polls, sometimes merges a fragment without this island, and
    sometimes answers with the island's own weights (a base to install synchronously)."""
    final_cut, resilient = False, True

    def __init__(self, frags, rng, seed=0):
        self.frags, self.rng = frags, rng
        self.versions = [f.anchor_version for f in frags]
        self.due = []   # [polls left, fragment]
        self.pacing = random.Random(seed)   # (YETO_DILOCO_SYNC_EVERY=auto: the fleet's pace and this island's rate)

    def send_push(self, push):
        self.due.append([self.rng.randint(0, 4), push.fragment])

    def ask_again(self, fragment, base_version):
        return False

    def _base(self, f):
        self.versions[f] += 1
        if self.rng.random() < 0.1:   # the island's own weights
            return Base(f, self.versions[f], "held", None, deltas=(), start=self.versions[f] - 1, size=NUMEL,
                        held=True)
        return Base(f, self.versions[f], "f32", np.zeros(NUMEL, np.float32))

    def poll(self):
        got = []
        for d in self.due:
            d[0] -= 1
        for d in [d for d in self.due if d[0] < 0]:
            self.due.remove(d)
            got.append(ArrivedBase(self._base(d[1]), None, 0.0))
        if self.rng.random() < 0.05:   # merged by a quorum without this island
            f = self.rng.randrange(len(self.frags))
            got.append(ArrivedBase(self._base(f), None, 0.0))
        return Inbox(bases=tuple(got))

    def wait(self, t):
        pass

    def stepped(self, step):
        pass

    def resumed(self):
        pass

    def scheduled(self, sync_every, next_boundaries):
        pass

    def reachable(self):
        return True

    def waiting_on(self):
        return "nothing"

    def pace(self):
        return 10.0

    def rate(self):
        return self.pacing.choice([2.0, 5.0])   # (slower than the fleet: H between tau + 1 and H / 2)

    def aims(self):
        """(a pinned H) Sometimes a PUSH_REPLY's rhythm for a push at the syncer: rank 0's aimed boundaries too."""
        if self.pacing.random() < 0.5:
            return {}
        return {f.index: (f.push.base_version, self.pacing.uniform(-3.0, 3.0), self.pacing.uniform(1.0, 4.0))
                for f in self.frags if f.push is not None}

    def rhythm(self):
        """(a pinned H) Sometimes a rhythm to keep: rank 0's stretched H and aimed boundaries reach every rank."""
        if self.pacing.random() < 0.5:
            return {}
        return {f: (self.pacing.uniform(-3.0, 3.0), self.pacing.uniform(1.0, 4.0)) for f in range(len(self.frags))}

    def opened(self):
        """(a pinned H) Sometimes rounds the rhythm island opened: rank 0 pulls boundaries in, every rank follows."""
        if self.pacing.random() < 0.5:
            return {}
        return {f: self.pacing.uniform(0.0, 2.0) for f in range(len(self.frags)) if self.pacing.random() < 0.5}

    def init_requested(self):
        return []

    def final_model(self, last_step, deadline, slice_s, drain):
        return {f: Base(f, v + 1, "f32", np.zeros(NUMEL, np.float32)) for f, v in enumerate(self.versions)}

    def close(self, graceful=True):
        pass


class Log:
    def write(self, *a, **k):
        pass

    def installed(self, *a, **k):
        pass

    def close(self):
        pass


def island_rank(hub, rank, seed, F, H, tau, total, auto=False, ended=False):
    s = types.SimpleNamespace(sync_every=H, overlap_steps=tau, merge_alpha=0.5, timeout=5.0, syncer="fake",
                              push_dtype="f32", island_id="a", vocab_size=None, error_feedback=False, sync_auto=auto)
    frags = Fragments([[f] for f in range(F)], [NUMEL] * F, [NUMEL] * F, rank0=rank == 0)
    for frag in frags:
        frag.installed(0)
    rng = random.Random(seed)   # rank 0's link decides; every rank's lanes tick the same way on rank 0 only
    view = View(hub, rank)
    engine = Engine(s)
    parts = IslandParts(settings=s, rule=InstallRule.of(s), rank=rank, comm=Comm(hub, rank),
                        channel=Channel(hub, rank), view=view, io=FragmentIO(view, None, s, rank), frags=frags,
                        pushes=PushLane(hub, rank, "push-lane", rng), bases=BaseLane(hub, rank, "base-lane", rng),
                        step=lambda: engine.step, total=total, link=Link(frags, rng, seed) if rank == 0 else None,
                        log=Log() if rank == 0 else None)
    if ended:   # the syncer's welcome said its final cut was done
        if parts.link is not None:
            parts.link.final_cut = True
    engine.parts, engine.rank, engine.total, engine.started = parts, rank, total, True
    engine.installer = Installer(parts)
    engine.boundaries = Boundaries(parts, engine.installer, syncer_ended=ended)
    while not engine.finished:
        engine.before_optimizer_step()
        engine.before_param_copy(object())
        engine.on_optimizer_step(True, 10)
    return engine


def run_island(n, seed, F, H, tau, total=24, auto=False, ended=False):
    hub = Hub(n)
    errors, engines = {}, {}

    def main(rank):
        try:
            engines[rank] = island_rank(hub, rank, seed, F, H, tau, total, auto, ended)
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e
            with hub.cv:
                hub.error = hub.error or f"rank {rank} failed: {type(e).__name__}: {e}"
                hub.cv.notify_all()
    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if hub.error:
        raise Mismatch(hub.error)
    assert not errors, errors
    return hub, engines


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("F,H,tau", [(1, 4, 0), (3, 4, 2), (4, 6, 3)])
def test_every_rank_runs_the_same_collectives_in_the_same_order(seed, F, H, tau):
    hub, engines = run_island(3, seed, F, H, tau)
    seqs = list(hub.logs.values())
    assert seqs[0] == seqs[1] == seqs[2]
    names = [name for _, name in seqs[0]]
    assert any(n.startswith("yeto-patch: plan step") for n in names)
    assert any(n.startswith("stage fragment") for n in names) and any(n.startswith("refresh") for n in names)
    assert names.count("yeto-patch: the final model") >= 1 and all(e.finished for e in engines.values())
    anchors = {r: e.parts.frags.anchors() for r, e in engines.items()}
    assert anchors[0] == anchors[1] == anchors[2]   # every rank's fragments went through the same states


@pytest.mark.parametrize("seed", range(4))
def test_an_auto_cadence_moves_every_ranks_boundaries_alike(seed):
    """YETO_DILOCO_SYNC_EVERY=auto: rank 0's plans retune H and bring boundaries forward; every rank's cadence
    follows the broadcast plan, so the collectives stay in step."""
    hub, engines = run_island(3, seed, 3, 8, 2, total=40, auto=True)
    seqs = list(hub.logs.values())
    assert seqs[0] == seqs[1] == seqs[2]
    cadences = [(e.boundaries.cadence.h, e.boundaries.cadence.next) for e in engines.values()]
    assert cadences[0] == cadences[1] == cadences[2] and cadences[0][0] < 8   # a slower rate: fewer steps


def test_an_island_back_after_the_syncers_final_cut_takes_the_final_model_at_its_first_step():
    hub, engines = run_island(3, 0, 3, 8, 2, total=40, ended=True)
    assert all(e.finished and e.step == 1 for e in engines.values())
    seqs = list(hub.logs.values())
    assert seqs[0] == seqs[1] == seqs[2]


def test_a_collective_only_rank_0_calls_is_caught(monkeypatch):
    orig = Boundaries.skip

    def planted(self, f):   # a rank-dependent branch with a collective inside: what this file guards against
        if self.parts.rank == 0:
            self.parts.channel.rank0(lambda: None, "only rank 0")
        orig(self, f)
    monkeypatch.setattr(Boundaries, "skip", planted)
    monkeypatch.setattr(Boundaries, "after_step", lambda self, planned: (planned.plan.push and self.skip(0)))
    with pytest.raises(Mismatch, match="ranks disagree|never came"):
        run_island(2, 0, 2, 4, 1)
