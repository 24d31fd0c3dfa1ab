"""The island's schedule with an H that may change (YETO_DILOCO_SYNC_EVERY=auto) and its phase catch-up
(island/boundary/schedule.py). Torch-free; runtime well under 1 s."""
import pytest

from yeto_patch import config
from yeto_patch.island.boundary.schedule import (MAX_STRETCH, STRETCH_DEADBAND, AIM_BEHIND, AIM_SOONER, aim_floor,
                                                 follow, hold, Cadence, aim, catch_up, due_fragments, reply_aims,
                                                 keep_rhythm, offset, respread, stretch, suggest)


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


def test_stretch_takes_the_steps_of_the_rhythm_islands_period_within_bounds():
    assert stretch(10, 5, rate=10.0, period_s=10 / 5.2, current=10) == 19     # 0.52 of the speed: 19 steps
    assert stretch(10, 5, rate=10.0, period_s=5.0, current=10) == 10 * MAX_STRETCH   # at most 3x
    assert stretch(10, 5, rate=10.0, period_s=0.5, current=10) == 10          # never below N (N is the slowest's)
    assert stretch(10, 5, rate=10.0, period_s=None, current=19) == 10         # no rhythm: N again
    assert stretch(10, 5, rate=10.0, period_s=1.05, current=10) == 10         # a change below 10%: kept
    assert stretch(10, 12, rate=10.0, period_s=1.0, current=10) == 13         # tau + 1 at least
    # within STRETCH_DEADBAND of the rhythm island's speed: N (its aims keep the phase; a noisy rate made H flip)
    assert STRETCH_DEADBAND == 0.25
    assert stretch(10, 5, rate=10.0, period_s=1.2, current=10) == 10
    assert stretch(10, 5, rate=10.0, period_s=1.3, current=10) == 13


def test_aim_lands_the_next_boundary_just_after_the_rhythm_islands_push():
    # the rhythm island pushes in 0.05 s, every 1.923 s: this push shares its round; the one after is aimed at, and
    # AIM_BEHIND steps more: the rhythm island's push, with its longer patience, opens the round and this island
    # follows it at once (follow) or comes within the wait the round gives it
    assert AIM_BEHIND == 2
    assert aim(0.05, 1.923, rate=10.0, lo=6, hi=40) == 20 + 2
    assert aim(1.9, 1.923, rate=10.0, lo=6, hi=40) == 19 + 2    # it pushed just before: its next push
    assert aim(-0.5, 1.923, rate=10.0, lo=6, hi=40) == 14 + 2   # overdue by 0.5 s: the same phase, 1.42 s on
    assert aim(5.0, 1.923, rate=10.0, lo=6, hi=40) == 12 + 2    # periods ahead: the same phase (1.15 s)
    assert aim(0.05, 1.923, rate=10.0, lo=6, hi=15) == 15 and aim(9.9, 10.0, rate=0.5, lo=6, hi=40) == 5 + 2
    assert aim(1.0, 1.9, rate=0.0, lo=6, hi=40) is None
    # aimed every time, its boundaries stay AIM_BEHIND steps after the rhythm island's pushes at a rate that is
    # not a whole multiple
    t, step, rate, period = AIM_BEHIND / 10.0, 0, 10.0, 10 / 5.2   # (its last push: that much after one of it)
    for _ in range(50):
        steps = aim(period - (t % period), period, rate, 6, 40)   # (its pushes at whole periods)
        step, t = step + steps, t + steps / rate
        x = t - AIM_BEHIND / rate
        assert min(x % period, period - x % period) <= 0.5 / rate + 1e-9   # within half a step


def test_an_island_as_fast_as_the_rhythm_one_aims_at_its_pushes_not_between_them():
    # a little sooner than H is allowed (the rhythm island, the slowest by noisy rates, may be a little faster)
    assert AIM_SOONER == 0.15 and aim_floor(10, 5) == 9 and aim_floor(10, 9) == 10
    # the rhythm island (1 s per period, this island's speed) pushes in 0.6 s: 6 steps, too soon for the floor (9):
    # its push after that (16 steps), not the floor, which would land between its pushes
    assert aim(0.6, 1.0, rate=10.0, lo=9, hi=40) == 16 + AIM_BEHIND
    # 0.8 steps sooner than the floor: at it (a step late is waited for)
    assert aim(0.82, 1.0, rate=10.0, lo=9, hi=40) == max(9, 8 + AIM_BEHIND)


