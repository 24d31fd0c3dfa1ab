"""Checkpoint format, atomicity, background snapshots, and bit-exact resume over loopback."""
import os
import time
import threading

import numpy as np
import pytest

from yeto_patch.syncer.model import checkpoint as ck
from yeto_patch.syncer.model.checkpoint import CheckpointError, CheckpointWriter, Snapshot, read_checkpoint, write_checkpoint
from yeto_patch.wire import codecs

from .helpers import client, init_values, make_server, running

pytestmark = pytest.mark.timeout(60)


def snap(values, version=1):
    meta = {"format": "yeto-syncer-checkpoint", "fragments": [{"index": i, "numel": int(v.size), "version": version}
                                                              for i, v in enumerate(values)]}
    return Snapshot(meta, [{"base": v, "momentum": v * 2} for v in values])


def test_roundtrip_and_corruption_is_detected(tmp_path):
    p = str(tmp_path / "c.bin")
    vals = [np.arange(10, dtype=np.float32), np.linspace(-1, 1, 1001, dtype=np.float32)]
    write_checkpoint(p, snap(vals))
    meta, arrays = read_checkpoint(p)
    assert meta["format"] == "yeto-syncer-checkpoint"
    assert all(np.array_equal(a["base"], v) and np.array_equal(a["momentum"], v * 2) for a, v in zip(arrays, vals))
    assert meta["fragments"][1]["arrays"]["base"]["offset"] % 64 == 0
    raw = bytearray(open(p, "rb").read())
    off = meta["fragments"][1]["arrays"]["base"]["offset"]
    raw[off + 5] ^= 0xFF
    bad = str(tmp_path / "bad.bin")
    open(bad, "wb").write(raw)
    with pytest.raises(CheckpointError, match="fragment 1 base: digest mismatch"):
        read_checkpoint(bad)
    open(bad, "wb").write(open(p, "rb").read()[:-10])
    with pytest.raises(CheckpointError, match="footer"):
        read_checkpoint(bad)
    open(bad, "wb").write(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(CheckpointError, match="not a yeto-patch"):
        read_checkpoint(bad)


def test_crash_between_write_and_rename_leaves_previous_loadable(tmp_path, monkeypatch):
    p = str(tmp_path / "c.bin")
    old = [np.full(100, 1.0, np.float32)]
    write_checkpoint(p, snap(old, version=3))

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(ck.os, "replace", crash)
    w = CheckpointWriter(p, background=True)
    w.save(snap([np.full(100, 2.0, np.float32)], version=4))
    with pytest.raises(CheckpointError, match="simulated crash"):
        w.wait()
    assert os.path.exists(p + ".tmp")  # the new data reached the disk, but never replaced the checkpoint
    meta, arrays = read_checkpoint(p)
    assert meta["fragments"][0]["version"] == 3 and np.array_equal(arrays[0]["base"], old[0])
    monkeypatch.undo()
    w.save(snap([np.full(100, 5.0, np.float32)], version=5))  # the next write replaces the stale .tmp
    w.wait()
    meta, arrays = read_checkpoint(p)
    assert meta["fragments"][0]["version"] == 5 and not os.path.exists(p + ".tmp")


def test_background_snapshot_copies_only_unwritten_fragments(tmp_path):
    p = str(tmp_path / "c.bin")
    a, b = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    s = snap([a, b])
    s.protect(1)  # a merge is about to change fragment 1: the snapshot keeps its old values
    b += 7
    assert s.arrays[1]["base"] is not b
    assert s.arrays[0]["base"] is a  # untouched fragments are not copied
    write_checkpoint(p, s)
    _, arrays = read_checkpoint(p)
    assert not arrays[1]["base"].any()
    s.protect(0)  # after the writer finished: nothing to copy
    assert s.arrays[0] == {}


def _deltas(rnd, f, k, n):
    rng = np.random.default_rng(1000 * rnd + 10 * f + k)
    return (rng.standard_normal(n) * 0.02).astype(np.float32)


def _run_rounds(addr, rounds, values, names=("a", "b"), final=True):
    cs = [client(addr, n) for n in names]
    ws = [c.connect() for c in cs]
    src = lambda f: [values[i] for i in ws[0].layout[f]]  # noqa: E731
    for c in cs:
        c.wait_ready(20, init_source=src)
    for rnd in rounds:
        for f in range(ws[0].fragments):
            n = ws[0].numels[f]
            for k, c in enumerate(cs):
                c.push(f, base_version=rnd, local_step=5 * (rnd + 1), steps=5, tokens=100 + k, codec="int4",
                       body=codecs.encode("int4", _deltas(rnd, f, k, n)), wait=True)
            for c in cs:
                c.wait_base(f, rnd + 1, 20)
    if final:
        th = [threading.Thread(target=c.finish, kwargs={"timeout": 20}) for c in cs]
        [t.start() for t in th]
        [t.join(30) for t in th]
    for c in cs:
        c.close()


@pytest.mark.parametrize("background", [False, True])
def test_resume_continues_bit_exactly(tmp_path, background):
    values = init_values(seed=9)
    kw = dict(islands=2, fragments=3, merge={"outer": "delayed-nesterov", "delay": 2, "weights": "tokens"},
              rounds={"quorum": 2})
    pa = str(tmp_path / "a.bin")
    server, addr = make_server(checkpoint=pa, checkpoint_every=3, **kw)
    with running(server):
        _run_rounds(addr, range(4), values)
        assert server.wait(20) == 0
    pb = str(tmp_path / "b.bin")
    server, addr = make_server(checkpoint=pb, checkpoint_every=3, background_checkpoint=background, **kw)
    with running(server):
        _run_rounds(addr, range(2), values, final=False)
    # the syncer died after round 2 (no final checkpoint): resume it from its last periodic checkpoint
    meta, _ = read_checkpoint(pb)
    assert [f["version"] for f in meta["fragments"]] == [2, 2, 2] and not meta["final"]
    server, addr = make_server(checkpoint=pb, checkpoint_every=3, resume=True, **kw)
    with running(server):
        _run_rounds(addr, range(2, 4), values)
        assert server.wait(20) == 0
    ma, xa = read_checkpoint(pa)
    mb, xb = read_checkpoint(pb)
    assert [f["version"] for f in mb["fragments"]] == [4, 4, 4] and mb["final"]
    for fa, fb in zip(xa, xb):
        assert set(fa) == set(fb) == {"base", "momentum", "delay_buf"}
        for k in fa:
            assert fa[k].tobytes() == fb[k].tobytes(), k
    assert ma["ledger"]["a"]["pushes"] == mb["ledger"]["a"]["pushes"] == 12


def test_refuses_to_overwrite_or_resume_with_other_settings(tmp_path):
    p = str(tmp_path / "c.bin")
    server, addr = make_server(islands=1, fragments=2, checkpoint=p, rounds={"total_rounds": 1})
    with running(server):
        _run_rounds(addr, range(1), init_values(), names=("a",))
        assert server.wait(20) == 0
    with pytest.raises(CheckpointError, match="--resume"):
        make_server(islands=1, fragments=2, checkpoint=p)
    with pytest.raises(CheckpointError, match="lr"):
        make_server(islands=1, fragments=2, checkpoint=p, resume=True, merge={"lr": 0.5})


def test_every_base_an_island_receives_is_on_disk_first_and_resume_refuses_merged_pushes(tmp_path):
    """--checkpoint-every 1: a base goes out only after the checkpoint that holds it, and the INIT is on disk
    before anyone trains.  After a resume, a push that was merged before the crash is a duplicate; a push that
    was only folded (its round had not merged) is taken again; the resumed run waits for its islands."""
    values = init_values(seed=4)
    p = str(tmp_path / "s.bin")
    kw = dict(islands=2, fragments=2, rounds={"quorum": 2, "lease_s": 30.0, "grace_s": 0.1})
    server, addr = make_server(checkpoint=p, checkpoint_every=1, **kw)
    with running(server):
        cs = [client(addr, i) for i in ("a", "b")]
        ws = [c.connect() for c in cs]
        layout = ws[0].layout
        cs[0].wait_ready(10, init_source=lambda f: [values[i] for i in layout[f]])
        cs[1].wait_ready(10)
        assert [f["version"] for f in read_checkpoint(p)[0]["fragments"]] == [0, 0]
        n = ws[0].numels
        for c in cs:
            c.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(n[0], 0.25, np.float32)), wait=True)
        b = cs[0].wait_base(0, 1, 10)
        meta, arrays = read_checkpoint(p)   # already on disk when the base arrived
        assert [f["version"] for f in meta["fragments"]] == [1, 0]
        assert arrays[0]["base"].tobytes() == b.values.tobytes()
        # fragment 1: a's push is folded, b never answers before the crash
        cs[0].push(1, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(n[1], 0.5, np.float32)), wait=True)
        for c in cs:
            c.conn.close()   # the syncer "crashes": nothing of the open round is on disk
    server, addr = make_server(checkpoint=p, checkpoint_every=1, resume=True, **kw)
    with running(server):
        assert server.coord.versions() == [1, 0]
        cs = [client(addr, i) for i in ("a", "b")]
        ws = [c.connect() for c in cs]
        assert [w.versions for w in ws] == [[1, 0], [1, 0]]
        from yeto_patch.wire.client import SyncerRefusal
        with pytest.raises(SyncerRefusal, match="duplicate"):   # merged before the crash: never counted twice
            cs[1].push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                       body=codecs.encode("f32", np.full(n[0], 0.25, np.float32)), wait=True)
        r = cs[0].push(1, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                       body=codecs.encode("f32", np.full(n[1], 0.5, np.float32)), wait=True)
        assert r.status == "accepted"
        time.sleep(0.5)
        assert server.coord.versions() == [1, 0]   # b is a member of the resumed run: waited for
        cs[1].push(1, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(n[1], 1.5, np.float32)), wait=True)
        assert cs[1].wait_base(1, 1, 10).version == 1
        assert [x["island"] for x in server.records[-1].responders] == ["a", "b"]
        for c in cs:
            c.close()
