"""A pinned H keeps the slowest island's rhythm (issue 35, item 5): the syncer names the rhythm only for a fleet of
islands that all pinned H and are within 3x in speed, says each other island when the rhythm island pushes each
fragment next, and merges rounds of such a fleet from one answer on (their pushes land together by their aim);
rounds below their floor whose islands wait in other rounds do not stand still until the timeout. Then, in
virtual time (benchmarks/rounds_model.py: the real coordinator and the islands' schedule functions), two and
three islands of different speeds share >= 90% of their merges without the fast island waiting, against a
control without the rhythm. Runtime: about 10 s."""
import argparse
import dataclasses
import importlib.util
import os
import sys

import numpy as np
import pytest

from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.pushes import ReceivedPush
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.wire import codecs
from yeto_patch.wire.values import Schedule
from yeto_patch.syncer.rounds.pushes import parse_push, reply_for
from yeto_patch.wire.schema import (IslandBeat, island_beat_meta, push_meta, read_island_beat, read_reply, read_syncer_beat,
                                    reply_meta, syncer_beat_meta)

from .test_rounds import MAN, Clock

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fleet(rates, clock, pinned=True, fragments=1, min_quorum=None):
    """A coordinator whose islands i0, i1 ... say these rates; each has pushed fragment 0 at steps 10 and 20."""
    c = Coordinator(MergeSettings(weights="equal", outer="avg"),
                    RoundSettings(islands=len(rates), timeout_s=600.0, lease_s=30.0, min_quorum=min_quorum),
                    ChunkRunner(1), clock=clock, heartbeat_s=1.0)
    c.set_manifest(MAN, fragments)
    for f in range(fragments):
        c.init_fragment(f, np.zeros(c.frags[f].numel, np.float32))
    for k, r in enumerate(rates):
        c.join(f"i{k}", "1")
        c.touch(f"i{k}", 20, r, pinned if isinstance(pinned, bool) else pinned[k])
        for f in range(fragments):
            c.window.pushed(f"i{k}", f, 10)
            c.window.pushed(f"i{k}", f, 20)
    return c


def test_the_rhythm_is_the_slowest_island_of_a_pinned_fleet_within_3x():
    clock = Clock()
    c = fleet([10.0, 5.2], clock)
    (entry,) = c.rhythm("i0")
    f, eta, period = entry
    assert f == 0 and period == pytest.approx(10 / 5.2, rel=1e-3)   # i1's 10 steps between pushes at 5.2 steps/s
    assert eta == pytest.approx(10 / 5.2, rel=1e-3)                 # it said step 20 (its last push) just now
    assert c.rhythm("i1") == []                                     # the rhythm island keeps its own H
    assert c.round_status("i0").rhythm == [entry]
    clock.t += 1.0
    assert c.rhythm("i0")[0][1] == pytest.approx(10 / 5.2 - 1.0, rel=1e-3)


@pytest.mark.parametrize("rates,pinned", [([10.0, 3.0], True),            # more than 3x apart
                                          ([10.0, 5.2], [True, False]),   # one island follows the fleet's pace
                                          ([10.0], True)])                # alone
def test_no_rhythm_beyond_3x_with_an_auto_island_or_alone(rates, pinned):
    clock = Clock()
    c = fleet(rates, clock, pinned)
    assert c.rhythm("i0") == [] and c.roster.rhythm(clock()) is None
    assert c.round_status("i0").rhythm == []


def test_no_rhythm_with_a_quorum():
    """A fixed roster waits for every island anyway; aimed boundaries could put the islands' fragments in different
    orders, each island waiting at its tau bound for a round that waits for the other (a run stood still so)."""
    clock = Clock()
    c = fleet([10.0, 5.2], clock)
    c.rs = c.roster.rs = dataclasses.replace(c.rs, quorum=2)
    assert c.rhythm("i0") == [] and c.roster.floor(0, clock()) == 2


