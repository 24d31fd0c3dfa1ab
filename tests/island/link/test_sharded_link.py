"""A sharded syncer (``--shard I/N``) with the island's ShardedLink, in-process over loopback (no torch): the
byte-balanced assignment, pushes routed to each fragment's owner and answered by it, a push sent to the wrong
shard refused, the final model assembled from every shard (each ends only when the island reached its last
step), shard 0 advertising the others, addresses out of order refused, and per-shard checkpoints that resume only
as the same shard of the same run."""
import os
import time

import numpy as np
import pytest

from tests.island.link.test_syncer_link import free_port, settings
from tests.syncer.helpers import KEY, MANIFEST, init_values
from yeto_patch.island.errors import EngineError
from yeto_patch.island.boundary.fragment import Fragments, PushWire
from yeto_patch.island.link.sharded import ShardedLink
from yeto_patch.syncer.model.checkpoint import CheckpointError
from yeto_patch.syncer.model.layout import fragment_numels, partition
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.syncer.net.server import ServerConfig, SyncerServer
from yeto_patch.syncer.shards.spec import ShardSpec, assign, parse_shard
from yeto_patch.wire import codecs
from yeto_patch.wire.client import SyncerRefusal

FRAGMENTS = 4


def shard(port, index, count, advertise=(), checkpoint=None, resume=False, run_id=None):
    cfg = ServerConfig(listen=f"127.0.0.1:{port}", islands=1, fragments=FRAGMENTS, key=KEY,
                       merge=MergeSettings(outer="avg"), rounds=RoundSettings(islands=1, grace_s=0.2, timeout_s=30.0,
                                                                   lease_s=20.0), merge_threads=1,
                       shard=ShardSpec(index, count), shard_addresses=tuple(advertise), checkpoint=checkpoint,
                       checkpoint_every=1 if checkpoint else 0, resume=resume, run_id=run_id,
                       final_ack_timeout_s=5.0)
    s = SyncerServer(cfg)
    s.start()
    return s


def shards(n, **kw):
    ports = [free_port() for _ in range(n)]
    return ports, [shard(p, i, n, **kw) for i, p in enumerate(ports)]


def addresses(ports):
    return ",".join(f"127.0.0.1:{p}" for p in ports)


def joined(tmp_path, syncer):
    values = init_values()
    st = settings(tmp_path, 0)
    st.syncer = syncer
    link = ShardedLink(st, MANIFEST, step=lambda: 3)
    w = link.open()
    frags = Fragments(w.layout, w.numels, [int(np.prod(s)) for _, s, _ in MANIFEST], announced=w.fragments)
    link.attach(frags)
    for f in w.needs_init:
        link.send_init(f, [values[i] for i in w.layout[f]])
    until(link, frags, lambda: all(st.side.arrived is not None for st in frags), "initial bases")
    for st in frags:
        st.installed(st.side.arrived.version)
        st.side.arrived = None
    return link, frags, values


