"""The island's restart state from the fragments' state (capture, save, load, restore) without torch."""
import logging
import types

import numpy as np
import pytest

from yeto_patch.island.boundary import sync_state
from yeto_patch.island.errors import EngineError
from yeto_patch.island.boundary.fragment import Fragments, PushWire
from yeto_patch.island.boundary.plan import final_step


def settings(**kw):
    d = dict(island_id="a", push_dtype="int8", block=256, error_feedback=True)
    d.update(kw)
    return types.SimpleNamespace(**d)


def island(anchors=(3, 5)):
    fs = Fragments([[0], [1, 2]], [4, 6], [4, 3, 3])
    for st, v in zip(fs, anchors):
        st.installed(v)
    fs.count_step(7)
    fs.count_step(5)
    fs[1].begin_push(12)   # counts again from here
    fs[1].push_handed(PushWire(np.arange(10, dtype=np.uint8), "int8", {"bytes": 10}))
    fs.count_step(3)
    fs[0].side.residual = np.full(4, 0.5, np.float32)
    return fs


def saved_and_loaded(tmp_path):
    """(the island saved at iteration 40, the state read back, its arrays)."""
    old = island()
    sync_state.save(str(tmp_path), 40, settings(), 40, "d1", old)
    arrays = {}
    state = sync_state.load(sync_state.state_path(str(tmp_path), 40), 40, arrays, settings(), manifest_digest="d1",
                            layout=old.layout)
    return old, state, arrays


def test_save_then_load_round_trips_the_state(tmp_path):
    fs = island()
    assert sync_state.save(str(tmp_path), 40, settings(), 40, "d1", fs)
    arrays = {}
    state = sync_state.load(sync_state.state_path(str(tmp_path), 40), 40, arrays, settings(), manifest_digest="d1",
                            layout=fs.layout)
    assert state["anchor_version"] == [3, 5] and state["steps_since"] == [3, 1] and state["tokens_since"] == [15, 3]
    assert state["pending"]["1"]["steps"] == 2 and state["pending"]["1"]["tokens"] == 12   # since the previous push
    assert state["pending"]["1"]["base_version"] == 5
    assert set(state["pending"]["1"]) == {"step", "fragment", "base_version", "steps", "tokens", "final", "codec",
                                          "bytes"}
    np.testing.assert_array_equal(arrays["push.1"], np.arange(10, dtype=np.uint8))
    np.testing.assert_array_equal(arrays["residual.0"], np.full(4, 0.5, np.float32))
    assert state["pretrained"] is False
    # a fine-tune's restart keeps saying its run started from pretrained weights
    assert sync_state.save(str(tmp_path), 41, settings(), 41, "d1", fs, pretrained=True)
    assert sync_state.load(sync_state.state_path(str(tmp_path), 41), 41, {}, settings(), manifest_digest="d1",
                           layout=fs.layout)["pretrained"] is True


@pytest.mark.parametrize("kw,needle", [
    (dict(manifest_digest="other"), "manifest differs"),
    (dict(layout=[[0, 1], [2]]), "another fragment layout"),
    (dict(iteration=41), "belongs to iteration 40, not 41"),
    (dict(island_id="b"), "belongs to island 'a'"),
])
def test_a_state_of_another_run_is_ignored_with_the_reason(tmp_path, caplog, kw, needle):
    fs = island()
    sync_state.save(str(tmp_path), 40, settings(), 40, "d1", fs)
    it = kw.pop("iteration", 40)
    st = settings(island_id=kw.pop("island_id", "a"))
    args = dict(manifest_digest="d1", layout=fs.layout)
    args.update(kw)
    path = sync_state.state_path(str(tmp_path), 40)
    with caplog.at_level(logging.WARNING, logger="yeto_patch"):
        assert sync_state.load(path, it, {}, st, **args) is None
    assert needle in caplog.text


def test_another_push_codec_drops_the_saved_pushes(tmp_path):
    fs = island()
    sync_state.save(str(tmp_path), 40, settings(), 40, "d1", fs)
    arrays = {}
    state = sync_state.load(sync_state.state_path(str(tmp_path), 40), 40, arrays, settings(push_dtype="int4"),
                            manifest_digest="d1", layout=fs.layout)
    assert state["pending"] == {} and "push.1" not in arrays and "residual.0" in arrays


