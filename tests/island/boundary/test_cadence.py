"""The island's schedule with an H that may change (YETO_DILOCO_SYNC_EVERY=auto) and its phase catch-up
(island/boundary/schedule.py). Torch-free; runtime well under 1 s."""
import pytest

from yeto_patch import config
from yeto_patch.island.boundary.schedule import Cadence, catch_up, due_fragments, suggest


@pytest.mark.parametrize("h,p,start", [(4, 2, 0), (10, 3, 0), (3, 5, 0), (100, 8, 37), (1, 2, 5)])
def test_a_fixed_cadence_is_the_modulo_schedule(h, p, start):
    c = Cadence(h, p, start)
    for step in range(start + 1, start + 5 * h + 3):
        assert c.due(step) == due_fragments(step, h, p), step
        c.passed(step)


def test_retune_and_shift_move_the_next_boundaries():
    c = Cadence(20, 4, 0)
    assert [c.next[f] for f in range(4)] == [5, 10, 15, 20]
    for step in range(1, 6):
        c.passed(step)
    assert c.next[0] == 25
    c.retune(10)          # from the next boundaries on: 10 steps after each fragment's previous one
    c.passed(6)
    assert c.h == 10 and c.next == [15, 7, 7, 10]   # previous boundaries 5, 0 (-10), 0 (-5), 0; at least step 7
    c.shift(0, 4)         # fragment 0 was late: its next boundary comes 4 steps earlier
    c.passed(7)
    assert c.next[0] == 11 and c.due(11) == [0]


def test_suggest_follows_the_fleet_pace_within_bounds():
    assert suggest(20, 5, rate=5.0, pace=10.0, current=20) == 10      # half the pace: half the steps
    assert suggest(20, 5, rate=1.0, pace=10.0, current=20) == 6       # never below tau + 1
    assert suggest(20, 5, rate=20.0, pace=10.0, current=20) == 20     # never above the nominal H
    assert suggest(20, 5, rate=9.6, pace=10.0, current=20) == 20      # a change below 10% of H: kept
    assert suggest(20, 5, rate=0.0, pace=10.0, current=13) == 13      # nothing known: kept
    assert catch_up(0.35, 0.1, 20) == 4 and catch_up(0.35, 0.1, 20, tau=5) == 8   # late + tau steps earlier
    assert catch_up(30.0, 0.1, 20) == 10 and catch_up(1.0, None, 20) == 0            # at most H / 2


def test_sync_every_auto_in_the_one_table():
    env = {"YETO_DILOCO_SYNCER": "127.0.0.1:1", "YETO_DILOCO_INSECURE": "1"}
    s = config.from_env({**env, "YETO_DILOCO_SYNC_EVERY": "auto"})
    assert (s.sync_every, s.sync_auto, s.overlap_steps) == (config.AUTO_H, True, 5)
    s = config.from_env({**env, "YETO_DILOCO_SYNC_EVERY": "auto:20"})
    assert (s.sync_every, s.sync_auto) == (20, True) and ("YETO_DILOCO_SYNC_EVERY", "auto:20") in s.as_table()
    assert not config.from_env({**env, "YETO_DILOCO_SYNC_EVERY": "20"}).sync_auto
    with pytest.raises(config.ConfigError, match="YETO_DILOCO_SYNC_EVERY='auto:0'"):
        config.from_env({**env, "YETO_DILOCO_SYNC_EVERY": "auto:0"})
