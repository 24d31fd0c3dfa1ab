"""One canonical name and layout for every weight whatever the build (yeto_patch/island/masters/builds.py):
Transformer Engine's names (built without Transformer Engine, tests/island/masters/te_twin.py) give the local spec's
manifest and layouts on real megatron-core, and a TE-built island's model installs exactly into a local-spec
island of another layout; what cannot be reconciled is refused naming the tensors and the option."""
import pytest

from yeto_patch.island.masters import builds
from yeto_patch.island.masters.names import ManifestError, _expert_rest
from yeto_patch.syncer.model.layout import first_difference

BW = "tests.island.masters.test_build_names"
W = "tests.island.masters.test_names_mcore"
DENSE = dict(tp=2, swiglu=True, layers=2, global_batch=8, bf16=True)
MOE = dict(tp=2, ep=2, etp=2, experts=4, swiglu=True, layers=2, global_batch=8, bf16=True)


# ------------------------------------------------------------------------------------------- pure parts
def test_every_build_name_maps_to_the_local_specs_name_inside_a_layer_only():
    for b in builds.BUILD_NAMES:
        assert builds.canonical(f"decoder.layers.7.{b.build}") == (f"decoder.layers.7.{b.canonical}", b.build)
        assert builds.canonical(f"mtp.layers.0.transformer_layer.{b.build}") == \
            (f"mtp.layers.0.transformer_layer.{b.canonical}", b.build)
    for name in ("decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight",
                 "embedding.word_embeddings.weight", "decoder.layers.1.mlp.experts.3.linear_fc1.weight",
                 "decoder.layers.1.mlp.linear_fc1.weight"):
        assert builds.canonical(name) == (name, None)
    assert {b.canonical for b in builds.BUILD_NAMES} >= {"input_layernorm.weight", "pre_mlp_layernorm.weight",
                                                          "input_layernorm.bias", "pre_mlp_layernorm.bias"}


@pytest.mark.parametrize("pname,attrs,glu,grouped,want", [
    # local spec: the attributes are right (fc1 of SwiGLU has stride 2)
    ("decoder.layers.0.mlp.linear_fc1.weight", (True, 0, 2), True, False, (True, 0, 2)),
    # Kitchen linears say stride 1 for a SwiGLU fc1; the module still computes [gate_r; up_r] per rank
    ("decoder.layers.0.mlp.linear_fc1.weight", (True, 0, 1), True, False, (True, 0, 2)),
    ("decoder.layers.0.mlp.linear_fc1.weight", (True, 0, 1), False, False, (True, 0, 1)),
    # TEGroupedMLP, megatron-core 0.19 (stride 1) and 0.16 (no tensor-parallel attributes at all)
    ("decoder.layers.0.mlp.experts.linear_fc1.weight3", (True, 0, 1), True, True, (True, 0, 2)),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight3", (False, 0, 1), True, True, (True, 0, 2)),
    ("decoder.layers.0.mlp.experts.linear_fc2.weight3", (False, 0, 1), True, True, (True, 1, 1)),
    ("decoder.layers.0.mlp.experts.linear_fc2.bias3", (False, 0, 1), True, True, (False, -1, 1)),
    ("decoder.layers.0.mlp.experts.linear_fc1.bias0", (False, 0, 1), False, True, (True, 0, 1)),
    # not an MLP projection: the attributes
    ("decoder.layers.0.self_attention.linear_qkv.weight", (True, 0, 1), True, False, (True, 0, 1)),
    ("decoder.layers.0.input_layernorm.weight", (False, 0, 1), True, False, (False, -1, 1)),
])
def test_mlp_projections_get_the_layout_their_module_computes(pname, attrs, glu, grouped, want):
    assert tuple(builds.fc_layout(pname, *attrs, tp_size=2, glu=glu, grouped=grouped)) == want
    assert tuple(builds.fc_layout(pname, *attrs, tp_size=1, glu=glu, grouped=grouped)) == (False, -1, 1)


