"""IslandChannel: rank 0's result or error reaches every rank; waits are sliced, bounded and serve requests."""
import subprocess
import sys
import textwrap
import types

import pytest

from yeto_patch.island.boundary.channel import IslandChannel
from yeto_patch.island.errors import EngineError


class Loop(IslandChannel):
    """A channel whose broadcast is the identity (rank 0's JSON as another rank would decode it)."""

    def __init__(self, rank=0, other=None):
        super().__init__(types.SimpleNamespace(rank=rank, group=None, timeout_s=1.0))
        self.sent, self.other = [], other

    def broadcast_json(self, obj, what):
        import json
        if self.rank != 0:
            obj = self.other.pop(0)
        self.sent.append(obj)
        return json.loads(json.dumps(obj))


def test_rank0_result_and_error():
    ch = Loop()
    assert ch.rank0(lambda: {"a": [1, 2]}, "x") == {"a": [1, 2]}

    def bad():
        raise ValueError("boom")
    with pytest.raises(EngineError, match="yeto-patch: failed to plan step 3: ValueError: boom$"):
        ch.rank0(bad, "plan step 3")
    assert ch.sent[-1] == {"error": "yeto-patch: failed to plan step 3: ValueError: boom"}


def test_other_ranks_raise_rank0s_error_and_never_run_fn():
    ch = Loop(rank=1, other=[{"error": "yeto-patch: it broke"}])
    with pytest.raises(EngineError, match=r"it broke \[island rank 0\]"):
        ch.rank0(lambda: pytest.fail("ran on rank 1"), "x")


def test_refusals_are_described_by_class():
    from yeto_patch.wire.client import SyncerRefusal
    ch = Loop()

    def refuse():
        raise SyncerRefusal("stale", "too old", fragment=1, base_version=2)
    with pytest.raises(EngineError, match=r"refused a push \(stale\).*must pull the current base"):
        ch.rank0(refuse, "push")


def test_await_ready_slices_serves_requests_and_finishes():
    ch = Loop()
    state = {"n": 0, "served": [], "waits": 0}
    reqs = [[], [3], [], []]

    def ready():
        state["n"] += 1
        return state["n"] >= 4

    def wait(t):
        state["waits"] += 1
    ch.await_ready(ready, "bases", timeout=10, slice_s=5, wait=wait, source="the syncer", step=lambda: 1,
                   requests=lambda: reqs.pop(0) if reqs else [], serve=state["served"].append)
    assert state["served"] == [3] and state["n"] == 4
    assert [list(o["ok"]) for o in ch.sent] == [["init"], ["done"]]


def test_await_ready_times_out_naming_what_and_where():
    ch = Loop()
    with pytest.raises(EngineError, match="timed out after 0s .*waiting for the base of fragment 2 from the syncer"):
        ch.await_ready(lambda: False, "the base of fragment 2", timeout=0.3, slice_s=0.1,
                       wait=lambda t: None, source="the syncer", step=lambda: 0)
    assert len(ch.sent) >= 2 and all(o == {"wait": True} for o in [x["ok"] for x in ch.sent[:-1]])


def test_broadcast_json_over_gloo_small_and_large():
    pytest.importorskip("torch")
    code = textwrap.dedent("""
        import types
        import torch.distributed as dist
        from yeto_patch.island.boundary.channel import IslandChannel
        from tests.ports import free_port
        port = free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        ch = IslandChannel(types.SimpleNamespace(rank=0, group=None, timeout_s=30))
        small = {"push": [1, 2], "s": "x"}
        big = {"blob": "y" * 10000, "n": list(range(500))}
        assert ch.broadcast_json(small, "t") == small
        assert ch.broadcast_json(big, "t") == big
        assert ch.rank0(lambda: big, "t") == big
        # Without it, gloo's threads can meet the interpreter's teardown: SIGABRT after "ok".
        dist.destroy_process_group()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
