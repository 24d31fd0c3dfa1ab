"""plan(): what happens at a step, from the schedule and the fragments' state alone (no torch, no processes)."""
import numpy as np
import pytest

from yeto_patch.island.errors import EngineError
from yeto_patch.island.boundary.fragments import Fragments
from yeto_patch.island.boundary.plan import Plan, install_spec, needs_plan, overdue, plan
from yeto_patch.island.boundary.schedule import due_fragments
from yeto_patch.wire.client import Base


def states(P=3, anchor=1):
    fs = Fragments([[f] for f in range(P)], [2] * P, [2] * P)
    for st in fs:
        st.installed(anchor)
    return fs


def base(f, v, **kw):
    return Base(f, v, "f32", np.zeros(2, np.float32), **kw)


def test_most_steps_need_no_plan():
    assert not needs_plan(3, 10, [], False)
    assert needs_plan(3, 10, [1], False)
    assert needs_plan(3, 10, [], True)
    assert needs_plan(10, 10, [], False)


def test_due_fragments_push_and_an_arrived_newer_base_installs():
    fs = states()
    fs[2].arrived = base(2, 2)
    p = plan(5, 100, [0], fs, by_syncer=False)
    assert (p.push, p.skip, p.final, p.by_syncer) == ([0], [], False, False)
    assert p.install == [[2, 2, 0, False]]


def test_a_fragment_that_pushes_now_does_not_install_its_newer_base_first():
    fs = states()
    fs[0].arrived = base(0, 4)
    p = plan(5, 100, [0], fs, by_syncer=False)
    assert p.push == [0] and p.install == []
    fs[0].adopt = True   # unless the syncer is behind: its base is installed first
    assert plan(5, 100, [0], fs, by_syncer=False).install == [[0, 4, 0, False]]


def test_a_base_arriving_while_the_push_is_in_the_background_waits_for_the_push():
    fs = states()
    fs[1].pending = {"step": 4, "fragment": 1, "base_version": 1, "_in_flight": True}
    fs[1].arrived = base(1, 2)            # merged without this island while its push is still being gathered
    fs[2].arrived = base(2, 2)
    assert plan(5, 100, [], fs, by_syncer=False).install == [[2, 2, 0, False]]
    fs[1].pending = {"step": 4, "fragment": 1, "base_version": 1}   # handed to the link: as any sent push
    assert plan(5, 100, [], fs, by_syncer=False).install == [[1, 2, 0, False], [2, 2, 0, False]]


def test_an_old_or_equal_base_is_not_installed():
    fs = states(anchor=3)
    fs[1].arrived = base(1, 3)
    assert plan(5, 100, [], fs, by_syncer=False).install == []


def test_restart_skips_boundaries_merged_before_it():
    fs = states()
    fs[1].skip = 1
    p = plan(5, 100, [0, 1], fs, by_syncer=False)
    assert p.push == [0] and p.skip == [1]


def test_last_step_is_the_final_cut_and_installs_nothing_it_pushes():
    fs = states()
    fs[2].arrived = base(2, 5)
    p = plan(100, 100, [0], fs, by_syncer=False)
    assert p.final and p.push == [] and p.install == []


def test_the_syncers_final_cut_installs_nothing_and_pushes_nothing():
    fs = states()
    fs[2].arrived = base(2, 5)
    fs[2].adopt = True
    p = plan(7, 100, [0], fs, by_syncer=True)
    assert (p.final, p.by_syncer, p.push, p.install) == (True, True, [], [])


def test_plan_round_trips_through_json():
    import json
    p = Plan([[2, 5, 1, True]], [0, 1], [3], False, False)
    assert Plan.from_json(json.loads(json.dumps(p.as_json()))) == p


def test_install_spec_of_updates_checks_they_apply_to_the_anchor():
    from yeto_patch.wire import codecs
    fs = states(anchor=2)
    body = codecs.encode("int8", np.ones(2, np.float32), 256)
    fs[0].arrived = Base(0, 4, "int8", None, deltas=(("int8", 256, body),) * 2, start=2, size=2)
    assert install_spec(fs[0]) == [0, 4, 2, False]
    fs[1].arrived = Base(1, 4, "int8", None, deltas=(("int8", 256, body),), start=3, size=2)
    with pytest.raises(EngineError, match="applies to v3, but this island's anchor is v2"):
        install_spec(fs[1])
    fs[1].arrived.held = True   # the base is the weights held: no anchor needed
    assert install_spec(fs[1]) == [1, 4, 1, True]


def test_overdue_after_tau_steps():
    fs = states()
    fs[0].pending = {"step": 10}
    fs[2].pending = {"step": 12}
    assert overdue(11, 2, fs) == []
    assert overdue(12, 2, fs) == [0]
    assert overdue(14, 2, fs) == [0, 2]
    assert overdue(12, 0, fs) == [0, 2]


