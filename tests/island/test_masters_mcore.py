"""FP32 master read / write on real megatron-core (CPU, 4 gloo ranks in one pool for the module)."""
import numpy as np
import pytest

from tests.mcore.harness import hdo_supported

W = "tests.island.workers"

LAYOUTS = {
    "tp2dp2_bf16_distopt": dict(tp=2, bf16=True),
    "pp2tp2_bf16_distopt": dict(tp=2, pp=2, layers=4, micro=4, bf16=True),
    "dp4_bf16_float16opt": dict(tp=1, bf16=True, dist_opt=False),
    "dp4_fp32_fp32opt": dict(tp=1, dist_opt=False),
    "tp2dp2_fp32_distopt": dict(tp=2),
    "moe_tp2ep2_bf16_chained": dict(tp=2, ep=2, experts=4, bf16=True),
}
EXTRA = {
    "pp2vpp2_bf16": dict(tp=1, pp=2, vpp=2, layers=4, micro=4, bf16=True),
    "moe_tp2ep2etp2_fp32": dict(tp=2, ep=2, experts=4, etp=2),
    "tp2dp2_bf16_overlap_param_gather": dict(tp=2, bf16=True, overlap_grad_reduce=True, overlap_param_gather=True),
}
if hdo_supported():
    EXTRA["tp2dp2_bf16_hybrid_device_optimizer"] = dict(tp=2, bf16=True, cpu_offload=True, offload_fraction=0.5)


def _compare_with_reference(res):
    got = res[0]["got"]
    ref = {}
    for r in res:
        ref.update(r["ref"])
    assert sorted(got) == sorted(ref)
    bad = [k for k in got if not np.array_equal(got[k], ref[k])]
    assert not bad, f"read differs from the reference for {bad}"
    names = [n for n, _, _ in res[0]["manifest"]]
    assert sorted(names) == sorted(got)


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(EXTRA))
def test_read_equals_megatron_reference(mcore_pool, layout):
    """(1) rank 0's streamed read == megatron's own DP gathering + TP concatenation, element for element."""
    cfg = {**LAYOUTS, **EXTRA}[layout]
    res = mcore_pool.run(f"{W}:read_vs_reference", cfg, timeout=240)
    _compare_with_reference(res)
    # chunks of 16 KiB: nothing bigger than a small multiple of the chunk was buffered on any rank
    assert max(r["peak"] for r in res) <= 2 * (1 << 14)


@pytest.mark.parametrize("layout", list(LAYOUTS) + ["tp2dp2_bf16_overlap_param_gather"]
                         + (["tp2dp2_bf16_hybrid_device_optimizer"] if hdo_supported() else []))
def test_write_read_plus_c_changes_masters_exactly_keeps_adam_state(mcore_pool, layout):
    """(3) write(read() + c): masters == old + c, params == cast(masters) on every replica, Adam state
    bit-identical, and training continues and lowers the loss."""
    cfg = {**LAYOUTS, **EXTRA}[layout]
    res = mcore_pool.run(f"{W}:write_plus_constant", cfg, 0.03125, timeout=240)
    for r in res:
        assert r["same_states"] and r["n_states"] > 0
    assert sum(r["n_checked"] for r in res) > 0
    r0 = res[0]
    assert r0["eval1"] != pytest.approx(r0["eval0"], abs=1e-4)    # the write changed the model
    assert r0["eval2"] < r0["eval1"], r0                          # the next steps train from the new values


def test_blend_write(mcore_pool):
    res = mcore_pool.run(f"{W}:write_plus_constant", LAYOUTS["tp2dp2_bf16_distopt"], 0.03125, 2, 1 << 14, 0.25,
                         timeout=240)
    assert all(r["same_states"] for r in res)
    assert res[0]["eval2"] < res[0]["eval1"]


def test_blend_with_anchor_at_the_value(mcore_pool):
    """DiLoCo's overlapped install: masters := alpha*local + (1-alpha)*base, anchor := base."""
    res = mcore_pool.run(f"{W}:blend_with_anchor_value", LAYOUTS["pp2tp2_bf16_distopt"], 0.25, 0.5, timeout=240)
    r = res[0]
    assert r["err_cur"] < 1e-6 and r["err_delta"] < 1e-6
    assert r["mean_delta"] == pytest.approx(0.125, abs=1e-4)   # (1 - alpha) * c


@pytest.mark.parametrize("layout", ["pp2tp2_bf16_distopt", "dp4_bf16_float16opt"])
def test_read_delta_is_anchor_minus_current(mcore_pool, layout):
    res = mcore_pool.run(f"{W}:delta_roundtrip", LAYOUTS[layout], timeout=240)
    assert res[0]["ok"] and res[0]["sub_ok"]
    # anchors only where the data is owned: together they hold the model once
    assert sum(r["anchor_bytes"] for r in res) > 0


@pytest.mark.parametrize("layout", ["tp2dp2_bf16_distopt", "dp4_bf16_float16opt"])
def test_a_snapshot_gathered_later_on_its_own_group_is_the_delta_of_its_boundary(mcore_pool, layout):
    """The background push's data path: each rank snapshots only what it owns; gathered later, beside a
    read_delta on the view's group, it gives rank 0 the boundary's delta bit for bit."""
    res = mcore_pool.run(f"{W}:snapshot_gather", LAYOUTS[layout], timeout=240)
    assert res[0]["ok"] and not any(r["err"] or r["alive"] for r in res), res
    assert sum(r["own"] for r in res) == res[0]["total"]     # the snapshots hold the model once, split by owner


