"""How long an island waits for its syncer (island/link/patience.py), with a fake clock. Torch-free; runtime
well under 1 s."""
import logging

import pytest

from yeto_patch.island.errors import EngineError
from yeto_patch.island.link.patience import Patience, StepClock


class FakeLink:
    def __init__(self):
        self.up = True

    def reachable(self):
        return self.up

    def waiting_on(self):
        return "open rounds fragment 0 on v3 (1 answered, quorum 2); waiting for islands b (down 70s)"


def test_patience_waits_while_the_syncer_is_alive_and_fails_once_it_is_unreachable(caplog):
    t = [0.0]
    link = FakeLink()
    p = Patience(20.0, link, "the base of fragment 0 newer than v3", "the syncer at s:1", clock=lambda: t[0])
    with caplog.at_level(logging.WARNING, logger="yeto_patch"):
        for _ in range(30):          # 15 minutes of a syncer that is alive: no error, a line a minute
            t[0] += 30.0
            p.check()
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(lines) == 15 and "the syncer is alive" in lines[0] and "b (down 70s)" in lines[0]
    link.up = False
    t[0] += 19.0
    p.check()                        # unreachable for 19 s: still within YETO_DILOCO_TIMEOUT
    t[0] += 2.0
    with pytest.raises(EngineError, match=r"timed out after 20s \(YETO_DILOCO_TIMEOUT\) waiting for the base of "
                                          r"fragment 0 newer than v3 .* unreachable for 21s"):
        p.check()


def test_the_step_clock_measures_the_compute_rate_without_the_waits():
    t = [0.0]
    c = StepClock(clock=lambda: t[0])
    for step in range(1, 40):
        t[0] += 30.0 if step % 10 == 0 else 0.5   # a long wait every 10 steps
        c.stepped(step)
    assert c.step == 39 and c.step_s == pytest.approx(0.5) and c.rate == pytest.approx(2.0)


def test_the_step_clock_says_no_rate_from_its_first_steps():
    """The first steps compile and warm up: a rate from them would make an island look several times slower."""
    t = [0.0]
    c = StepClock(clock=lambda: t[0])
    for step in range(1, 9):
        t[0] += 3.0 if step <= 2 else 0.5
        c.stepped(step)
        assert c.rate == 0.0 and (step == 1 or c.step_s is not None)   # (patience still has a step time)
    for step in range(9, 12):
        t[0] += 0.5
        c.stepped(step)
    assert c.rate == pytest.approx(2.0)


def test_the_step_clock_leaves_out_the_work_after_each_step():
    """An island that pushes every step or two waits at its tau bound after most steps: the time from a step's end
    to ``resumed`` (installs, hand-overs, waits for other islands) is not compute, whichever share of steps waits."""
    t = [0.0]
    c = StepClock(clock=lambda: t[0])
    for step in range(1, 40):
        t[0] += 0.25                   # compute
        c.stepped(step)
        t[0] += 1.0 if step % 3 else 0.0   # waits after 2 steps in 3
        c.resumed()
    assert c.step_s == pytest.approx(0.25) and c.rate == pytest.approx(4.0)
    c2 = StepClock(clock=lambda: t[0])   # without resumed: the median is the wait
    for step in range(1, 40):
        t[0] += 0.25
        c2.stepped(step)
        t[0] += 1.0 if step % 3 else 0.0
    assert c2.rate == pytest.approx(0.8)
    c.resumed()   # (said twice, or before any step: harmless)
    StepClock(clock=lambda: t[0]).resumed()