def test_a_fleet_keeping_a_rhythm_merges_from_one_answer_unless_a_minimum_quorum_was_given():
    clock = Clock()
    assert fleet([10.0, 8.0, 6.0], clock).roster.floor(0, clock()) == 1
    assert fleet([10.0, 8.0, 6.0], clock, pinned=False).roster.floor(0, clock()) == 2            # control
    assert fleet([10.0, 8.0, 6.0], clock, min_quorum=2).roster.floor(0, clock()) == 2


def answer(c, island, fragment, patience):
    n = c.frags[fragment].numel
    c.accept(ReceivedPush(island=island, fragment=fragment, base_version=0, codec="f32", block=256, steps=1,
                          body=codecs.encode("f32", np.ones(n, np.float32)), patience=patience))


@pytest.mark.parametrize("patience,due", [(0.5, [0, 1, 2]), (100.0, [])])
def test_rounds_below_their_floor_do_not_wait_for_islands_blocked_in_each_other(patience, due):
    """Three islands, a minimum quorum of 2, each alone in a different fragment's round: once their patience ran
    out each waits for the others' rounds, which wait for it. With patience left (the control) they wait."""
    clock = Clock()
    c = fleet([10.0, 10.0, 10.0], clock, pinned=False, fragments=3)
    for k in range(3):
        answer(c, f"i{k}", k, patience)
    assert c.due() == []
    clock.t += 1.0
    assert c.due() == due


def test_heartbeats_carry_pinned_and_the_rhythm_bounded():
    assert read_island_beat(island_beat_meta(7, 2.5, True)) == IslandBeat(7, 2.5, True)
    assert read_island_beat(island_beat_meta(7, 2.5)) == IslandBeat(7, 2.5, False)
    assert read_island_beat({"step": 7, "pinned": "yes"}).pinned is False
    st = read_syncer_beat({"rounds": [], "missing": [], "rhythm": [
        [0, 1.5, 2.0], [1, -0.5, 2.0],                            # kept (a push overdue: a negative eta)
        [2, float("nan"), 2.0], [3, 1.0, 0.0], [4, 1.0, -1.0], [True, 1.0, 2.0], [-1, 1.0, 2.0],
        [5, 1e9, 2.0], [6, 1.0], "x", [7, "1", 2.0]]})
    assert st.rhythm == [[0, 1.5, 2.0], [1, -0.5, 2.0]]
    assert len(read_syncer_beat({"rhythm": [[0, 1.0, 1.0]] * 100000}).rhythm) == 4096
    c = fleet([10.0, 5.2], Clock())
    assert read_syncer_beat(syncer_beat_meta(0.0, c.round_status("i0"))).rhythm == c.rhythm("i0")


def test_heartbeats_carry_the_schedule_bounded():
    """An island's heartbeat says its H and each fragment's next boundary step; all of it in range, or none."""
    beat = read_island_beat(island_beat_meta(7, 2.5, True, Schedule(10, (10, 12, 15))))
    assert beat.schedule == Schedule(10, (10, 12, 15))
    for h, nxt in [(0, [1]), (True, [1]), (1 << 40, [1]), (10, []), (10, [1, -1]), (10, [1, 2.0]), (10, [True]),
                   (10, "12"), (10, [1] * 4097), ("10", [1]), (10, None), (None, [1])]:
        beat = read_island_beat({"step": 7, "h": h, "next": nxt})
        assert beat.schedule is None and beat.step == 7, (h, nxt)


