"""The shards of a syncer started as ONE torchrun job (`--shard torchrun`): RANK/WORLD_SIZE give each its shard,
each listens on the --listen port plus its LOCAL_RANK, they exchange addresses through torchrun's store, and an
island given only shard 0's address finds the others in its welcome, runs its rounds and gets the final model
from both; {shard} names each shard's checkpoint, and the run id is torchrun's --rdzv-id."""
import sys
import time

import numpy as np
import pytest

from tests.island.link.test_sharded_link import FRAGMENTS, joined, push, until
from tests.ports import free_port, free_ports
from tests.shim import procs as P
from yeto_patch.syncer.model.checkpoint import read_checkpoint
from yeto_patch.syncer.cli import build_parser, config_from_args, resolve_shard
from yeto_patch.syncer.shards.launch import with_port_offset


@pytest.mark.timeout(300)
def test_two_shards_of_one_torchrun_job_serve_an_island_that_knows_only_shard_0(tmp_path):
    from tests.syncer.helpers import KEY
    key = tmp_path / "key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    base = free_ports(2)   # the shards listen on base + LOCAL_RANK
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-id", "job-7", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "yeto_patch.syncer", "--shard", "torchrun", "--listen", f"127.0.0.1:{base}", "--islands", "1",
           "--fragments", str(FRAGMENTS), "--outer", "avg", "--grace", "0.2", "--key-file", str(key),
           "--checkpoint", str(tmp_path / "shard{shard}.ckpt"), "--final-ack-timeout", "5"]
    job = P.Proc("shards", cmd, P.base_env(), str(tmp_path / "shards.log"))
    try:
        deadline = time.time() + 120
        while P.logs([job]).count("yeto-syncer listening on") < 2:
            assert job.poll() is None and time.time() < deadline, P.logs([job])
            time.sleep(0.2)
        link, frags, values = joined(tmp_path, f"127.0.0.1:{base}")   # shard 0 alone
        assert [lk.address for lk in link.links] == [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
        for st in frags:
            push(link, st, np.full(st.numel, 0.25, np.float32))
        until(link, frags, lambda: all(st.answered() for st in frags), "merged bases")
        for st in frags:
            st.installed(st.side.arrived.version)
        out = None
        while out is None:
            out = link.final_model(3, time.monotonic() + 30, 5.0, drain=True)
        assert sorted(out) == list(range(FRAGMENTS)) and all(b.version == 1 for b in out.values())
        link.close()
        assert P.wait_all([job], timeout=60) == [0], P.logs([job])
    finally:
        job.kill()
    metas = [read_checkpoint(str(tmp_path / f"shard{i}.ckpt"))[0] for i in range(2)]
    assert [m["shard"] for m in metas] == [[0, 2], [1, 2]] and {m["run_id"] for m in metas} == {"job-7"}
    assert sorted(fm["index"] for m in metas for fm in m["fragments"]) == list(range(FRAGMENTS))


def test_torchrun_shard_flags_are_resolved_from_its_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    a = build_parser().parse_args(["--shard", "torchrun", "--listen", "0.0.0.0:7640", "--fragments", "8",
                                   "--metrics-port", "9100", "--checkpoint", "/ck/s{shard}.bin", "--insecure",
                                   "--listen", "127.0.0.1:7640"])
    resolve_shard(a)
    assert (str(a.shard), a.listen, a.metrics_port, a.checkpoint) == ("3/4", "127.0.0.1:7641", 9101, "/ck/s3.bin")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="needs torchrun's RANK"):
        resolve_shard(build_parser().parse_args(["--shard", "torchrun"]))
    with pytest.raises(ValueError, match="fixed --listen port"):
        with_port_offset("0.0.0.0:0", 1)
    a = build_parser().parse_args(["--shard", "1/3", "--fragments", "2", "--insecure", "--listen", "127.0.0.1:1"])
    with pytest.raises(ValueError, match="3 shards need at least 3 fragments"):
        config_from_args(a)
    a = build_parser().parse_args(["--shard", "0/2", "--fragments", "2", "--insecure", "--listen", "127.0.0.1:1",
                                   "--shard-addresses", "h:1,h:2,h:3"])
    with pytest.raises(ValueError, match="lists 3 addresses for 2 shards"):
        config_from_args(a)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--shard", "2/2"])
