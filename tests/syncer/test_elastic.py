"""Elastic rounds without sockets (a fake clock): a round never waits for an island that is down, the minimum quorum
counts the islands that are up, the adaptive grace window waits for islands that usually make it and not for one
that is always late, weights are checked and capped (a 10^12-token claim does not take a merge), an island that
joins mid-run enters the next round. Runtime: about 1 s."""
import logging

import numpy as np
import pytest

from yeto_patch.syncer.rounds import window as grace
from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.settings import MergeSettings, Push, RoundSettings
from yeto_patch.syncer.rounds.weights import MAX_RATIO
from yeto_patch.wire import codecs

from .test_rounds import MAN, Clock

pytestmark = pytest.mark.timeout(60)


def elastic(islands, clock, weights="equal", quorum=None, grace_s=None, timeout_s=600.0):
    """A coordinator with the elastic defaults (no quorum, the adaptive window) unless told otherwise."""
    c = Coordinator(MergeSettings(weights=weights, outer="avg"),
                    RoundSettings(islands=islands, quorum=quorum, grace_s=grace_s, timeout_s=timeout_s, lease_s=30.0),
                    ChunkRunner(1), clock=clock)
    c.roster.heartbeat_s = 1.0
    c.set_manifest(MAN, 1)
    c.init_fragment(0, np.zeros(c.frags[0].numel, np.float32))
    return c


def push(c, island, base, value=1.0, **kw):
    n = c.frags[0].numel
    return c.accept(Push(island=island, fragment=0, base_version=base, codec="f32", block=256,
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
    # the fixed roster would have named c (down) in its waiting line; elastic rounds say who is down too
    c.rs = RoundSettings(islands=3, quorum=3, timeout_s=5.0, lease_s=30.0)
    push(c, "a", 2)
    clock.t += 6
    with caplog.at_level(logging.WARNING, logger="yeto.syncer"):
        assert c.due() == []
    line = [r.getMessage() for r in caplog.records if "waits" in r.getMessage()][-1]
    assert "missing b (down 8s), c (down 9s)" in line, line


def test_the_minimum_quorum_waits_for_islands_that_are_up():
    clock = Clock()
    c = elastic(4, clock, grace_s=0.0)
    for i in "abcd":
        c.join(i, "1")
    push(c, "a", 0)
    assert c.roster.floor(0, clock()) == 2 and c.due() == [] and c.next_deadline() is None   # below the quorum
    push(c, "b", 0)
    assert c.due() == [0]                # quorum of the islands that are up, grace 0


def _round(c, clock, arrivals, period=2.0):
    """One round of fragment 0: each (island, offset) pushes at t_first + offset; merged at the end."""
    t0 = clock.t
    v = c.frags[0].version
    for island, dt in sorted(arrivals, key=lambda x: x[1]):
        clock.t = t0 + dt
        push(c, island, v, patience=1.0)
    rec = c.merge(0)
    assert rec.ok
    clock.t = t0 + period


def test_the_adaptive_window_waits_for_usual_arrivals_not_for_late_ones():
    clock = Clock()
    c = elastic(4, clock)
    for i in "abcd":
        c.join(i, "1")
    usual = [("a", 0.0), ("b", 0.05), ("d", 0.2), ("c", 1.5)]   # c: always 1.5 s after the round's first push
    for _ in range(grace.MIN_SAMPLES + 1):
        _round(c, clock, usual)
    assert c.arrivals.period(0) == pytest.approx(2.0)
    assert c.arrivals.predicted("d") == pytest.approx(0.2) and c.arrivals.predicted("c") == pytest.approx(1.5)
    # bound: min(patience 1.0 s, a quarter of the 2 s period) = 0.5 s: d is waited for, c is not
    t0 = clock.t
    push(c, "a", 4, patience=1.0)
    clock.t = t0 + 0.05
    push(c, "b", 4, patience=1.0)
    assert c.due() == [] and c.next_deadline() == pytest.approx(t0 + 0.2 * grace.MARGIN + grace.SLACK_S)
    clock.t = c.next_deadline()
    assert c.due() == [0]                 # d did not come in time: merge without it (and without c)
    assert [r["island"] for r in c.merge(0).responders] == ["a", "b"]
    assert push(c, "d", 4)[0] == "carried"   # its late push goes into the next round
    # a newcomer (no arrival history) is waited for up to the bound
    clock.t = t0 + 2.0
    c.arrivals.forget("d")   # (as if d were new)
    push(c, "a", 5, patience=1.0)
    push(c, "b", 5, patience=1.0)
    assert c.next_deadline() == pytest.approx(clock.t + 0.5)
    # an island that restarts (new incarnation) starts a new arrival history
    c.join("b", "2")
    assert c.arrivals.predicted("b") is None


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
    assert c.frags[0].round.contribs["a"].claimed == 4 * 100.0   # tokens per step fixed at 400 / 4


def test_an_island_that_joins_mid_run_enters_the_next_round():
    clock = Clock()
    c = elastic(3, clock)
    c.join("a", "1")
    c.join("b", "1")
    for v in range(3):   # rounds every 2 s of the islands there
        _round(c, clock, [("a", 0.0), ("b", 0.1)])
    c.join("c", "1")     # a new site, at v3: a newcomer is waited for (up to the window's bound), nobody stalls
    t0 = clock.t
    push(c, "a", 3, patience=1.0)
    push(c, "b", 3, patience=1.0)
    assert c.due() == [] and c.next_deadline() == pytest.approx(t0 + 0.5)
    clock.t = t0 + 0.1
    push(c, "c", 3, patience=1.0)
    assert c.due() == [0]   # every island that is up answered
    assert sorted(r["island"] for r in c.merge(0).responders) == ["a", "b", "c"]


def test_an_island_that_stalls_while_connected_stops_being_waited_for():
    clock = Clock()
    c = elastic(3, clock)
    for i in "abc":
        c.join(i, "1")
    for _ in range(grace.MIN_SAMPLES + 1):
        _round(c, clock, [("a", 0.0), ("b", 0.1), ("c", 0.2)])
    waits = []
    for _ in range(grace.MIN_SAMPLES + 1):   # c stays connected (heartbeats) but pushes nothing any more
        t0 = clock.t
        push(c, "a", c.frags[0].version, patience=1.0)
        push(c, "b", c.frags[0].version, patience=1.0)
        c.touch("c")
        waits.append(round(c.next_deadline() - t0, 3))
        clock.t = c.next_deadline()
        assert c.due() == [0] and c.merge(0).ok
        clock.t = t0 + 2.0
    assert waits[0] == pytest.approx(0.2 * grace.MARGIN + grace.SLACK_S) and waits[-1] == 0.0, waits