def test_before_its_first_pushes_an_island_is_due_by_the_schedule_its_heartbeats_say():
    """A run's first rounds: before an island pushed a fragment (or any fragment twice) its heartbeats' H and next
    boundaries say when its push is due, so the rhythm is known from its first heartbeat, not its second push."""
    clock = Clock()
    c = Coordinator(MergeSettings(weights="equal", outer="avg"),
                    RoundSettings(islands=2, timeout_s=600.0, lease_s=30.0), ChunkRunner(1), clock=clock,
                    heartbeat_s=1.0)
    c.set_manifest(MAN, 2)
    for f in range(2):
        c.init_fragment(f, np.zeros(c.frags[f].numel, np.float32))
    for k in range(2):
        c.join(f"i{k}", "1")
    c.touch("i0", 4, 10.0, True)
    c.touch("i1", 3, 5.0, True)
    assert c.rhythm("i0") == []                       # nobody pushed and nobody said a schedule: unknown
    c.touch("i1", 3, 5.0, True, Schedule(10, (5, 10)))        # i1: fragment 0 at step 5, fragment 1 at step 10, H = 10
    (f0, eta0, p0), (f1, eta1, p1) = c.rhythm("i0")
    assert (f0, f1) == (0, 1) and p0 == p1 == pytest.approx(10 / 5.0)
    assert eta0 == pytest.approx(2 / 5.0) and eta1 == pytest.approx(7 / 5.0)
    clock.t += 1.0
    c.touch("i1", 8, 5.0, True, Schedule(10, (15, 10)))       # fragment 0 passed: the next one is at 15
    (_, eta0, _), (_, eta1, _) = c.rhythm("i0")
    assert eta0 == pytest.approx(7 / 5.0) and eta1 == pytest.approx(2 / 5.0)
    c.touch("i1", 12, 5.0, True)                      # a heartbeat without it keeps the last one said
    (_, eta0, _), (_, eta1, _) = c.rhythm("i0")
    assert eta0 == pytest.approx(3 / 5.0) and eta1 == pytest.approx(8 / 5.0)   # (10 passed: then every H)
    c.join("i1", "2")                                 # a restart: what the old process said is forgotten
    c.touch("i1", 1, 5.0, True)
    assert c.rhythm("i0") == []


def test_a_round_the_rhythm_island_opened_is_told_to_the_others_bounded():
    clock = Clock()
    c = fleet([10.0, 5.2], clock)
    assert c.keeps_rhythm("i1") and not c.keeps_rhythm("i0")
    assert c.round_status("i0").opened == []
    push = ReceivedPush(island="i1", fragment=0, base_version=0, codec="f32", block=256,
                        body=codecs.encode("f32", np.ones(c.frags[0].numel, np.float32)), local_step=30, steps=10,
                        tokens=10, patience=2.0, rate=5.2, pinned=True)
    assert c.accept(push)[0] == "accepted"
    clock.t += 0.25
    assert c.round_status("i0").opened == [[0, 0.25]]    # i1's push opened fragment 0's round 0.25 s ago
    assert c.round_status("i1").opened == []              # (not to the rhythm island itself)
    st = read_syncer_beat(syncer_beat_meta(0.0, c.round_status("i0")))
    assert st.opened == [[0, 0.25]]
    bad = read_syncer_beat({"opened": [[0, 0.5], [1, -1.0], [2, float("nan")], [True, 1.0], [-1, 1.0], [3, 2e6],
                                       [4], "x", [5, "1"]]})
    assert bad.opened == [[0, 0.5]]
    assert len(read_syncer_beat({"opened": [[0, 1.0]] * 100000}).opened) == 4096
    # once i0 answered, or the round merged, it is no longer said
    push0 = dataclasses.replace(push, island="i0", rate=10.0,
                                body=codecs.encode("f32", np.ones(c.frags[0].numel, np.float32)))
    assert c.accept(push0)[0] == "accepted"
    assert c.round_status("i0").opened == []


def test_the_rhythm_island_stays_until_another_is_clearly_slower():
    clock = Clock()
    c = fleet([10.0, 9.5], clock)
    assert c.keeps_rhythm("i1")
    c.touch("i0", 25, 9.2, True)       # i0 now says it is a little slower: noise, i1 stays the rhythm
    assert c.keeps_rhythm("i1")
    c.touch("i0", 26, 8.0, True)       # 16% slower: i0 is the rhythm now
    assert c.keeps_rhythm("i0")