def test_one_tensor_of_all_local_experts_is_refused_naming_the_option():
    assert _expert_rest("local_experts.2.linear_fc1.weight", 4) == (2, "linear_fc1.weight", False)
    assert _expert_rest("linear_fc2.weight3", 4) == (3, "linear_fc2.weight", True)
    with pytest.raises(ManifestError) as e:
        _expert_rest("weight1", 4)
    assert "--moe-use-legacy-grouped-gemm" in str(e.value) and "'experts.weight1'" in str(e.value)


def _manifest(names, shape=(8, 8)):
    return [[n, list(shape), "float32"] for n in names]


@pytest.mark.parametrize("run,here,tensor,option", [
    (["decoder.layers.0.self_attention.k_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.weight"],
     ["decoder.layers.0.self_attention.linear_qkv.weight"], "k_layernorm", "--qk-layernorm"),
    (["decoder.layers.0.input_layernorm.bias", "decoder.layers.0.input_layernorm.weight"],
     ["decoder.layers.0.input_layernorm.weight"], "input_layernorm.bias", "--normalization"),
    (["decoder.layers.0.self_attention.linear_kv_down_proj.weight"],
     ["decoder.layers.0.self_attention.linear_qkv_down_proj.weight"], "linear_qkv_down_proj",
     "--mla-down-proj-fusion"),
    (["embedding.word_embeddings.weight", "output_layer.weight"], ["embedding.word_embeddings.weight"],
     "output_layer.weight", "--untie-embeddings-and-output-weights"),
])
def test_a_manifest_refusal_names_the_tensors_and_the_option(run, here, tensor, option):
    text = "this island's parameter manifest differs from the run's: " + first_difference(_manifest(run),
                                                                                         _manifest(here))
    said = builds.explain_refusal(text)
    assert tensor in said and option in said, (text, said)


def test_a_shape_refusal_names_the_tensor_and_its_option():
    text = first_difference(_manifest(["decoder.layers.0.mlp.linear_fc1.weight"], (256, 64)),
                            _manifest(["decoder.layers.0.mlp.linear_fc1.weight"], (128, 64)))
    said = builds.explain_refusal(text)
    assert "[128, 64]" in said and "[256, 64]" in said and "--ffn-hidden-size / --swiglu" in said
    assert builds.explain_refusal("auth failed") == ""


# ------------------------------------------------------------------------------------------- real megatron-core
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense-swiglu-tp2", "moe-swiglu-tp2-etp2-ep2"])
@pytest.mark.parametrize("release", ["0.19", "0.16"])
def test_transformer_engine_names_give_the_local_specs_manifest_and_layouts(mcore_pool, cfg, release):
    res = mcore_pool.run(f"{BW}:twin_manifests", cfg, release, timeout=240)
    for r in res:
        assert r["moved"], "the twin renamed nothing"
        assert r["twin"] == r["local"] == res[0]["local"]
        assert r["layouts_twin"] == r["layouts_local"]
    names = set().union(*(r["param_names"] for r in res))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert not any(".input_layernorm." in n for n in names)
    mapped = {(a, b) for r in res for a, b, _ in r["mapped"]}
    assert ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight") in mapped
    assert ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias") in mapped
    if cfg is DENSE:
        assert ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight") in mapped
        fc1 = [v for r in res for k, v in r["layouts_twin"].items() if k.endswith("0.mlp.linear_fc1.weight")]
    else:
        assert "decoder.layers.1.mlp.experts.linear_fc1.weight1" in names
        fc1 = [v for r in res for k, v in r["layouts_twin"].items() if k.endswith("mlp.experts.3.linear_fc1.weight")]
    assert fc1 and all(v[:3] == [0, 2, 2] for v in fc1)      # split along dim 0, stride 2 ([gate; up]), 2 ranks