def test_a_run_of_steps_pushes_each_fragment_once_per_H():
    fs, H, pushes = states(4), 8, []
    for step in range(1, 33):
        due = due_fragments(step, H, len(fs))
        if needs_plan(step, 32, due, False):
            p = plan(step, 32, due, fs, by_syncer=False)
            pushes += [(step, f) for f in p.push]
    assert sorted(f for _, f in pushes) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 3   # step 32: the final cut


def test_with_a_stager_an_arrived_base_is_staged_then_installed_once_rank_0s_part_is_ready():
    fs = states()
    fs[2].arrived = base(2, 2)
    p = plan(5, 100, [], fs, by_syncer=False, stage=True)
    assert p.stage == [[2, 2, 0]] and p.install == [] and p.staged == []
    assert Plan.from_json(p.as_json()) == p
    fs[2].arrived, fs[2].staging = None, [2, 0]          # what the engine does with that plan
    assert plan(6, 100, [], fs, by_syncer=False, stage=True).staged == []            # still in the background
    fs[2].arrived = base(2, 3)                           # a newer base waits: nothing else enters a staged fragment
    p = plan(7, 100, [], fs, by_syncer=False, staged={2}, stage=True)
    assert p.staged == [2] and p.stage == [] and p.install == []


def test_a_staged_base_of_a_fragment_pushing_now_waits_and_answers_that_push():
    fs = states()
    fs[0].staging = [2, 0]
    p = plan(5, 100, [0], fs, by_syncer=False, staged={0}, stage=True)
    assert p.push == [0] and p.staged == []
    fs[0].pending = {"step": 5, "fragment": 0, "base_version": 1}
    assert fs[0].answered(1) and not fs[0].answered(2)
    assert plan(6, 100, [], fs, by_syncer=False, staged={0}, stage=True).staged == [0]


def test_adoptions_own_weights_and_the_final_cut_install_synchronously_even_with_a_stager():
    fs = states()
    fs[0].arrived, fs[0].adopt = base(0, 0), True               # the syncer is behind a restarted island
    fs[1].arrived = Base(1, 2, "held", None, False, (), 2, 2, held=True)     # the island's own weights
    p = plan(5, 100, [], fs, by_syncer=False, stage=True)
    assert p.stage == [] and [i[0] for i in p.install] == [0, 1]
    fs = states()
    fs[2].arrived, fs[2].adopt = base(2, 2), True
    fs[1].staging = [2, 0]
    p = plan(100, 100, [], fs, by_syncer=False, staged={1}, stage=True)    # the final cut: nothing staged now
    assert p.final and p.stage == [] and p.staged == [] and p.install == [[2, 2, 0, False]]


def test_a_push_s_answer_is_installed_at_its_step_plus_tau_whenever_it_arrives():
    """Issue 24: the install step is fixed by the plan (push step + tau), not by when the base arrived."""
    fs = states()
    fs[0].pending = {"step": 10, "fragment": 0, "base_version": 1}
    fs[0].arrived = base(0, 2)                       # the answer arrives 1 step after the push
    p = plan(11, 100, [], fs, by_syncer=False, stage=True, tau=5)
    assert p.stage == [[0, 2, 0]] and p.staged == []  # staged at once (in the background) ...
    fs[0].arrived, fs[0].staging = None, [2, 0]
    for step in range(12, 15):                       # ... and held while it is not due
        assert plan(step, 100, [], fs, by_syncer=False, staged={0}, stage=True, tau=5).staged == []
    assert plan(15, 100, [], fs, by_syncer=False, staged={0}, stage=True, tau=5).staged == [0]   # 10 + 5
    fs = states()                                    # installed synchronously (no stager): the same step
    fs[1].pending = {"step": 10, "fragment": 1, "base_version": 1}
    fs[1].arrived = base(1, 2)
    assert plan(14, 100, [], fs, by_syncer=False, tau=5).install == []
    assert plan(15, 100, [], fs, by_syncer=False, tau=5).install == [[1, 2, 0, False]]
    assert overdue(14, 5, fs) == [] and overdue(15, 5, fs) == [1]   # not there by then: waited for after step 15


def test_a_base_that_answers_no_push_of_this_island_is_installed_at_once():
    fs = states()
    fs[2].staging = [2, 0]                           # merged by a quorum without this island (no push pending)
    assert plan(11, 100, [], fs, by_syncer=False, staged={2}, stage=True, tau=5).staged == [2]
    fs[1].arrived, fs[1].adopt = base(1, 0), True    # an adoption after a restart
    fs[1].pending = {"step": 10, "fragment": 1, "base_version": 1}
    assert plan(11, 100, [], fs, by_syncer=False, tau=5).install == [[1, 0, 0, False]]
