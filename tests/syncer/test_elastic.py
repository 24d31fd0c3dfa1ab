"""Elastic rounds without sockets (a fake clock): a round never waits for an island that is down, the minimum quorum
counts the islands that are up, the pace window waits for an island whose own pace brings it within the others'
patience and not for one that is late or stalled, weights are checked and capped (a 10^12-token claim does not take
a merge), an island that joins mid-run enters the next round. Runtime: about 1 s."""
import logging

import numpy as np
import pytest

from yeto_patch.syncer.rounds import window
from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.syncer.rounds.pushes import ReceivedPush
from yeto_patch.syncer.rounds.weights import MAX_RATIO
from yeto_patch.wire import codecs

from .test_rounds import MAN, Clock

pytestmark = pytest.mark.timeout(60)


def elastic(islands, clock, weights="equal", quorum=None, grace_s=None, timeout_s=600.0):
    """A coordinator with the elastic defaults (no quorum, the adaptive window) unless told otherwise."""
    c = Coordinator(MergeSettings(weights=weights, outer="avg"),
                    RoundSettings(islands=islands, quorum=quorum, grace_s=grace_s, timeout_s=timeout_s, lease_s=30.0),
                    ChunkRunner(1), clock=clock, heartbeat_s=1.0)
    c.set_manifest(MAN, 1)
    c.init_fragment(0, np.zeros(c.frags[0].numel, np.float32))
    return c


def push(c, island, base, value=1.0, **kw):
    kw.setdefault("steps", 1)   # (a push of no new steps weighs nothing and answers no round)
    n = c.frags[0].numel
    return c.accept(ReceivedPush(island=island, fragment=0, base_version=base, codec="f32", block=256,
                         body=codecs.encode("f32", np.full(n, value, np.float32)), **kw))


def test_a_round_never_waits_for_an_island_that_is_down(caplog):
    clock = Clock()
    c = elastic(3, clock)
    for i in "abc":
        c.join(i, "1")
    assert c.rs.k == 2   # the minimum quorum
    push(c, "a", 0)
    push(c, "b", 0)
    assert c.due() == []                 # c is up: the window waits for it (a newcomer, no arrival history)
    c.disconnected("c", bye=False)       # its process died: the link is gone (its lease has not run out)
    assert c.due() == []                 # ... one heartbeat period to reconnect
    clock.t += 1.5
    assert c.due() == [0]                # every island that is up answered
    rec = c.merge(0)
    assert [r["island"] for r in rec.responders] == ["a", "b"] and rec.expected == ["a", "b"]
    # the minimum quorum counts islands that are up: with b down too, a alone merges
    c.disconnected("b", bye=False)
    clock.t += 1.5
    push(c, "a", 1)
    assert c.roster.floor(0, clock()) == 1 and c.due() == [0]
    c.merge(0)
    # a fixed roster's round waits past --round-timeout for a member that is down, and its waiting line says so
    f = elastic(3, clock, quorum=3, timeout_s=5.0)
    for i in "abc":
        f.join(i, "1")
    f.disconnected("b", bye=False)
    clock.t += 1
    f.disconnected("c", bye=False)
    push(f, "a", 0)
    clock.t += 6
    with caplog.at_level(logging.WARNING, logger="yeto.syncer"):
        assert f.due() == []
    line = [r.getMessage() for r in caplog.records if "waits" in r.getMessage()][-1]
    assert "missing b (down 7s), c (down 6s)" in line, line


def test_the_minimum_quorum_waits_for_islands_that_are_up():
    clock = Clock()
    c = elastic(4, clock, grace_s=0.0)
    for i in "abcd":
        c.join(i, "1")
    push(c, "a", 0)
    assert c.roster.floor(0, clock()) == 2 and c.due() == []   # below the quorum: waits ...
    assert c.next_deadline() == clock.t + 600.0                  # ... at most --round-timeout
    push(c, "b", 0)
    assert c.due() == [0]                # quorum of the islands that are up, grace 0


H, RATE = 10, 10.0   # steps between an island's pushes of the fragment, steps/s: one push a second


