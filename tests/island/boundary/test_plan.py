"""plan(): what happens at a step, from the schedule and the fragments' state alone (no torch, no processes)."""
import json

import numpy as np
import pytest

from yeto_patch.island.boundary.fragment import Fragments, PushPhase
from yeto_patch.island.boundary.plan import (BaseSpec, InstallRule, Plan, base_spec, needs_plan, overdue, plan)
from yeto_patch.island.boundary.schedule import due_fragments
from yeto_patch.island.errors import EngineError
from yeto_patch.wire.client import Base

TAU0 = InstallRule(0, 0.5)
TAU2 = InstallRule(2, 0.5)


def states(P=3, anchor=1):
    fs = Fragments([[f] for f in range(P)], [2] * P, [2] * P)
    for st in fs:
        st.installed(anchor)
    return fs


def base(f, v, **kw):
    return Base(f, v, "f32", np.zeros(2, np.float32), **kw)


def pushed(frag, step, at_syncer=True):
    frag.begin_push(step)
    if at_syncer:
        frag.push_handed(None)


def test_most_steps_need_no_plan():
    assert not needs_plan(3, 10, [], False)
    assert needs_plan(3, 10, [1], False)
    assert needs_plan(3, 10, [], True)
    assert needs_plan(10, 10, [], False)


def test_due_fragments_push_and_an_arrived_newer_base_is_staged():
    fs = states()
    fs[2].side.arrived = base(2, 2)
    p = plan(5, 100, [0], fs, False, TAU2)
    assert (p.push, p.skip, p.final, p.by_syncer) == ([0], [], False, False)
    assert p.stage == [BaseSpec(2, 2)] and p.install == [] and p.arm == []


def test_a_fragment_that_pushes_now_does_not_take_its_newer_base_first():
    fs = states()
    fs[0].side.arrived = base(0, 4)
    p = plan(5, 100, [0], fs, False, TAU2)
    assert p.push == [0] and p.stage == [] and p.install == []
    fs[0].side.adopt = True   # unless the syncer is behind: its base is installed (synchronously) first
    assert plan(5, 100, [0], fs, False, TAU2).install == [BaseSpec(0, 4)]


def test_a_base_arriving_while_the_push_is_in_the_lane_waits_for_the_push():
    fs = states()
    pushed(fs[1], 4, at_syncer=False)
    fs[1].side.arrived = base(1, 2)            # merged without this island while its push is still gathered
    fs[2].side.arrived = base(2, 2)
    assert plan(5, 100, [], fs, False, TAU2).stage == [BaseSpec(2, 2)]
    fs[1].push_handed(None)                    # handed to the link: the base made before it is not its answer
    assert plan(5, 100, [], fs, False, TAU2).stage == [BaseSpec(1, 2, answers=False), BaseSpec(2, 2)]


def test_an_old_or_equal_base_is_not_staged():
    fs = states(anchor=3)
    fs[1].side.arrived = base(1, 3)
    p = plan(5, 100, [], fs, False, TAU2)
    assert p.stage == [] and p.install == []


def test_restart_skips_boundaries_merged_before_it():
    fs = states()
    fs[1].skip = 1
    p = plan(5, 100, [0, 1], fs, False, TAU2)
    assert p.push == [0] and p.skip == [1]


def test_last_step_is_the_final_cut_and_stages_nothing():
    fs = states()
    fs[2].side.arrived = base(2, 5)
    p = plan(100, 100, [0], fs, False, TAU2)
    assert p.final and p.push == [] and p.stage == [] and p.install == []


def test_the_syncers_final_cut_installs_nothing_and_pushes_nothing():
    fs = states()
    fs[2].side.arrived = base(2, 5)
    fs[2].side.adopt = True
    p = plan(7, 100, [0], fs, True, TAU2)
    assert (p.final, p.by_syncer, p.push, p.install, p.stage) == (True, True, [], [], [])


def test_plan_round_trips_through_json_with_named_fields():
    p = Plan([0, 1], [3], False, False, [BaseSpec(2, 5, 1, True)], [BaseSpec(1, 4)], [0])
    d = json.loads(json.dumps(p.as_json()))
    assert d["install"] == [{"fragment": 2, "version": 5, "updates": 1, "own_weights": True, "answers": True}]
    assert Plan.from_json(d) == p
    auto = Plan([0], sync_every=12, shift={0: 3})   # YETO_DILOCO_SYNC_EVERY=auto: rank 0's H and catch-up
    d = json.loads(json.dumps(auto.as_json()))
    assert (d["sync_every"], d["shift"]) == (12, {"0": 3}) and Plan.from_json(d) == auto


