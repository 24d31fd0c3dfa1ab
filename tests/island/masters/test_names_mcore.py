"""Global names and cross-layout installs on real megatron-core (CPU, 4 gloo ranks; plus a 1-rank pool)."""
import pytest

from tests.mcore.pool import WorkerPool

W = "tests.island.masters.test_names_mcore"
DENSE = dict(layers=4, global_batch=8, bf16=True)
LAYOUTS = {
    "tp2dp2": dict(tp=2, **DENSE),
    "pp2tp2": dict(tp=2, pp=2, **DENSE),
    "dp4": dict(tp=1, dist_opt=False, **DENSE),
    "pp2vpp2dp2": dict(tp=1, pp=2, vpp=2, **DENSE),
    "pp4": dict(tp=1, pp=4, **DENSE),
}
MOE = dict(experts=4, bf16=True, layers=2, global_batch=8)


@pytest.fixture(scope="module")
def single_pool():
    pool = WorkerPool(1)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def manifests(mcore_pool, single_pool):
    out = {k: mcore_pool.run(f"{W}:manifest_of", v, timeout=180) for k, v in LAYOUTS.items()}
    out["single"] = single_pool.run(f"{W}:manifest_of", dict(tp=1, **DENSE), timeout=180)
    return out


def test_manifest_identical_on_every_rank_and_layout(manifests):
    """(2) TP2xDP2, PP2xTP2, DP4, PP2 with virtual pipeline, PP4 and one process: same names, order and shapes."""
    ref = manifests["single"][0]
    names = [n for n, _, _ in ref]
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in names   # global layer numbers
    assert "output_layer.weight" not in names                            # tied: one entry
    assert all(d == "float32" for _, _, d in ref)
    for layout, per_rank in manifests.items():
        for r, m in enumerate(per_rank):
            assert m == ref, f"{layout} rank {r} differs"


def test_moe_manifest_identical_for_ep2_and_ep1(mcore_pool):
    ep2 = mcore_pool.run(f"{W}:manifest_of", dict(tp=2, ep=2, **MOE), timeout=180)
    ep1 = mcore_pool.run(f"{W}:manifest_of", dict(tp=1, ep=1, **MOE), timeout=180)
    ep4 = mcore_pool.run(f"{W}:manifest_of", dict(tp=1, ep=4, **MOE), timeout=180)
    assert ep2[0] == ep1[0] == ep4[0] and all(m == ep2[0] for m in ep2 + ep1 + ep4)
    names = [n for n, _, _ in ep2[0]]
    for L in range(2):
        for e in range(4):
            assert f"decoder.layers.{L}.mlp.experts.{e}.linear_fc1.weight" in names


def test_expert_parameter_without_global_index_is_an_error(mcore_pool):
    res = mcore_pool.run(f"{W}:manifest_error_without_expert_index", dict(tp=1, ep=2, **MOE), timeout=180)
    for msg in res:
        assert msg and "no global expert index" in msg


@pytest.mark.parametrize("a,b", [("tp2dp2", "pp2tp2"), ("pp2tp2", "dp4"), ("moe_ep2", "moe_tp2ep2"),
                                 ("swiglu_tp2dp2", "swiglu_dp4")])
def test_install_from_another_layout_gives_the_same_model(mcore_pool, tmp_path, a, b):
    """(4) island A (seed 1) is read, saved as .npy and installed into island B (seed 2, another layout):
    B then holds exactly A's values and computes A's loss."""
    layouts = {**LAYOUTS, "moe_ep2": dict(tp=1, ep=2, **MOE), "moe_tp2ep2": dict(tp=2, ep=2, **MOE),
               # SwiGLU fc1 is split with partition_stride 2: [gate_r; up_r] per TP rank
               "swiglu_tp2dp2": dict(tp=2, swiglu=True, **DENSE), "swiglu_dp4": dict(tp=1, swiglu=True, **DENSE)}
    ca = {**layouts[a], "seed": 1}
    cb = {**layouts[b], "seed": 2, "data_seed": 0}
    sa = mcore_pool.run(f"{W}:save_island", ca, str(tmp_path), timeout=240)
    sb = mcore_pool.run(f"{W}:install_island", cb, str(tmp_path), timeout=240)
    assert sb[0]["same"] is True and sb[0]["zero_delta"] is True
    assert sb[0]["eval_before"] != pytest.approx(sa[0]["eval"], abs=1e-3)
    assert sb[0]["eval_after"] == pytest.approx(sa[0]["eval"], abs=2e-2)


def test_vocab_padding_mismatch_is_explained_and_real_vocab_merges(mcore_pool, tmp_path):
    """Vocab 128 with --make-vocab-size-divisible-by 128: TP1 keeps 128 rows, TP2 pads to 256."""
    tp2 = dict(tp=2, bf16=True, vocab=128, vocab_divisible_by=128, seed=1, global_batch=8)
    tp1 = dict(tp=1, bf16=True, vocab=128, vocab_divisible_by=128, seed=2, global_batch=8)
    mcore_pool.run(f"{W}:save_island", tp2, str(tmp_path / "padded"), timeout=240)
    msg = mcore_pool.run(f"{W}:manifest_mismatch_message", tp1, str(tmp_path / "padded"), timeout=240)[0]
    assert msg and "--make-vocab-size-divisible-by" in msg and "256" in msg and "128" in msg
    # with the real vocabulary size both sides name 128 rows and merge on them (padded TP2 -> TP1 and back);
    # the padding rows are never written (they still take part in TP2's softmax, so losses may differ)
    sa = mcore_pool.run(f"{W}:save_island", tp2, str(tmp_path / "real"), 3, 128, timeout=240)
    assert [n for n, s, _ in sa[0]["manifest"] if n == "embedding.word_embeddings.weight" and s[0] == 128]
    sb = mcore_pool.run(f"{W}:install_island", tp1, str(tmp_path / "real"), 1, 128, timeout=240)
    assert sb[0]["same"] is True and sb[0]["zero_delta"] is True
    mcore_pool.run(f"{W}:save_island", tp1, str(tmp_path / "back"), 1, 128, timeout=240)
    sc = mcore_pool.run(f"{W}:install_island", tp2, str(tmp_path / "back"), 1, 128, timeout=240)
    assert sc[0]["same"] is True
    assert all(r["padding_untouched"] for r in sc) and sum(r["n_padding_rows"] for r in sc) > 0


