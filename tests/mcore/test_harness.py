"""The CPU megatron-core harness works: TP2xDP2 bf16 GPTModel + DistributedOptimizer in 4 gloo processes."""
import pytest

from tests.mcore.pool import TaskError, TaskTimeout

W = "tests.mcore.workers"


def test_tp2_dp2_bf16_distributed_optimizer_loss_falls(mcore_pool):
    res = mcore_pool.run(f"{W}:train_then_hook_then_train", dict(tp=2, bf16=True, dist_opt=True), 4, 4,
                         timeout=240)
    assert [r["info"]["tp"] for r in res] == [0, 1, 0, 1]
    assert [r["info"]["dp"] for r in res] == [0, 0, 1, 1]
    assert res[0]["optimizer"] == "ChainedOptimizer" and res[0]["inner"] == ["DistributedOptimizer"]
    assert res[0]["dtype"] == "torch.bfloat16"
    losses = res[0]["losses"]
    for r in res[1:]:
        assert r["losses"] == pytest.approx(losses, rel=1e-6)
    assert losses[-1] < losses[0] - 0.3, losses


def test_task_error_carries_rank_traceback_and_pool_survives(mcore_pool):
    with pytest.raises(TaskError, match="boom from rank 2") as ei:
        mcore_pool.run(f"{W}:fail_on_rank", 2, "boom from rank 2", timeout=60)
    assert sorted(ei.value.errors) == [2]
    starts = mcore_pool.starts
    assert mcore_pool.run(f"{W}:fail_on_rank", -1, "", timeout=60) == [0, 1, 2, 3]
    assert mcore_pool.starts == starts  # same processes reused


def test_hung_task_kills_pool_and_next_task_gets_a_fresh_one(mcore_pool):
    with pytest.raises(TaskTimeout, match=r"did not finish"):
        mcore_pool.run(f"{W}:hang_on_rank", 1, timeout=8)
    starts = mcore_pool.starts
    assert mcore_pool.run(f"{W}:fail_on_rank", -1, "", timeout=120) == [0, 1, 2, 3]
    assert mcore_pool.starts == starts + 1