def test_base_spec_of_updates_checks_they_apply_to_the_anchor():
    from yeto_patch.wire import codecs
    fs = states(anchor=2)
    body = codecs.encode("int8", np.ones(2, np.float32), 256)
    fs[0].side.arrived = Base(0, 4, "int8", None, deltas=(("int8", 256, body),) * 2, start=2, size=2)
    assert base_spec(fs[0]) == BaseSpec(0, 4, 2, False)
    fs[1].side.arrived = Base(1, 4, "int8", None, deltas=(("int8", 256, body),), start=3, size=2)
    with pytest.raises(EngineError, match="applies to v3, but this island's anchor is v2"):
        base_spec(fs[1])
    fs[1].side.arrived.held = True   # the base is the weights held: no anchor needed
    assert base_spec(fs[1]) == BaseSpec(1, 4, 1, True)


def test_overdue_at_the_push_step_plus_tau():
    fs = states()
    pushed(fs[0], 10)
    pushed(fs[2], 12)
    assert overdue(11, TAU2, fs) == []
    assert overdue(12, TAU2, fs) == [0]
    assert overdue(14, TAU2, fs) == [0, 2]
    assert overdue(12, TAU0, fs) == [0, 2]


def test_a_run_of_steps_pushes_each_fragment_once_per_H():
    fs, H, pushes = states(4), 8, []
    for step in range(1, 33):
        due = due_fragments(step, H, len(fs))
        if needs_plan(step, 32, due, False):
            p = plan(step, 32, due, fs, False, TAU2)
            pushes += [(step, f) for f in p.push]
    assert sorted(f for _, f in pushes) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 3   # step 32: the final cut


def test_an_unasked_base_is_staged_then_armed_once_rank_0s_part_is_ready():
    fs = states()
    fs[2].side.arrived = base(2, 2)
    p = plan(5, 100, [], fs, False, TAU2)
    assert p.stage == [BaseSpec(2, 2)] and p.arm == []
    fs[2].side.arrived = None
    fs[2].stage(2, 0)                                    # what the engine does with that plan
    assert plan(6, 100, [], fs, False, TAU2).arm == []   # still in the background
    fs[2].side.arrived = base(2, 3)                      # a newer base waits: nothing else enters a staged fragment
    p = plan(7, 100, [], fs, False, TAU2, ready={2})
    assert p.arm == [2] and p.stage == [] and p.install == []


def test_an_answer_is_armed_exactly_at_the_push_step_plus_tau_however_early_it_is_ready():
    fs = states()
    pushed(fs[0], 10)
    fs[0].stage(2, 0)   # the answer arrived and was staged at once (a quiet machine)
    assert [plan(s, 100, [], fs, False, TAU2, ready={0}).arm for s in (11, 12, 13)] == [[], [0], [0]]
    assert plan(10, 100, [], fs, False, TAU0, ready={0}).arm == [0]   # tau = 0: at the push's own step


def test_a_staged_base_of_a_fragment_pushing_now_waits_and_answers_that_push():
    fs = states()
    fs[0].stage(2, 0)
    p = plan(5, 100, [0], fs, False, TAU2, ready={0})
    assert p.push == [0] and p.arm == []
    pushed(fs[0], 5)
    assert fs[0].answered()
    assert plan(6, 100, [], fs, False, TAU2, ready={0}).arm == []
    assert plan(7, 100, [], fs, False, TAU2, ready={0}).arm == [0]


def test_adoptions_own_weights_and_the_final_cut_install_synchronously():
    fs = states()
    fs[0].side.arrived, fs[0].side.adopt = base(0, 0), True            # the syncer is behind a restarted island
    fs[1].side.arrived = Base(1, 2, "held", None, False, (), 2, 2, held=True)   # the island's own weights
    p = plan(5, 100, [], fs, False, TAU2)
    assert p.stage == [] and [b.fragment for b in p.install] == [0, 1]
    fs = states()
    fs[2].side.arrived, fs[2].side.adopt = base(2, 2), True
    fs[1].stage(2, 0)
    p = plan(100, 100, [], fs, False, TAU2, ready={1})    # the final cut: nothing staged or armed now
    assert p.final and p.stage == [] and p.arm == [] and p.install == [BaseSpec(2, 2)]


def test_install_rule_is_the_one_place_for_blend_and_alpha():
    assert (TAU0.blend, TAU0.mode, TAU0.alpha_or_none) == (False, "replace", None)
    assert (TAU2.blend, TAU2.mode, TAU2.alpha_or_none) == (True, "blend", 0.5)
    assert [TAU2.alpha_for(m) for m in ("replace", "blend", "keep")] == [None, 0.5, 1.0]
    with pytest.raises(EngineError):
        TAU2.alpha_for("merge")
    assert TAU2.install_step(10) == 12 and PushPhase.AT_SYNCER.value == "at syncer"


def test_an_answer_installed_synchronously_also_waits_for_the_push_step_plus_tau():
    fs = states()
    pushed(fs[1], 10)
    fs[1].side.arrived = Base(1, 2, "held", None, False, (), 1, 2, held=True)   # the island's own weights
    assert [bool(plan(s, 100, [], fs, False, TAU2).install) for s in (11, 12)] == [False, True]
    fs[1].side.adopt = True   # an adoption after a restart goes in at once
    assert plan(11, 100, [], fs, False, TAU2).install == [BaseSpec(1, 2, 0, True)]
