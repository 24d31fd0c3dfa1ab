"""FragmentState / Fragments: the syncer's layout checked against the manifest, counters, arrived bases."""
import numpy as np
import pytest

from yeto_patch.island.errors import EngineError
from yeto_patch.island.boundary.fragments import Fragments
from yeto_patch.wire.client import Base


def frags():
    return Fragments([[0, 2], [1]], [7, 4], [3, 4, 4])


def test_layout_gives_offsets_sizes_and_entries():
    fs = frags()
    assert len(fs) == 2 and fs.layout == [[0, 2], [1]] and fs.numels == [7, 4]
    assert fs[0].offsets == {0: 0, 2: 3} and fs[0].starts == [0, 3] and fs[1].entries == [1]
    assert fs.anchors() == [-1, -1] and fs.pending() == []


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
    fs[0].adopt = True
    fs[0].installed(5)
    assert (fs[0].anchor_version, fs[0].steps_since, fs[0].tokens_since, fs[0].adopt) == (5, 0, 0, False)
    assert fs[1].steps_since == 2


def full(f, v, n=4, x=1.0):
    return Base(f, v, "f32", np.full(n, x, np.float32))


def test_take_base_keeps_the_newest_unless_adopting():
    st = frags()[1]
    st.take_base(full(1, 3))
    st.take_base(full(1, 2))
    assert st.arrived.version == 3
    st.adopt = True   # the syncer is behind this island: its (older) base replaces what is held
    st.take_base(full(1, 1))
    assert st.arrived.version == 1


def test_take_base_applies_a_relative_update_in_order():
    from yeto_patch.wire import codecs
    st = frags()[1]
    st.take_base(full(1, 2, x=1.0))
    delta = np.full(4, 0.5, np.float32)
    body = codecs.encode("int8", delta, 256)
    st.take_base(Base(1, 3, "int8", None, deltas=(("int8", 256, body),), start=2, size=4))
    assert st.arrived.version == 3 and not st.arrived.relative
    np.testing.assert_allclose(st.arrived.values, 1.0 + codecs.decode("int8", body, 4, 256), rtol=0, atol=0)


def test_answered_needs_a_newer_base_or_adoption():
    st = frags()[0]
    assert not st.answered(2)
    st.take_base(full(0, 2, 7))
    assert not st.answered(2)
    st.take_base(full(0, 3, 7))
    assert st.answered(2)
    st.arrived = full(0, 1, 7)
    st.adopt = True
    assert st.answered(2)
