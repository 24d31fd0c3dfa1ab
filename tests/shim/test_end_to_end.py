"""End to end on real megatron-core (CPU, gloo): a syncer and two islands of different layouts (TP2 and PP2, bf16,
DistributedOptimizer), launched with torchrun from a training script that does not mention yeto-patch, attached
only through PYTHONPATH and YETO_* variables. Several rounds of int4 pushes with tau > 0; after the final cut both
islands hold full models bit-identical to the syncer's final base, and the loss fell."""
import numpy as np
import pytest

from tests.shim import procs as P

STEPS, H, FRAGMENTS = 16, 4, 2


@pytest.mark.timeout(400)
def test_two_islands_tp2_pp2_int4_overlap_end_bit_identical(tmp_path):
    port = P.free_port()
    key = P.key_file(tmp_path)
    env = dict(YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_SYNC_EVERY=H, YETO_DILOCO_PUSH_DTYPE="int4",
               YETO_DILOCO_OVERLAP_STEPS=1, YETO_DILOCO_MERGE_ALPHA=0.5, YETO_DILOCO_CHUNK_BYTES="64K",
               YETO_DILOCO_TIMEOUT=150)
    syncer = P.start_syncer(tmp_path, port, islands=2, fragments=FRAGMENTS, key=key)
    barrier = ["--start-barrier", str(tmp_path / "barrier")]          # launched together, as a user would
    a = P.start_island(tmp_path, "tp2", port, ["--tp", "2", "--data-seed", "1", *barrier], STEPS, env)
    b = P.start_island(tmp_path, "pp2", port, ["--pp", "2", "--data-seed", "2", *barrier], STEPS, env)
    rcs = P.wait_all([a, b, syncer], timeout=330)
    assert rcs == [0, 0, 0], P.logs([a, b, syncer])

    final, versions = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    assert all(v >= STEPS // H for v in versions.values()), versions     # every fragment merged every round
    for name in ("tp2", "pp2"):
        model = P.island_model(str(tmp_path / name))
        params = P.island_model(str(tmp_path / name), "param")
        assert sorted(model) == sorted(final), (name, sorted(set(model) ^ set(final)))
        for k, v in final.items():
            assert model[k].shape == v.shape and np.array_equal(model[k], v), (name, k)
            assert np.array_equal(params[k], P.as_bf16(v)), (name, k)    # bf16 weights: the base, cast
        res = P.island_result(str(tmp_path / name))
        assert res["eval_after"] < res["eval_before"] - 0.3, res
        recs = P.metrics(str(tmp_path / name))
        bounds = [r for r in recs if r["event"] == "boundary"]
        regular = [r for r in bounds if not r["final"]]
        assert len(regular) == FRAGMENTS * STEPS // H - 1, regular   # step 16 (fragment 1) is the final cut
        assert all(r["codec"] == "int4" and r["installed"] and r["bytes"] > 0 for r in bounds)
        assert all(r["mode"] == "blend" for r in regular) and all(r["mode"] == "replace" for r in bounds
                                                                   if r["final"])
        assert all(0 <= r["pull_lag"] <= 1 for r in regular), regular
        assert sorted({r["step"] for r in regular}) == [2, 4, 6, 8, 10, 12, 14]   # fragments spread over H
        assert [r["event"] for r in recs][0] == "start" and recs[-1]["event"] == "final"