def until(link, frags, ready, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what
        link.wait(0.5)
        frags.receive(link.poll())


def push(link, st, delta, final=False):
    body = codecs.encode("f32", delta, 256)
    st.count(5)
    st.count(5)
    st.begin_push(2, final)
    st.push_handed(PushWire(body, "f32"))
    link.send_push(st.outgoing(blend=False))


def stop_all(servers):
    for s in servers:
        s.stop()


def test_the_assignment_is_deterministic_byte_balanced_and_covers_every_fragment_once():
    numels = [1000, 10, 990, 500, 500, 7, 3]
    for n in range(1, len(numels) + 1):
        a = assign(numels, n)
        assert a == assign(list(numels), n) and sorted(f for fr in a for f in fr) == list(range(len(numels)))
        assert all(fr and fr == sorted(fr) for fr in a)
    loads = [sum(numels[f] for f in fr) for fr in assign(numels, 3)]
    assert max(loads) - min(loads) <= max(numels) and sorted(loads) == [1000, 1003, 1007]
    with pytest.raises(ValueError, match="at least 8 fragments"):
        assign(numels, 8)
    assert parse_shard(" 2 / 3") == ShardSpec(2, 3) and str(ShardSpec(1, 4)) == "1/4"
    for bad, why in (("3/3", "index 3"), ("1/0", "count 0"), ("a/b", "not I/N"), ("0/2000", "count 2000")):
        with pytest.raises(ValueError, match=why):
            parse_shard(bad)


def test_pushes_go_to_each_fragments_owner_and_the_final_model_comes_from_every_shard(tmp_path):
    ports, servers = shards(3)
    try:
        link, frags, values = joined(tmp_path, addresses(ports))
        layout = partition(MANIFEST, FRAGMENTS)
        owned = assign(fragment_numels(MANIFEST, layout), 3)
        assert [s.coord.owned for s in servers] == owned
        for s in servers:   # state only for its own fragments
            assert [f.index for f in s.coord.frags if f.has_base] == s.coord.owned
        for st in frags:   # (small enough for the outlier guard's cold start: the base is about 1 per value)
            push(link, st, np.full(st.numel, 0.05 * (1 + st.index), np.float32))
        until(link, frags, lambda: all(st.answered() for st in frags), "merged bases")
        for st in frags:
            flat = np.concatenate([values[i].reshape(-1) for i in st.entries])
            np.testing.assert_array_equal(st.side.arrived.values, flat - np.float32(0.05 * (1 + st.index)))
            st.installed(st.side.arrived.version)
        assert [s.coord.versions() for s in servers] == [
            [1 if f in own else None for f in range(FRAGMENTS)] for own in owned]
        out = None
        while out is None:
            out = link.final_model(3, time.monotonic() + 30, 5.0, drain=True)
        assert sorted(out) == list(range(FRAGMENTS)) and all(b.version == 1 and b.final for b in out.values())
        for s in servers:
            assert s.wait(10) == 0   # every shard ended its run
        link.close()
    finally:
        stop_all(servers)


def test_a_push_or_init_for_another_shards_fragment_is_refused(tmp_path):
    ports, servers = shards(2)
    try:
        link, frags, _ = joined(tmp_path, addresses(ports))
        foreign = servers[1].coord.owned[0]
        c = link.links[0].client            # shard 0's connection, asked to take shard 1's fragment
        body = codecs.encode("f32", np.zeros(frags[foreign].numel, np.float32), 256)
        with pytest.raises(SyncerRefusal, match="shard 1 owns it") as ei:
            c.push(foreign, base_version=0, local_step=1, steps=1, tokens=1, codec="f32", block=256, body=body,
                   wait=True, timeout=10)
        assert ei.value.code == "wrong-shard" and servers[0].coord.versions()[foreign] is None
        assert servers[1].coord.versions()[foreign] == 0      # its owner did not see it either
        link.close()
    finally:
        stop_all(servers)


def test_shard_0_tells_islands_the_other_shards_and_a_wrong_order_is_refused(tmp_path):
    ports = [free_port() for _ in range(3)]
    advertised = [f"127.0.0.1:{p}" for p in ports]
    servers = [shard(p, i, 3, advertise=advertised) for i, p in enumerate(ports)]
    try:
        link, frags, _ = joined(tmp_path, advertised[0])          # shard 0 alone: it names the others
        assert [lk.address for lk in link.links] == advertised
        link.close()
        swapped = ",".join([advertised[1], advertised[0], advertised[2]])
        with pytest.raises(EngineError, match=r"position 0\) is shard 1/3"):
            joined(tmp_path, swapped)
    finally:
        stop_all(servers)
    ports, servers = shards(2)   # no --shard-addresses: an island given one address is told to list them all
    try:
        with pytest.raises(EngineError, match="shard 0 of 2 and does not know"):
            joined(tmp_path, f"127.0.0.1:{ports[0]}")
    finally:
        stop_all(servers)


def test_each_shard_resumes_only_its_own_checkpoint_of_its_own_run(tmp_path):
    ports = [free_port() for _ in range(2)]
    ck = [str(tmp_path / f"shard{i}.ckpt") for i in range(2)]
    servers = [shard(p, i, 2, checkpoint=ck[i], run_id="run-a") for i, p in enumerate(ports)]
    try:
        link, frags, values = joined(tmp_path, addresses(ports))
        link.close()
    finally:
        stop_all(servers)
    assert all(os.path.exists(c) for c in ck)
    with pytest.raises(CheckpointError, match="written by syncer shard 1/2; this is shard 0/2"):
        shard(free_port(), 0, 2, checkpoint=ck[1], resume=True)
    with pytest.raises(CheckpointError, match="shard 0/2; this is shard 0/3"):
        shard(free_port(), 0, 3, checkpoint=ck[0], resume=True)
    with pytest.raises(CheckpointError, match="belongs to run 'run-a', not --run-id 'run-b'"):
        shard(free_port(), 1, 2, checkpoint=ck[1], resume=True, run_id="run-b")
    again = shard(free_port(), 1, 2, checkpoint=ck[1], resume=True)     # its own: resumes, run id kept
    try:
        assert again.run_id == "run-a" and again.coord.owned == servers[1].coord.owned
        assert [v is not None for v in again.coord.versions()] == [f in again.coord.owned for f in range(FRAGMENTS)]
    finally:
        again.stop()