def test_a_transformer_engine_moe_island_installs_exactly_into_a_local_island_of_another_layout(mcore_pool,
                                                                                                  tmp_path):
    """TEGroupedMLP's SwiGLU experts split over expert-TP 2 (megatron-core 0.19 marks them stride 1) read by
    global names and installed into an expert-TP 1 local-spec island: the same values and the same loss."""
    sa = mcore_pool.run(f"{BW}:save_twin", {**MOE, "seed": 1}, str(tmp_path), "0.19", timeout=240)
    assert sa[0]["differ"] == []
    sb = mcore_pool.run(f"{W}:install_island", {**MOE, "tp": 1, "etp": 1, "seed": 2, "data_seed": 0},
                        str(tmp_path), timeout=240)
    assert sb[0]["same"] is True
    assert sb[0]["eval_before"] != pytest.approx(sa[0]["eval"], abs=1e-3)
    assert sb[0]["eval_after"] == pytest.approx(sa[0]["eval"], abs=2e-2)


# ================================================================================================ workers
# Run on every rank of the module's pool (pool.run(f"{BW}:<name>", ...)): a real local-spec megatron-core model and
# its Transformer Engine-named twin (te_twin.py) give the same manifest and layouts.
import json  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.island.masters import te_twin  # noqa: E402
from tests.island.masters.mcore_setup import _wire  # noqa: E402
from tests.mcore import harness  # noqa: E402
from yeto_patch.island import IslandComm, MasterView, build_manifest, collect_arrays  # noqa: E402

def _layouts(man) -> dict:
    return {lp.name: [lp.partition_dim, lp.stride, lp.nshards, lp.shard, list(lp.full_shape)] for lp in man.local}


def twin_manifests(cfg_kwargs, release):
    """The manifest and this rank's layouts of a local-spec model, then of the same model renamed as the TE spec
    of `release` names it."""
    ctx = harness.build(harness.RunCfg(**cfg_kwargs))
    comm = IslandComm(timeout_s=60)
    local = build_manifest(ctx["model"], comm=comm)
    before = _layouts(local)
    moved = te_twin.make_twin(ctx["model"], release)
    twin = build_manifest(ctx["model"], comm=comm)
    names = sorted(n for c in ctx["model"] for n, _ in harness.unwrap(c).named_parameters())
    return dict(local=_wire(local), twin=_wire(twin), layouts_local=before, layouts_twin=_layouts(twin),
                moved=moved, param_names=names, mapped=[[a, b, n] for (a, b), n in sorted(twin.mapped.items())])


def save_twin(cfg_kwargs, path, release, steps=3):
    """Train a few steps, rename the model as the TE spec of `release` would, and save its full model by global
    names (read through yeto-patch's master view) with the loss it evaluates to; `differ`: the tensors whose full
    value read from the twin is not the one read from the model before renaming."""
    ctx = harness.build(harness.RunCfg(**cfg_kwargs))
    harness.train_steps(ctx, steps)
    comm = IslandComm(timeout_s=60)
    local = collect_arrays(MasterView(ctx["model"], ctx["optimizer"], build_manifest(ctx["model"], comm=comm),
                                      chunk_bytes=1 << 14, comm=comm))
    te_twin.make_twin(ctx["model"], release)
    man = build_manifest(ctx["model"], comm=comm)
    view = MasterView(ctx["model"], ctx["optimizer"], man, chunk_bytes=1 << 14, comm=comm)
    full = collect_arrays(view)
    ev = harness.eval_loss(ctx)
    differ = None
    if dist.get_rank() == 0:   # the twin's full tensors are the local spec's, element for element
        differ = [man.entries[e].name for e in full if not np.array_equal(full[e], local[e])]
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        for e, a in full.items():
            np.save(os.path.join(path, f"{e}.npy"), a, allow_pickle=False)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(_wire(man), f)
    return dict(eval=ev, differ=differ)