def _round(c, clock, arrivals, period=1.0, rates=None):
    """One round of fragment 0: each (island, offset) pushes at t0 + offset at its next boundary (H steps after its
    previous one), after a heartbeat saying its step and rate; merged at the end."""
    t0 = clock.t
    v = c.frags[0].version
    for island, dt in sorted(arrivals, key=lambda x: x[1]):
        clock.t = t0 + dt
        step = c.window.last_step.get((island, 0), 0) + H
        c.touch(island, step, (rates or {}).get(island, RATE))
        push(c, island, v, patience=0.5, local_step=step)
    rec = c.merge(0)
    assert rec.ok
    clock.t = t0 + period


def test_the_pace_window_waits_for_an_island_its_own_pace_brings_in_time():
    clock = Clock()
    c = elastic(4, clock)
    for i in "abcd":
        c.join(i, "1")
    for _ in range(3):
        _round(c, clock, [("a", 0.0), ("b", 0.05), ("c", 0.1), ("d", 0.15)])
    assert c.window.interval("b", 0) == H and c.window.period(0, c.members) == pytest.approx(H / RATE)
    t0 = clock.t
    c.touch("c", 38, RATE)          # c: 2 steps before its boundary at 40: 0.2 s away
    c.touch("d", 33, RATE)          # d: 7 steps away (0.7 s), beyond the others' patience (0.5 s)
    for i in "ab":
        c.touch(i, 40, RATE)
        push(c, i, 3, patience=0.5, local_step=40)
    push_c_at = t0 + 0.2 + window.SLACK_S
    assert c.due() == [] and c.next_deadline() == pytest.approx(push_c_at)
    clock.t = push_c_at
    assert c.due() == [0]                 # c did not come in time: merge without it (and without d)
    rec = c.merge(0)
    assert [r["island"] for r in rec.responders] == ["a", "b"]
    # the merge line and the tape say whom it went without, and why (what their pace said)
    assert set(rec.left_out) == {"c", "d"}, rec.left_out
    assert rec.left_out["c"].startswith("overdue by 0.00s") and "after the window closed" in rec.left_out["d"]
    assert "; without c: overdue" in rec.line() and rec.tape()["left_out"] == rec.left_out
    assert push(c, "c", 3, local_step=40)[0] == "carried"   # its late push goes into the next round
    # a newcomer (no pace yet) is waited for up to the deadline (a's patience, or half the fleet's period)
    c.disconnected("d", bye=True)
    c.join("e", "1")
    clock.t = t0 + 1.0
    push(c, "a", 4, patience=0.5, local_step=50)
    push(c, "b", 4, patience=0.5, local_step=50)
    assert c.next_deadline() == pytest.approx(clock.t + 0.5)
    # an island that restarts (new incarnation) starts a new pace
    c.join("b", "2")
    assert c.window.interval("b", 0) is None


def test_an_early_push_cannot_make_honest_islands_late():
    """Issue 35: a key holder pushing a zero delta with no patience the moment each base arrives made every honest
    island "always later than the window" (2 of 3 honest pushes carried at half weight). The window now follows each
    island's own pace: the honest islands' pushes stay on time; the control (no early pusher) is the same."""
    for hostile in (True, False):
        clock = Clock()
        c = elastic(4, clock)
        names = ["a", "b", "c"] + (["z"] if hostile else [])
        for i in names:
            c.join(i, "1")
        on_time = []
        for rnd in range(8):
            t0 = clock.t
            v = c.frags[0].version
            if hostile:   # pushes at once, claims no patience at all
                push(c, "z", v, 0.0, patience=1e-6, local_step=10 * (rnd + 1))
            for k, i in enumerate("abc"):
                clock.t = t0 + 0.1 * (k + 1)
                c.touch(i, 10 * (rnd + 1), RATE)
                push(c, i, v, patience=0.5, local_step=10 * (rnd + 1))
                for j in "abc"[k + 1:]:   # the others are on their way (their heartbeats say so)
                    c.touch(j, 10 * (rnd + 1) - (3 - k), RATE)
                if c.due():
                    break
            while not c.due():
                clock.t = c.next_deadline()
            rec = c.merge(0)
            on_time.append(sum(1 for r in rec.responders if r["island"] in "abc" and not r["carried"]))
            for i in "abc":   # whoever missed the round pushes late (carried)
                if i not in [r["island"] for r in rec.responders]:
                    push(c, i, v, local_step=10 * (rnd + 1))
            clock.t = t0 + 1.0
        assert on_time[2:] == [3] * 6, (hostile, on_time)