@pytest.mark.parametrize("kind,expect", [
    ("sink", "injected failure in the rank-0 sink"),
    ("no_anchor", "no anchor for"),
    ("mismatched_op", "called write"),
])
def test_error_on_one_rank_is_raised_on_every_rank(mcore_pool, kind, expect):
    """(5) an injected failure on one rank ends every rank with that message, quickly, and the island still works."""
    res = mcore_pool.run(f"{W}:injected_failure", LAYOUTS["pp2tp2_bf16_distopt"], kind, timeout=120)
    for r in res:
        assert r["error"] is not None and expect in r["error"], res
        assert r["seconds"] < 30


def test_non_finite_write_is_refused_everywhere_and_installs_nothing(mcore_pool):
    res = mcore_pool.run(f"{W}:injected_failure", LAYOUTS["tp2dp2_bf16_distopt"], "bad_source", timeout=120)
    for r in res:
        assert r["error"] and "non-finite" in r["error"]
        assert r["unchanged"]


def test_peak_memory_is_bounded_by_the_chunk_not_the_model(mcore_pool):
    """(6) a model ~130x the chunk: peak sync buffers per rank stay a small multiple of the chunk."""
    chunk = 1 << 15
    cfg = dict(tp=2, bf16=True, hidden=192, ffn=768, heads=8, layers=2, vocab=1024)
    res = mcore_pool.run(f"{W}:bounded_memory", cfg, chunk, timeout=240)
    model_bytes = res[0]["model_bytes"]
    assert model_bytes > 100 * chunk
    print("bounded memory:", res)
    for r in res:
        assert r["read_peak"] <= 3 * chunk and r["write_peak"] <= 3 * chunk, r
        # measured resident memory: far below one model copy (allocator noise allowed)
        assert r["read_rss"] < model_bytes / 8 and r["write_rss"] < model_bytes / 8, r


def test_relative_write_adds_the_owners_anchor_exactly(mcore_pool):
    """Quantized base updates from the syncer: value = anchor + change on the owner, bit for bit, for the
    anchor-only pass, a replace and a blended install; without anchors every rank refuses."""
    res = mcore_pool.run(f"{W}:relative_write", LAYOUTS["tp2dp2_bf16_distopt"], 0.5, timeout=480)
    for r in res:
        assert r["err"] and "no anchor for" in r["err"], res
    r = res[0]
    assert r["changed"] and r["keep_masters"] and r["keep_anchor"]
    assert r["replace"] and r["replace_anchor"] and r["blend_anchor"]
    assert r["blend_err"] < 1e-6


@pytest.mark.parametrize("layout,mode,updates,route", [
    ("tp2dp2_bf16_distopt", "replace", 0, "in_step"),
    ("tp2dp2_bf16_distopt", "blend", 0, "in_step"),
    ("tp2dp2_bf16_distopt", "blend", 2, "after_step"),
    ("tp2dp2_bf16_distopt", "blend", 0, "after_step"),
    ("dp4_bf16_float16opt", "blend", 0, "in_step"),
    ("dp4_bf16_float16opt", "replace", 0, "after_step"),
    ("pp2tp2_bf16_distopt", "replace", 1, "in_step"),
    ("moe_tp2ep2_bf16_chained", "blend", 1, "in_step"),
    ("tp2dp2_bf16_overlap_param_gather", "blend", 0, "in_step"),
    ("tp2dp2_fp32_distopt", "blend", 0, "in_step"),
    ("dp4_fp32_fp32opt", "blend", 0, "after_step"),          # (FP32Optimizer never casts: after the step only)
    pytest.param("tp2dp2_bf16_hybrid_device_optimizer", "blend", 0, "in_step",
                 marks=pytest.mark.skipif(not hdo_supported(), reason="no HybridDeviceOptimizer here")),
])
def test_a_base_staged_in_the_background_installs_what_write_installs(mcore_pool, layout, mode, updates, route):
    """stage (background group, another thread) + an install against write on the same state, every master,
    anchor and param on every rank bit for bit: installed into the masters only, before each leaf optimizer's
    own cast and Megatron's parameter gather (in_step: what the engine does inside the optimizer step), or after
    the step with the params and the replicas' refresh (after_step)."""
    cfg = {**LAYOUTS, **EXTRA}[layout]
    res = mcore_pool.run(f"{W}:staged_vs_write", cfg, mode, updates, 0.5, 1 << 14, route, timeout=240)
    for r in res:
        assert not r["err"] and not r["alive"] and r["untouched"] and not r["pending"], r
        assert not r["differ"], r["differ"][:5]
        # the staging is one float32 copy of the rank's masters, two for a blend (the scaled values too)
        assert r["staged_bytes"] == r["master_bytes"] * (2 if mode == "blend" else 1), r


def test_agree_flags_ors_the_flags_and_raises_the_lowest_failing_ranks_error_everywhere(mcore_pool):
    res = mcore_pool.run(f"{W}:agree_flags_cases", timeout=120)
    assert [r["ok"] for r in res] == [[1, 0, 1]] * 4
    assert [r["err"] for r in res] == ["RuntimeError: install failed on rank 2 [island rank 2]"] * 4