def test_frozen_parameters_are_excluded(mcore_pool):
    cfg = dict(tp=2, pp=2, freeze=("final_layernorm",), **DENSE)
    res = mcore_pool.run(f"{W}:frozen_roundtrip", cfg, timeout=180)
    names = res[0]["names"]
    assert all(r["names"] == names for r in res)
    assert sum(len(r["frozen_local"]) for r in res) > 0
    assert not [n for n in names if "final_layernorm" in n]
    assert "decoder.layers.2.self_attention.linear_proj.weight" in names   # layer 2 = local layer 0 of stage 1
    assert res[0]["same"] is True

# ================================================================================================ workers
# Run on every rank of the module's pools (pool.run(f"{W}:<name>", ...)): real megatron-core on CPU, gloo.
import json  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.island.masters.mcore_setup import _setup, _wire  # noqa: E402
from tests.mcore import harness  # noqa: E402
from yeto_patch.island import IslandComm, IslandError, build_manifest, collect_arrays  # noqa: E402


def manifest_of(cfg_kwargs, real_vocab=None):
    cfg = harness.RunCfg(**cfg_kwargs)
    ctx = harness.build(cfg)
    comm = IslandComm(timeout_s=60)
    man = build_manifest(ctx["model"], real_vocab_size=real_vocab, comm=comm)
    return _wire(man)


def manifest_error_without_expert_index(cfg_kwargs):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    ctx = harness.build(harness.RunCfg(**cfg_kwargs))
    for c in ctx["model"]:
        for m in harness.unwrap(c).modules():
            if isinstance(m, MoELayer):
                for obj in (m, m.experts):
                    if hasattr(obj, "local_expert_indices"):
                        delattr(obj, "local_expert_indices")
    try:
        build_manifest(ctx["model"], comm=IslandComm(timeout_s=60))
    except IslandError as e:
        return str(e)
    return None


def save_island(cfg_kwargs, path, steps=3, real_vocab=None):
    ctx, man, view = _setup(cfg_kwargs, steps, real_vocab=real_vocab)
    full = collect_arrays(view)
    ev = harness.eval_loss(ctx)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        for e, a in full.items():
            np.save(os.path.join(path, f"{e}.npy"), a, allow_pickle=False)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(_wire(man), f)
    return dict(eval=ev, manifest=_wire(man))


def install_island(cfg_kwargs, path, steps=1, real_vocab=None):
    ctx, man, view = _setup(cfg_kwargs, steps, real_vocab=real_vocab)
    ev_before = harness.eval_loss(ctx)
    src = None
    if dist.get_rank() == 0:
        with open(os.path.join(path, "manifest.json")) as f:
            man.check_matches(json.load(f))
        src = {e: np.load(os.path.join(path, f"{e}.npy"), allow_pickle=False) for e in range(len(man))}
    pads = []
    if real_vocab is not None:   # padding rows must be left as they are
        from yeto_patch.island.masters.names import VOCAB_NAMES
        for lp in man.local:
            if lp.local_name in VOCAB_NAMES:
                rows = lp.param.shape[0]
                first = max(0, real_vocab - lp.shard * rows)
                pads.append((lp, first, lp.param.detach()[first:].clone()))
    view.write(None, src, set_anchor=True)
    padding_untouched = all(torch.equal(lp.param.detach()[first:], old) for lp, first, old in pads)
    n_padding_rows = sum(old.shape[0] for _, _, old in pads)
    back = collect_arrays(view)
    same = None
    if dist.get_rank() == 0:
        same = all(np.array_equal(back[e], src[e]) for e in range(len(man)))
    # anchors were set to the installed values: the delta is exactly zero
    zero = collect_arrays(view, delta=True)
    zero_ok = None if dist.get_rank() != 0 else all(not np.any(a) for a in zero.values())
    ev_after = harness.eval_loss(ctx)
    losses = harness.train_steps(ctx, 2)
    return dict(eval_before=ev_before, eval_after=ev_after, same=same, zero_delta=zero_ok, losses=losses,
                padding_untouched=padding_untouched, n_padding_rows=n_padding_rows)


def manifest_mismatch_message(cfg_kwargs, path):
    ctx, man, view = _setup(cfg_kwargs, 0)
    if dist.get_rank() != 0:
        return None
    with open(os.path.join(path, "manifest.json")) as f:
        other = json.load(f)
    try:
        man.check_matches(other)
    except ValueError as e:
        return str(e)
    return None


def frozen_roundtrip(cfg_kwargs):
    """Frozen parameters are not in the manifest; the others read and write back unchanged."""
    ctx, man, view = _setup(cfg_kwargs, 1)
    full = collect_arrays(view)
    view.write(None, full if dist.get_rank() == 0 else None)
    back = collect_arrays(view)
    same = None if dist.get_rank() != 0 else all(np.array_equal(back[e], full[e]) for e in full)
    frozen = sorted({n for c in ctx["model"] for n, p in harness.unwrap(c).named_parameters() if not p.requires_grad})
    return dict(names=man.names, same=same, frozen_local=frozen)