def test_a_push_says_rate_and_pinned_and_its_reply_says_the_rhythm_from_its_arrival():
    """A pinned island's push carries its rate (heartbeats come every lease / 4, too seldom for short periods) and
    the PUSH_REPLY tells it when the rhythm island pushes that fragment next, counted from the push's arrival."""
    clock = Clock()
    c = fleet([10.0, 5.2], clock, pinned=[False, True])   # i0's heartbeats did not say pinned yet: no rhythm
    assert c.rhythm("i0") == []
    n = c.frags[0].numel
    meta = push_meta(0, n, base_version=0, local_step=25, steps=5, tokens=5, codec="f32", block=256, final=False,
                     blend=True, patience=0.5, rate=9.0, pinned=True)
    p = parse_push("i0", "1", meta, codecs.encode("f32", np.ones(n, np.float32)))
    assert (p.rate, p.pinned) == (9.0, True)
    clock.t += 0.25
    r = read_reply(reply_for(c, p))
    assert r.status == "accepted" and c.members["i0"].pinned and c.members["i0"].rate == 9.0
    eta, period = r.rhythm
    assert period == pytest.approx(10 / 5.2, rel=1e-3) and eta == pytest.approx(10 / 5.2 - 0.25, rel=1e-3)
    # the rhythm island's own pushes carry none; bounds
    q = parse_push("i1", "1", {**meta, "local_step": 30, "rate": 5.2}, codecs.encode("f32", np.ones(n, np.float32)))
    assert read_reply(reply_for(c, q)).rhythm is None
    for bad in ([float("nan"), 1.0], [1.0, 0.0], [1.0, -2.0], [2e6, 1.0], [1.0], "x", [True, 1.0]):
        assert read_reply({**reply_meta(0, 0, "accepted"), "rhythm": bad}).rhythm is None
    assert parse_push("i0", "1", {**meta, "rate": 1e9, "pinned": 1}, b"").rate is None
    assert parse_push("i0", "1", {**meta, "rate": 1e9, "pinned": 1}, b"").pinned is False


def load_model():
    spec = importlib.util.spec_from_file_location("rounds_model", os.path.join(ROOT, "benchmarks", "rounds_model.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


NOISE = {"quiet": dict(jitter=0.0, lane=0.0, beat=0.0),
         # as real islands on a shared machine: step times 20% apart, pushes arriving 0.06-0.1 s (about a step of
         # the fastest) after their boundary, heartbeats every 7 s (pushes carry the step in between)
         "real": dict(jitter=0.2, lane=0.08, beat=7.0)}


@pytest.mark.parametrize("noise", sorted(NOISE))
@pytest.mark.parametrize("speeds", [(1.0, 0.52), (1.0, 0.45), (1.0, 0.8, 0.6), (1.0, 0.97)])
def test_islands_of_different_speeds_share_their_rounds_at_a_pinned_h(speeds, noise):
    rm = load_model()

    def run(stretch):
        a = argparse.Namespace(speeds=speeds, step_s=0.1, h=10, tau=5, checkpoint_every=20, max_base_lag=4,
                               seconds=90.0, quorum=None, grace=None, chaos=False, auto=False, min_quorum=None,
                               stretch=stretch, **NOISE[noise])
        return rm.Model(a, 0).run()
    kept, control = run(True), run(False)
    quiet = noise == "quiet"
    # two islands of about one speed under noise share less (0.76 measured): neither is clearly the slower, and an
    # island can follow the other's push only after its aim floor (0.85 N steps)
    share = 0.9 if quiet else (0.7 if speeds == (1.0, 0.97) else 0.85)
    assert kept["everyone"] >= share, kept
    assert kept["utilisation"] >= (0.99 if quiet else 0.95), kept                # nobody waits for the rhythm
    assert kept["weighted"] >= (0.97 if quiet else 0.95), kept
    if speeds != (1.0, 0.97):
        assert control["everyone"] <= 0.6, control                               # without it: split rounds
