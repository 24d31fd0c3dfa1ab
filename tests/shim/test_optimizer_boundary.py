"""Real megatron-core optimizers on CPU (4 gloo ranks): the boundary fires exactly once per outermost optimizer
step whatever the chain holds, the install point once per mixed-precision leaf inside it, and a bad YETO_* value
stops the first step on every rank, naming the variable."""
import importlib.metadata

import pytest
from packaging.version import Version

MCORE = Version(importlib.metadata.version("megatron-core"))

LAYOUTS = {
    "tp2-bf16-distopt": dict(tp=2, bf16=True),
    "moe-tp2-ep2-two-chained": dict(tp=2, ep=2, experts=4, bf16=True),
    "dp4-fp32-FP32Optimizer": dict(dist_opt=False),
    "pp2-bf16-Float16Optimizer": dict(pp=2, bf16=True, dist_opt=False),
    "tp2-bf16-hybrid-offload": dict(tp=2, bf16=True, cpu_offload=True),
}


@pytest.mark.timeout(600)
def test_one_boundary_per_outermost_step(mcore_pool):
    steps = 3
    for name, cfg in LAYOUTS.items():
        if cfg.get("cpu_offload") and MCORE < Version("0.17"):
            continue  # 0.16's OptimizerConfig cannot build the offloaded optimizer without Transformer Engine
        per_rank = mcore_pool.run("tests.shim.workers:count_boundaries", cfg, steps, timeout=240)
        for rank, r in enumerate(per_rank):
            where = f"{name} rank {rank} (chain {r['chain']})"
            assert r["outer"] == "ChainedOptimizer", where
            assert r["engines"] == 1 and r["same_optimizer"], where
            # the install point: each mixed-precision leaf's cast of its masters, inside the counted step only
            # (not a cast made outside a step, after the last one)
            copies = [("param_copy", c) for c in r["chain"] if c != "FP32Optimizer"]
            assert r["calls"] == ([("before_step", "ChainedOptimizer")] + copies + [("step", True, None)]) * steps, \
                where
            assert r["losses"][-1] < r["losses"][0], where
        if name.startswith("moe"):
            assert len(per_rank[0]["chain"]) == 2          # dense + expert optimizers, still one boundary
        if "hybrid" in name:
            assert any("HybridDeviceOptimizer" in p for p in per_rank[0]["patched"])


@pytest.mark.timeout(300)
def test_bad_value_stops_the_first_step_on_every_rank(mcore_pool):
    env = {"YETO_DILOCO_SYNCER": "127.0.0.1:9", "YETO_DILOCO_INSECURE": "1", "YETO_DILOCO_SYNC_EVERY": "often"}
    out = mcore_pool.run("tests.shim.workers:bad_value_at_start", env, timeout=240)
    assert len(out) == 4
    for msg in out:
        assert msg.startswith("ConfigError: YETO_DILOCO_SYNC_EVERY='often' is not an integer"), msg


@pytest.mark.timeout(300)
def test_bad_value_on_one_node_stops_every_rank_quickly(mcore_pool):
    import time
    env = {"YETO_DILOCO_SYNCER": "127.0.0.1:9", "YETO_DILOCO_INSECURE": "1", "YETO_DILOCO_TIMEOUT": "600"}
    t0 = time.time()
    out = mcore_pool.run("tests.shim.workers:bad_value_on_one_rank", env, {"YETO_DILOCO_BLOCK": "3"}, 2,
                         timeout=240)
    assert time.time() - t0 < 120          # not the 600 s timeout: the others learn it at once
    for msg in out:
        assert msg.startswith("ConfigError: YETO_DILOCO_BLOCK=3 is out of range"), msg
        assert msg.endswith("[rank 2]"), msg