def test_a_silent_member_does_not_stall_a_round_past_the_round_timeout():
    """Issue 35: once the honest fleet was down to one island, a connected key holder that only sent heartbeats
    stalled that island's rounds indefinitely. --round-timeout now bounds every round that is not a fixed roster's."""
    clock = Clock()
    c = elastic(3, clock, timeout_s=20.0)
    for i in "ahz":
        c.join(i, "1")
    c.disconnected("a", bye=False)        # the honest fleet is down to h; z only sends heartbeats
    clock.t += 2
    push(c, "h", 0, local_step=10)
    for _ in range(19):
        c.touch("z", 5, RATE)
        clock.t += 1
        assert c.due() == []              # below the floor of 2 (z is up): it waits ...
    clock.t += 1.5
    c.touch("z", 5, RATE)
    assert c.due() == [0]                 # ... but not past --round-timeout
    assert [r["island"] for r in c.merge(0).responders] == ["h"]


def test_a_claim_of_10e12_tokens_does_not_take_a_merge():
    clock = Clock()
    c = elastic(4, clock, weights="tokens", quorum=4, grace_s=0.0)
    d = {"a": 1.0, "b": 2.0, "c": 3.0, "h": 50.0}   # h: an authenticated key holder claiming 10^12 tokens
    for i in d:
        c.join(i, "1")
    for rnd in range(3):   # the first round has nobody on record: weighed against the round at merge time
        for i, v in d.items():
            tokens = 10 ** 12 if i == "h" else 400
            push(c, i, rnd, v, steps=4, tokens=tokens, local_step=4 * (rnd + 1))
        rec = c.merge(0)
        w = {r["island"]: r["weight"] for r in rec.responders}
        assert w["a"] == w["b"] == w["c"] == 400.0, w
        assert w["h"] == MAX_RATIO * 400.0 and rec.responders[-1]["claimed"] >= 1e12
        share = w["h"] / rec.total_weight
        assert share <= MAX_RATIO / (MAX_RATIO + 3) + 1e-12, share
    # steps are checked against the island's step counter: 1,000 steps claimed after 4 more steps weigh 4
    push(c, "a", 3, steps=1000, tokens=100_000, local_step=16)
    assert c.rounds[0].answers["a"].claimed == 4 * 100.0   # tokens per step fixed at 400 / 4


def test_an_island_that_joins_mid_run_enters_the_next_round():
    clock = Clock()
    c = elastic(3, clock)
    c.join("a", "1")
    c.join("b", "1")
    for v in range(3):   # rounds every second of the islands there
        _round(c, clock, [("a", 0.0), ("b", 0.1)])
    c.join("c", "1")     # a new site, at v3: a newcomer is waited for (up to the window's deadline), nobody stalls
    t0 = clock.t
    push(c, "a", 3, patience=0.5, local_step=40)
    push(c, "b", 3, patience=0.5, local_step=40)
    assert c.due() == [] and c.next_deadline() == pytest.approx(t0 + 0.5)
    clock.t = t0 + 0.1
    push(c, "c", 3, patience=0.5)
    assert c.due() == [0]   # every island that is up answered
    assert sorted(r["island"] for r in c.merge(0).responders) == ["a", "b", "c"]


def test_an_island_that_stalls_while_connected_is_waited_for_again_once_it_moves():
    """An island that stays connected (heartbeats) but whose step stops moving is not waited for; the moment its
    step moves again it is (issue 35: it was "once late, always late")."""
    clock = Clock()
    c = elastic(3, clock)
    for i in "abc":
        c.join(i, "1")
    for _ in range(3):
        _round(c, clock, [("a", 0.0), ("b", 0.05), ("c", 0.1)])
    waits = []
    for rnd in range(3, 9):   # c stays connected but its step does not move (rounds 3-6), then moves again
        t0 = clock.t
        moving = rnd >= 7
        c.touch("c", 38 + 10 * (rnd - 3) if moving else 38, RATE)
        c.touch("a", 10 * (rnd + 1), RATE)
        push(c, "a", c.frags[0].version, patience=0.5, local_step=10 * (rnd + 1))
        c.touch("b", 10 * (rnd + 1), RATE)
        push(c, "b", c.frags[0].version, patience=0.5, local_step=10 * (rnd + 1))
        waits.append(round(c.next_deadline() - t0, 3))
        clock.t = c.next_deadline()
        assert c.due() == [0] and c.merge(0).ok
        clock.t = t0 + 1.0
    assert waits[0] > 0 and 0.0 in waits[1:4] and waits[-1] > 0, waits
