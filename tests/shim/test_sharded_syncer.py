"""A sharded syncer end to end on real megatron-core (CPU, gloo): islands of different layouts (TP2 and one rank)
launched with torchrun from an ordinary training script, against one syncer and against three shards started as
plain processes with `--shard I/N`. With a fixed roster, float32 pushes and tau = 0 the final models are
bit-identical, every shard holds only its own fragments, and a shard SIGKILLed in the middle of the run and
resumed from its own checkpoint changes nothing."""
import os
import signal
import time

import numpy as np
import pytest

from tests.shim import procs as P

STEPS, H, FRAGMENTS, SHARDS = 16, 4, 4, 3
ENV = dict(YETO_DILOCO_SYNC_EVERY=H, YETO_DILOCO_PUSH_DTYPE="f32", YETO_DILOCO_OVERLAP_STEPS=0,
           YETO_DILOCO_CHUNK_BYTES="64K", YETO_DILOCO_TIMEOUT=120)
ISLANDS = (("a", ["--tp", "2", "--data-seed", "1"], 2), ("b", ["--data-seed", "2"], 1))
SYNCER_ARGS = ["--checkpoint-every", "1", "--lease", "20", "--init-lowest-id", "--run-id", "sharded-test"]


def tape(tmp, name):
    try:
        with open(tmp / name) as f:
            return [line for line in f if line.strip()]
    except FileNotFoundError:
        return []


def run(tmp, shards, kill_shard=None, timeout=420):
    """One run of islands a and b against `shards` syncer processes (0: one unsharded syncer). kill_shard: SIGKILL
    that shard once it merged 2 rounds, restart it with --resume after a pause. Returns the final model."""
    key = P.key_file(tmp)
    ports = [P.free_port() for _ in range(max(1, shards))]
    syncers = []
    for i, port in enumerate(ports):
        extra = [*SYNCER_ARGS, *(["--shard", f"{i}/{shards}"] if shards else [])]
        syncers.append(P.start_syncer(tmp, port, fragments=FRAGMENTS, key=key, extra=extra,
                                      name=f"shard{i}" if shards else "syncer", files=f"shard{i}" if shards else "syncer"))
    address = ",".join(f"127.0.0.1:{p}" for p in ports)
    env = dict(ENV, YETO_DILOCO_KEY_FILE=key)
    islands = [P.start_island(tmp, name, address, [*args, "--start-barrier", str(tmp / "barrier")], STEPS, env,
                              nproc=nproc) for name, args, nproc in ISLANDS]
    procs, deadline, killed = [*syncers, *islands], time.time() + timeout, False
    try:
        while time.time() < deadline:
            if kill_shard is not None and not killed and len(tape(tmp, f"shard{kill_shard}.tape.jsonl")) >= 2:
                victim = syncers[kill_shard]
                os.kill(victim.p.pid, signal.SIGKILL)
                victim.p.wait(10)
                killed = True
                time.sleep(2.0)   # the islands reach the dead shard's next boundary and wait for it
                syncers[kill_shard] = P.start_syncer(
                    tmp, ports[kill_shard], fragments=FRAGMENTS, key=key, name=f"shard{kill_shard}-resumed",
                    files=f"shard{kill_shard}", extra=[*SYNCER_ARGS, "--shard", f"{kill_shard}/{shards}", "--resume"])
                procs.append(syncers[kill_shard])
            rcs = [p.poll() for p in [*syncers, *islands]]
            if all(rc is not None for rc in rcs) or any(rc not in (None, 0) for rc in rcs):
                break
            time.sleep(0.1)
        rcs = [p.poll() for p in [*syncers, *islands]]
    finally:
        time.sleep(0.5)
        for p in procs:
            p.kill()
    assert rcs == [0] * len(rcs) and killed == (kill_shard is not None), P.logs(procs)
    ckpts = [str(tmp / f"shard{i}.ckpt") for i in range(shards)] if shards else str(tmp / "syncer.ckpt")
    model, versions = P.syncer_model(ckpts)
    assert sorted(versions) == list(range(FRAGMENTS)) and all(v >= STEPS // H for v in versions.values()), versions
    for name, _, _ in ISLANDS:   # every island ends holding the syncer's final model, assembled from the shards
        masters = P.island_model(str(tmp / name))
        assert sorted(masters) == sorted(model), name
        assert all(np.array_equal(masters[k], v) for k, v in model.items()), name
    return model, procs


def same(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("one-syncer"), 0)[0]


@pytest.mark.timeout(900)
def test_three_shards_end_with_the_model_of_one_syncer_bit_for_bit(reference, tmp_path):
    model, _ = run(tmp_path, SHARDS)
    assert same(model, reference)
    from yeto_patch.syncer.model.checkpoint import read_checkpoint
    held = [[fm["index"] for fm in read_checkpoint(str(tmp_path / f"shard{i}.ckpt"))[0]["fragments"]]
            for i in range(SHARDS)]
    assert sorted(f for h in held for f in h) == list(range(FRAGMENTS)) and all(held), held   # each its own
    assert all("syncer done:" in (tmp_path / f"shard{i}.log").read_text() for i in range(SHARDS))
    assert all("joined 3 syncer shards" in (tmp_path / f"{name}.log").read_text() for name, _, _ in ISLANDS)


@pytest.mark.timeout(900)
def test_a_shard_killed_and_resumed_changes_nothing(reference, tmp_path):
    model, _ = run(tmp_path, SHARDS, kill_shard=1)
    assert same(model, reference)
    for name, _, _ in ISLANDS:
        rec = [r for r in P.metrics(str(tmp_path / name)) if r["event"] == "reconnect"]
        assert rec, f"island {name} never reconnected to the resumed shard"