def test_restore_keeps_progress_where_the_anchor_is_current_and_skips_where_merged_past(tmp_path):
    old, state, arrays = saved_and_loaded(tmp_path)
    fs = Fragments(old.layout, old.numels, [4, 3, 3])
    versions = {0: 5, 1: 5}   # fragment 0 was merged twice past its saved anchor v3; fragment 1 is current
    resend = sync_state.restore(state, arrays, fs, versions, keep={1}, rank=0, error_feedback=True)
    assert [st.index for st in resend] == [1]
    assert fs[0].skip == 2 and fs[1].skip == 0
    assert (fs[1].steps_since, fs[1].tokens_since) == (1, 3) and fs[0].steps_since == 0
    assert (fs[1].push.step, fs[1].push.base_version, fs[1].push.phase.value) == (12, 5, "at syncer")
    assert fs[1].side.wire.codec == "int8" and fs[1].outgoing(blend=True, again=True).again   # sent again
    np.testing.assert_array_equal(fs[1].side.wire.body, np.arange(10, dtype=np.uint8))
    np.testing.assert_array_equal(fs[0].side.residual, np.full(4, 0.5, np.float32))
    other = Fragments(old.layout, old.numels, [4, 3, 3], rank0=False)   # another rank: the same push, no body
    assert sync_state.restore(state, arrays, other, versions, keep={1}, rank=1, error_feedback=True) == []
    assert other[1].push == fs[1].push and other[1].rank0 is None


@pytest.mark.parametrize("merged,skip", [(1, 0), (2, 1), (3, 2)])
def test_the_merge_that_answered_the_saved_push_is_not_skipped(tmp_path, merged, skip):
    """tau >= 1: fragment 1's push of step 12 (base v5) was unanswered when the checkpoint was saved. The syncer
    merged it (v6) while the island was down: that round's boundary came before the checkpoint and is not trained
    again, so only the merges after it (the island's pushes after the checkpoint) are skipped. (Found by the Bridge
    test: a TP2 island resumed at iteration 2 with tau = 1 did not push fragment 1 at the final cut.)"""
    old, state, arrays = saved_and_loaded(tmp_path)
    fs = Fragments(old.layout, old.numels, [4, 3, 3])
    resend = sync_state.restore(state, arrays, fs, {0: 3, 1: 5 + merged}, keep={0}, rank=0, error_feedback=True)
    assert resend == [] and fs[1].push is None      # answered: nothing to send again, nothing awaited
    assert fs[1].skip == skip and fs[0].skip == 0


def test_elastic_rounds_merged_without_the_island_are_not_skipped(tmp_path):
    """Without a fixed roster the rounds merged while the island was down did not hold its pushes: it skips none."""
    old, state, arrays = saved_and_loaded(tmp_path)
    fs = Fragments(old.layout, old.numels, [4, 3, 3])
    sync_state.restore(state, arrays, fs, {0: 5, 1: 5}, keep={1}, rank=0, error_feedback=True, fixed_roster=False)
    assert fs[0].skip == 0 and fs[1].push.base_version == 5


def test_a_state_saved_by_the_previous_version_loads(tmp_path):
    """A sync state written before the fragments became state machines (its pending record has more keys)."""
    fs = island()
    meta, arrays = sync_state.capture(settings(), 40, 40, "d1", fs)
    meta["pending"]["1"].update(gather_ms=1.0, encode_ms=2.0, wait_ms=0.0, installed=False)
    sync_state.write_state(sync_state.state_path(str(tmp_path), 40), meta, arrays)
    got = {}
    state = sync_state.load(sync_state.state_path(str(tmp_path), 40), 40, got, settings(), manifest_digest="d1",
                            layout=fs.layout)
    new = Fragments(fs.layout, fs.numels, [4, 3, 3])
    sync_state.restore(state, got, new, {0: 3, 1: 5}, keep={0, 1}, rank=0, error_feedback=True)
    assert new[1].push.tokens == 12


def test_final_step():
    assert final_step(None, 100, 0) == 100 and final_step(50, 100, 10) == 50
    with pytest.raises(EngineError, match="YETO_DILOCO_TOTAL_STEPS is not set"):
        final_step(None, None, 0)
    with pytest.raises(EngineError, match="beyond Megatron's train_iters=100"):
        final_step(200, 100, 0)
    with pytest.raises(EngineError, match="resumes at step 50, at or past the final cut at step 50"):
        final_step(50, 100, 50)
