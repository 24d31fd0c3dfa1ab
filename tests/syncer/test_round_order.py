"""The round's order test: the real coordinator driven by random events (pushes on time, late, duplicate and of no
steps, heartbeats, disconnects, the clock, merges when due, a forced final merge), checked after every event:

- every round's phases follow ``rounds.round.TRANSITIONS`` from OPEN, and a merged round ends in MERGED;
- a merge happens only when the round decided it is due (or the final cut forces it);
- a merge holds each island's answer once, and one island's weight in it (on time and carried together) stays within
  its cap;
- every accepted push ends merged, refused, or still waiting in an open round: nothing is lost.

Runtime: about 2 s."""
import numpy as np
import pytest

from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.pushes import ReceivedPush, PushRefused
from yeto_patch.syncer.rounds.round import TRANSITIONS, Phase
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.wire import codecs

from .test_rounds import Clock

pytestmark = pytest.mark.timeout(120)
MAN = [("a", (64,), "float32"), ("b", (32,), "float32")]


def _legal(history):
    return history[0] is Phase.OPEN and all(b in TRANSITIONS[a] for a, b in zip(history, history[1:]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("quorum", [None, 2])
def test_random_events_keep_the_round_rules(seed, quorum):
    rng = np.random.default_rng(seed)
    clock = Clock()
    c = Coordinator(MergeSettings(weights="tokens", outer="avg", max_base_lag=2),
                    RoundSettings(islands=4, quorum=quorum, timeout_s=5.0, lease_s=30.0), ChunkRunner(1),
                    clock=clock, heartbeat_s=1.0)
    c.set_manifest(MAN, 2)
    for i, f in enumerate(c.frags):
        c.init_fragment(i, np.zeros(f.numel, np.float32))
    islands = ["a", "b", "c", "d"]
    step = {i: 0 for i in islands}
    for i in islands:
        c.join(i, "1")
    accepted, merged, rounds_seen = set(), set(), []
    for _ in range(400):
        ev = rng.integers(0, 10)
        i = islands[int(rng.integers(0, 4))]
        fr = int(rng.integers(0, 2))
        f = c.frags[fr]
        if ev < 5:   # a push on the current base, an older one, or with no new steps
            base = max(0, f.version - int(rng.integers(0, 4)))
            steps = 0 if rng.random() < 0.1 else int(rng.integers(1, 20))
            step[i] += steps
            body = codecs.encode("f32", rng.standard_normal(f.numel).astype(np.float32))
            p = ReceivedPush(i, fr, base, "f32", 256, body,
                     local_step=step[i], steps=steps, tokens=steps * int(rng.choice([10, 10 ** 12])),
                     patience=float(rng.choice([0.5, 1e-6])))
            try:
                status, _ = c.accept(p)
                if status in ("accepted", "carried"):
                    accepted.add((i, fr, base))
            except PushRefused:
                pass
        elif ev < 7:
            c.touch(i, step[i], float(rng.choice([5.0, 10.0])))
        elif ev == 7 and rng.random() < 0.3:
            c.disconnected(i, bye=False)
            c.join(i, "1")
        else:
            clock.t += float(rng.choice([0.1, 0.5, 2.0, 6.0]))
        for r in c.rounds:
            rounds_seen.append(r)
            assert _legal(r.history), r.history
        due = c.due()
        for fr in range(2):
            r = c.rounds[fr]
            if fr not in due:
                continue
            caps = {i: c.book.cap(i, []) for i in islands}   # (what the merge may give each island)
            rec = c.merge(fr)
            assert rec is not None and r.phase is Phase.MERGED and _legal(r.history)
            _check_merge(rec, caps)
            merged.update((x["island"], fr, x["base_version"]) for x in rec.responders)
    for fr in range(2):   # the final cut: what waits merges, carried pushes alone included
        caps = {i: c.book.cap(i, []) for i in islands}
        rec = c.merge(fr, force=True)
        if rec is not None:
            _check_merge(rec, caps)
            merged.update((x["island"], fr, x["base_version"]) for x in rec.responders)
    waiting = {(x.island, r.fragment, x.push.base_version) for r in c.rounds
               for x in list(r.answers.values()) + r.carried}
    assert accepted <= merged | waiting, sorted(accepted - merged - waiting)[:5]
    assert all(_legal(r.history) for r in rounds_seen)
    assert any(Phase.GRACE in r.history for r in rounds_seen) or quorum == 2


def _check_merge(rec, caps):
    on_time = [x["island"] for x in rec.responders if not x["carried"]]
    assert len(on_time) == len(set(on_time)), rec.responders          # each island's answer once
    if not rec.ok:
        return
    for island in {x["island"] for x in rec.responders}:   # on time and carried together: within one island's cap
        mine = [x for x in rec.responders if x["island"] == island]
        total = sum(x["weight"] for x in mine)
        answer = sum(x["weight"] for x in mine if not x["carried"])
        if caps[island] is not None and any(x["carried"] for x in mine):
            assert total <= max(caps[island], answer) * (1 + 1e-9), (island, mine, caps[island])