def test_a_round_the_rhythm_island_opened_pulls_a_near_boundary_in():
    c = Cadence(10, 2, 0)
    c.passed(5)
    assert c.next == [15, 10] and c.last == [5, None]
    c.passed(6)
    assert c.next == [15, 10] and c.last == [5, None]
    # fragment 1's round was opened 0.2 s ago by the rhythm island: its boundary (step 10, 4 steps away) comes now
    assert follow({1: 0.2}, c, 6, lo=9, period_s=1.0) == {1: 7}
    assert follow({1: 0.6}, c, 6, lo=9, period_s=1.0) == {}        # opened more than half a period ago: stale
    assert follow({1: 0.2}, c, 4, lo=9, period_s=1.0) == {}        # 6 steps away: more than H / 2
    assert follow({0: 0.2}, c, 12, lo=9, period_s=1.0) == {}       # fragment 0 pushed at 5: not before 14
    assert follow({0: 0.2}, c, 13, lo=9, period_s=1.0) == {0: 14}
    assert follow({7: 0.1, -1: 0.1}, c, 6, lo=9, period_s=1.0) == {}   # no such fragment
    c.aim(1, 7)
    c.passed(6)
    assert c.next[1] == 7 and c.due(7) == [1]


def test_a_boundary_due_before_the_rhythm_islands_push_waits_for_it_at_most_the_limit():
    held = {}
    assert hold([0, 1], {1: 0.1}, held, limit=2) == [0]          # 1's round is open: it pushes; 0 waits a step
    assert held == {0: 1}
    assert hold([0], {}, held, limit=2) == [0] and held == {0: 2}
    assert hold([0], {}, held, limit=2) == [] and held == {}      # waited its limit: it pushes (and is forgotten)
    assert hold([0], {}, held, limit=0) == []                     # no waiting at all


@pytest.mark.parametrize("h,p", [(10, 4), (20, 4), (12, 3), (100, 8)])
def test_an_island_with_no_rhythm_to_keep_spreads_its_bunched_fragments_again(h, p):
    """Aims, follows and holds can bunch an island's fragments on one step (two islands of one speed swapping the
    rhythm role pushed all four at once); the rhythm island (no rhythm to keep) moves each pushing fragment's next
    boundary back towards its own phase of H, at most a fifth of H per push, until the schedule is the plain one."""
    c = Cadence(h, p, 0)
    for f in range(p):
        c.aim(f, 7)                      # every fragment bunched on step 7
    c.passed(0)
    assert c.next == [7] * p
    most = max(1, h // 5)
    for step in range(1, 12 * h):
        due = c.due(step)
        h2, shift = keep_rhythm(h, 2, 5.0, {}, c.h, due, step, p)
        assert h2 == h and set(shift) <= set(due)
        assert all(abs(k) <= most for k in shift.values())
        for f, k in shift.items():
            c.shift(f, k)
        c.passed(step)
    assert [c.next[f] % h for f in range(p)] == [offset(f, h, p) for f in range(p)]
    for step in range(12 * h, 14 * h):   # spread again: the plain modulo schedule, no more shifts
        assert c.due(step) == due_fragments(step, h, p)
        assert keep_rhythm(h, 2, 5.0, {}, c.h, c.due(step), step, p)[1] == {}
        c.passed(step)


def test_respread_takes_the_nearer_way_and_is_left_alone_with_a_rhythm_or_no_fragment_count():
    # (a positive shift brings the next boundary earlier) fragment 0 of 4 at H=10 has phase 2 (mod 10)
    assert respread(0, 10, 10, 4) == -2      # next at 20 plain: 22 is 2 later
    assert respread(0, 12, 10, 4) == 0       # 22 plain: on its phase
    assert respread(0, 13, 10, 4) == 1       # 23 plain: 22 is one earlier
    assert respread(0, 19, 10, 4) == -2      # 29 plain: 32 is 3 later (22: 7 earlier), at most a fifth of H per push
    assert keep_rhythm(10, 2, 5.0, {}, 10, [0], 10, 0)[1] == {}           # fragments 0: left alone
    assert 0 not in keep_rhythm(10, 2, 5.0, {1: (1.0, 2.0)}, 10, [0], 10, 4)[1]   # a rhythm to keep: not spread


def test_a_push_reply_aims_the_next_boundary_once_per_push():
    c = Cadence(20, 4, 0)
    aimed = {}
    aims = {0: (3, 0.05, 1.923), 1: (2, 1.0, 1.923), 2: (5, 1.0, 1.923)}
    pushes = {0: (3, 100), 1: (4, 100)}            # fragment 1's reply is of an older push; 2 has no push
    assert reply_aims(aims, pushes, aimed, 10.0, 10, 38, 101) == {0: 122}  # 0.05 + 1.923 s after step 100, + 2
    assert reply_aims(aims, pushes, aimed, 10.0, 10, 38, 102) == {}        # once per push
    c.aim(0, 120)
    c.passed(102)
    assert c.next[0] == 120
    c.aim(1, 50)                                   # never before the next step
    c.passed(103)
    assert c.next[1] == 104


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
