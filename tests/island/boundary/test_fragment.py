"""Fragment / Fragments: the syncer's layout checked against the manifest; each fragment's boundary as a state
machine (legal and illegal transitions); rank 0's side only on rank 0; the arrived bases."""
import numpy as np
import pytest

from yeto_patch.island.boundary.fragment import BasePhase, Fragments, Push, PushPhase, PushWire
from yeto_patch.island.errors import EngineError
from yeto_patch.wire.client import Base


def frags(rank0=True):
    return Fragments([[0, 2], [1]], [7, 4], [3, 4, 4], rank0=rank0)


def test_layout_gives_offsets_sizes_and_entries():
    fs = frags()
    assert len(fs) == 2 and fs.layout == [[0, 2], [1]] and fs.numels == [7, 4]
    assert fs[0].shape.offsets == {0: 0, 2: 3} and fs[0].shape.starts == (0, 3) and fs[1].entries == (1,)
    assert fs.anchors() == [-1, -1] and fs.pushing() == []


@pytest.mark.parametrize("layout,numels,announced,needle", [
    ([[0], [1]], [3, 4], None, "exactly once"),          # tensor 2 missing
    ([[0, 1], [1, 2]], [7, 8], None, "exactly once"),    # tensor 1 twice
    ([[0, 2], [1]], [7, 4], 3, "announced 3 fragments"),
    ([[0, 2], [1]], [7, 5], None, "fragment 1: the syncer counts 5 values, this island 4"),
])
def test_a_layout_that_does_not_fit_is_refused(layout, numels, announced, needle):
    with pytest.raises(EngineError, match=needle):
        Fragments(layout, numels, [3, 4, 4], announced=announced)


def test_counters_run_from_the_install():
    fs = frags()
    fs.count_step(10)
    fs.count_step(0)
    assert [(s.steps_since, s.tokens_since) for s in fs] == [(2, 10), (2, 10)]
    fs[0].side.adopt = True
    fs[0].installed(5)
    assert (fs[0].anchor_version, fs[0].steps_since, fs[0].tokens_since, fs[0].side.adopt) == (5, 0, 0, False)
    assert fs[1].steps_since == 2


def test_a_push_reports_the_counts_since_the_previous_push_and_a_blend_keeps_them():
    """The syncer's weights see what was computed: a push takes the steps and tokens since the previous push; a base
    blended in (or kept) leaves the local progress, so counting goes on; one that replaces the masters resets."""
    fs = frags()
    for frag in fs:
        frag.installed(0)
    fs.count_step(10)
    fs.count_step(10)
    push = fs[0].begin_push(2)
    assert (push.steps, push.tokens, fs[0].steps_since, fs[0].tokens_since) == (2, 20, 0, 0)
    fs.count_step(5)
    fs[0].push_handed(None)
    fs[0].installed(1, keep_counts=True)     # blended in at the push's step + tau: the 5 tokens stay
    fs[1].installed(1)                       # replaced: counting starts again
    assert (fs[0].steps_since, fs[0].tokens_since) == (1, 5) and (fs[1].steps_since, fs[1].tokens_since) == (0, 0)
    fs.count_step(5)
    assert fs[0].begin_push(4).tokens == 10 and fs[0].take_counts() == (0, 0)


def test_a_boundary_goes_push_lane_syncer_staged_armed_installed():
    frag = frags()[0]
    frag.installed(3)
    frag.count(7)
    push = frag.begin_push(step=10)
    assert push == Push(10, 3, 1, 7, False, PushPhase.IN_LANE) and frag.push_phase is PushPhase.IN_LANE
    wire = PushWire(np.zeros(4, np.uint8), "int4")
    frag.push_handed(wire)
    assert frag.push_phase is PushPhase.AT_SYNCER and frag.side.wire is wire
    frag.stage(4, 0)
    assert frag.base_phase is BasePhase.STAGING and frag.answered()
    frag.arm(job="part", why="answer", wait_s=0.25)
    assert frag.base_phase is BasePhase.ARMED and frag.staging.job == "part"
    assert frag.installed(4) is push
    assert (frag.push_phase, frag.base_phase, frag.anchor_version, frag.steps_since) == \
        (PushPhase.IDLE, BasePhase.NONE, 4, 0)


def test_illegal_transitions_are_internal_errors_at_once():
    frag = frags()[1]
    frag.installed(1)
    with pytest.raises(EngineError, match="no push in the lane"):
        frag.push_handed(None)
    with pytest.raises(EngineError, match="no staged base to arm"):
        frag.arm(None, "x", 0.0)
    frag.begin_push(5)
    with pytest.raises(EngineError, match="pushes again before its previous push was answered"):
        frag.begin_push(6)
    frag.stage(2, 0)
    with pytest.raises(EngineError, match="stages a base while another one is staged"):
        frag.stage(3, 0)
    with pytest.raises(EngineError, match="armed while its push is still in the lane"):
        frag.arm(None, "x", 0.0)   # the push's delta is taken against the anchor an install would change
    frag.push_handed(None)
    frag.arm(None, "x", 0.0)
    frag.installed(2)
    frag.stage(3, 0)
    frag.arm(None, "x", 0.0)
    with pytest.raises(EngineError, match="pushes while a base is armed"):
        frag.begin_push(9)


def test_every_rank_has_the_same_shape_and_rank_0s_side_only_there():
    r0, r1 = frags(rank0=True)[0], frags(rank0=False)[0]
    assert type(r0).__slots__ == type(r1).__slots__ and r1.rank0 is None
    for frag in (r0, r1):   # pushes and staging are every rank's
        frag.installed(1)
        frag.begin_push(3)
        frag.push_handed(None)
        assert frag.push.base_version == 1
    with pytest.raises(EngineError, match="rank 0's side read on another rank"):
        r1.side.arrived   # noqa: B018 - a rank-0-only read elsewhere fails at once, not inside a collective
    with pytest.raises(AttributeError):
        r0.pending = {}   # no ad-hoc fields


def full(f, v, n=4, x=1.0):
    return Base(f, v, "f32", np.full(n, x, np.float32))


def test_take_base_keeps_the_newest_unless_adopting():
    side = frags()[1].side
    side.take_base(full(1, 3))
    side.take_base(full(1, 2))
    assert side.arrived.version == 3
    side.adopt = True   # the syncer is behind this island: its (older) base replaces what is held
    side.take_base(full(1, 1))
    assert side.arrived.version == 1


def test_take_base_applies_a_relative_update_in_order():
    from yeto_patch.wire import codecs
    side = frags()[1].side
    side.take_base(full(1, 2, x=1.0))
    delta = np.full(4, 0.5, np.float32)
    body = codecs.encode("int8", delta, 256)
    side.take_base(Base(1, 3, "int8", None, deltas=(("int8", 256, body),), start=2, size=4))
    assert side.arrived.version == 3 and not side.arrived.relative
    np.testing.assert_allclose(side.arrived.values, 1.0 + codecs.decode("int8", body, 4, 256), rtol=0, atol=0)


def test_answered_needs_a_newer_base_or_adoption():
    frag = frags()[0]
    frag.installed(2)
    frag.begin_push(4)
    frag.push_handed(None)
    assert not frag.answered()
    frag.side.take_base(full(0, 2, 7))
    assert not frag.answered()
    frag.side.take_base(full(0, 3, 7))
    assert frag.answered()
    frag.side.arrived = full(0, 1, 7)
    frag.side.adopt = True
    assert frag.answered()
