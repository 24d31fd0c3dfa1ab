"""Lock-step rounds across speeds (issue 35, item 5): with ``--quorum`` every round waits for its islands, so an
island that pinned the same H as a slower one trains at the slower one's pace; the syncer says, once per island,
the H that lets it train at its own (its steps in the slowest island's round). Elastic rounds stretch a pinned H
by timing and say nothing. Runtime: under a second."""
import logging

import numpy as np
import pytest

from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.rounds import lockstep
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.wire.values import Schedule

from .test_rounds import MAN, Clock

P = lockstep.Pace


def test_the_fast_island_is_told_its_steps_in_the_slowest_round():
    # Megatron-LM here: TP2 at 85 ms per step, PP2 at 52, both H = 10
    (h,) = lockstep.suggest([P("a", 10, 1 / 0.085), P("b", 10, 1 / 0.052)])
    assert (h.island, h.slowest, h.sync_every, h.suggested) == ("b", "a", 10, 16)
    assert h.wait_share == pytest.approx(1 - 0.52 / 0.85, rel=1e-6)   # b waits 39% of its time


def test_islands_already_matched_or_alone_are_not_advised_and_h_is_never_lowered():
    assert lockstep.suggest([P("a", 10, 11.8), P("b", 16, 19.2)]) == []   # 0.847 s against 0.833 s: within 10%
    assert lockstep.suggest([P("a", 10, 11.8)]) == []
    # the slowest round is b's (H pinned far too high): a is told to push less often, never b more often
    (h,) = lockstep.suggest([P("a", 10, 11.8), P("b", 40, 19.2)])
    assert h.island == "a" and h.suggested == round(40 / 19.2 * 11.8) and h.suggested > 10
    # three islands: each faster one gets its own H
    hints = {x.island: x.suggested for x in lockstep.suggest([P("a", 10, 5.0), P("b", 10, 10.0), P("c", 10, 7.5)])}
    assert hints == {"b": 20, "c": 15}


def test_advice_says_each_island_once_after_a_minute_of_waiting_with_its_median_h():
    adv = lockstep.Advice()
    rates = [19.2, 30.0, 19.0, 18.0, 19.5, 19.2]   # one swing: 30 steps/s for a moment
    said = []
    for k, r in enumerate(rates):
        said += adv.new(lockstep.suggest([P("a", 10, 11.8), P("b", 10, r)]), now=12.0 * k)
    (h,) = said                                     # at 60 s, once
    assert h.island == "b" and h.suggested == 16    # the median, not the swing's 25
    assert adv.new(lockstep.suggest([P("a", 10, 11.8), P("b", 10, 25.0)]), now=200.0) == [] and len(adv) == 1


def test_a_streak_that_breaks_starts_again_and_advice_is_bounded():
    adv = lockstep.Advice(settle_s=60.0)
    hint = lockstep.suggest([P("a", 10, 11.8), P("b", 10, 19.2)])
    assert adv.new(hint, now=0.0) == [] and adv.new(hint, now=10.0) == []
    assert adv.new([], now=30.0) == []              # not waiting for 20 s (> 60 / 4): the streak broke
    for t in (61.0, 73.0, 85.0, 97.0, 109.0):       # a new streak from 61 s, hinted every 12 s
        assert adv.new(hint, now=t) == []
    assert [h.island for h in adv.new(hint, now=121.0)] == ["b"]
    many = lockstep.Advice(settle_s=0.0)
    for k in range(lockstep.MAX_SAID + 5):
        many.new(lockstep.suggest([P("slow", 10, 1.0), P(f"i{k}", 10, 2.0)]), now=float(k))
    assert len(many) == lockstep.MAX_SAID


def fleet(quorum):
    clock = Clock()
    c = Coordinator(MergeSettings(weights="equal", outer="avg"),
                    RoundSettings(islands=2, quorum=quorum, timeout_s=600.0, lease_s=30.0),
                    ChunkRunner(1), clock=clock, heartbeat_s=1.0)
    c.set_manifest(MAN, 1)
    c.init_fragment(0, np.zeros(c.frags[0].numel, np.float32))
    for island in ("a", "b"):
        c.join(island, "1")
    return c


@pytest.mark.parametrize("quorum", [2, None])
def test_the_syncer_logs_the_advice_with_a_quorum_only(quorum, caplog):
    c = fleet(quorum)
    with caplog.at_level(logging.INFO, logger="yeto.syncer"):
        for k in range(8):   # heartbeats over 70 s: said once, a minute into b's waiting
            c.touch("a", 20 + 10 * k, 11.8, True, Schedule(10, (30 + 10 * k,)))
            c.touch("b", 20 + 10 * k, 19.2, True, Schedule(10, (30 + 10 * k,)))
            c.clock.t += 10.0
    said = [r.getMessage() for r in caplog.records if "YETO_DILOCO_SYNC_EVERY=" in r.getMessage()]
    if quorum is None:   # elastic rounds stretch b's H by timing (schedule.stretch)
        assert said == []
    else:
        assert len(said) == 1 and "island 'b'" in said[0] and "YETO_DILOCO_SYNC_EVERY=16" in said[0], said


def test_no_advice_for_an_island_that_follows_the_pace_or_finished(caplog):
    c = fleet(2)
    with caplog.at_level(logging.INFO, logger="yeto.syncer"):
        c.touch("a", 20, 11.8, True, Schedule(10, (30,)))
        c.touch("b", 20, 19.2, False, Schedule(10, (30,)))   # YETO_DILOCO_SYNC_EVERY=auto: no pinned H
    assert not any("YETO_DILOCO_SYNC_EVERY=" in r.getMessage() for r in caplog.records)
    assert c.roster.lockstep(c.clock()) == []
    c.members["b"].pinned = True
    assert [h.island for h in c.roster.lockstep(c.clock())] == ["b"]
    c.members["b"].finished = True
    assert c.roster.lockstep(c.clock()) == []
