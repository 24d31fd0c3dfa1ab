"""start_agreement: every rank learns the first rank's YETO_* error through a real key-value store (threads stand
in for ranks; torch.distributed's TCPStore), none waits for ranks that never come, and one process alone decides
alone."""
import threading

import pytest

from yeto_patch.island import start_agreement


@pytest.fixture()
def store():
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def ranks(store, errors, prefix, timeout_s=10.0, present=None):
    """Each rank (a thread) talks through its own client of the store, as each process of a job does."""
    import torch.distributed as dist
    world = len(errors)
    present = range(world) if present is None else present
    clients = {r: dist.TCPStore("127.0.0.1", store.port, is_master=False) for r in present}
    out = {}

    def run(r):
        out[r] = start_agreement.agree_through(clients[r], r, world, errors[r], timeout_s, prefix)
    threads = [threading.Thread(target=run, args=(r,)) for r in present]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_gets_the_first_error_naming_its_rank(store):
    out = ranks(store, [None, "YETO_DILOCO_SYNC_EVERY=0: must be at least 1", None], "a/")
    assert set(out.values()) == {"YETO_DILOCO_SYNC_EVERY=0: must be at least 1 [rank 1]"}


def test_all_fine_is_none_on_every_rank(store):
    assert ranks(store, [None] * 4, "b/") == {r: None for r in range(4)}


def test_ranks_that_never_train_are_not_waited_for_forever(store):
    out = ranks(store, [None, None, None], "c/", timeout_s=1.0, present=[0, 1])
    assert all("only 2 of 3 ranks reached their first training step within 1s" in m for m in out.values())


def test_an_error_is_not_held_up_by_a_rank_that_never_comes(store):
    out = ranks(store, ["bad value", None, None], "d/", timeout_s=30.0, present=[0, 1])
    assert out == {0: "bad value [rank 0]", 1: "bad value [rank 0]"}


def test_without_a_process_group_each_rank_decides_alone():
    assert start_agreement.agree("x") == "x" and start_agreement.agree(None) is None
    assert start_agreement.agree_through(None, 0, 1, "y", 1.0, "e/") == "y"
