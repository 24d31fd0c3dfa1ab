"""Checkpoint crash safety: a writer SIGKILLed at random moments always leaves a checkpoint that loads and holds
exactly the previous or the new state, never a partial one; a real syncer killed mid-run resumes from its
checkpoint with the bases the island last received for those versions."""
import collections
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from yeto_patch.syncer.model.checkpoint import Snapshot, read_checkpoint, write_checkpoint
from yeto_patch.wire import codecs
from yeto_patch.wire.client import SyncerClient
from yeto_patch.wire.frames import ProtocolError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT}
pytestmark = pytest.mark.timeout(180)

N = 1 << 19  # float32 values per array: 2 MiB, 8 MiB per checkpoint (about 10 ms to write here)
WRITER = r"""
import sys
import numpy as np
from yeto_patch.syncer.model.checkpoint import Snapshot, write_checkpoint
path, v, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ramp = np.arange(n, dtype=np.float32)
print("ready", flush=True)
while True:
    v += 1
    meta = {"version": v, "fragments": [{"index": i, "numel": n, "version": v} for i in range(2)]}
    write_checkpoint(path, Snapshot(meta, [{"base": ramp + np.float32(v + i), "momentum": ramp - np.float32(v + i)}
                                           for i in range(2)]))
    print(v, flush=True)
"""


def snapshot(v: int) -> Snapshot:
    ramp = np.arange(N, dtype=np.float32)
    meta = {"version": v, "fragments": [{"index": i, "numel": N, "version": v} for i in range(2)]}
    return Snapshot(meta, [{"base": ramp + np.float32(v + i), "momentum": ramp - np.float32(v + i)} for i in range(2)])


def test_writer_killed_at_random_moments_leaves_the_previous_or_the_new_checkpoint(tmp_path):
    rng = random.Random(11)
    path = str(tmp_path / "c.ckpt")
    t0 = time.perf_counter()
    write_checkpoint(path, snapshot(0))
    one_write = time.perf_counter() - t0          # kill moments spread over a few writes, however fast this host
    v, seen = 0, collections.Counter()
    for _ in range(300):
        if seen["killed mid-write"] >= 20 and seen["writes completed"] >= 20:
            break
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(v), str(N)], stdout=subprocess.PIPE,
                                env=ENV)
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 4 * one_write))
        proc.kill()
        proc.wait()
        written = [int(x) for x in proc.stdout.read().split()]  # writes that returned before the kill
        last = written[-1] if written else v
        meta, arrays = read_checkpoint(path)  # must load: verifies the footer and every digest
        got = meta["version"]
        assert got in (last, last + 1), f"loaded v{got}; the writer had finished v{last}"
        want = snapshot(got).arrays
        for f in range(2):
            for name in ("base", "momentum"):
                assert np.array_equal(arrays[f][name], want[f][name]), (got, f, name)
        seen["killed mid-write"] += os.path.exists(path + ".tmp")
        seen["writes completed"] += len(written)
        seen["loaded the new one (killed after its rename)"] += got == last + 1
        v = got
    # the random moments did land inside writes, and between them
    assert seen["killed mid-write"] >= 20 and seen["writes completed"] >= 20, seen


MANIFEST = [("w0", (512, 512), "float32"), ("w1", (512, 512), "float32"), ("b", (512,), "float32")]


def test_syncer_killed_mid_run_resumes_from_its_checkpoint(tmp_path):
    rng = random.Random(5)
    ckpt = str(tmp_path / "syncer.ckpt")
    values = [np.random.default_rng(0).standard_normal(s).astype(np.float32) for _, s, _ in MANIFEST]
    received = {}  # (fragment, version) -> base values the island received
    last_versions, arrays = [0, 0], None  # (what the last kill left in the checkpoint)
    for cycle in range(5):
        cmd = [sys.executable, "-m", "yeto_patch.syncer", "--listen", "127.0.0.1:0", "--insecure", "--islands", "1",
               "--fragments", "2", "--checkpoint", ckpt, "--checkpoint-every", "1", "--grace", "0",
               "--merge-threads", "1", "--log-level", "WARNING"] + (["--resume"] if cycle else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=ENV)
        c = None
        try:
            addr = proc.stdout.readline().decode().strip().rsplit(" ", 1)[-1]
            c = SyncerClient(addr, None, "solo", MANIFEST, timeout=20, insecure=True, connect_retries=3)
            w = c.connect()
            bases = c.wait_ready(30, init_source=lambda f: [values[i] for i in w.layout[f]])
            if cycle:  # resumed: exactly the checkpointed versions and bases
                assert w.needs_init == [] and w.versions == last_versions
                for f in range(2):
                    assert np.array_equal(bases[f].values, arrays[f]["base"])
            if cycle == 4:
                break
            stop = threading.Event()

            def pusher():
                v = list(w.versions or [0, 0])
                try:
                    while not stop.is_set():
                        for f in range(2):
                            d = np.full(w.numels[f], 0.001 * (v[f] + 1), np.float32)
                            c.push(f, base_version=v[f], local_step=1, steps=1, tokens=1, codec="f32",
                                   body=codecs.encode("f32", d), wait=True)
                            b = c.wait_base(f, v[f] + 1, 20)
                            received[(f, b.version)] = b.values.copy()
                            v[f] = b.version
                except (ProtocolError, OSError):
                    pass  # the syncer was killed

            th = threading.Thread(target=pusher, daemon=True)
            th.start()
            time.sleep(rng.uniform(0.3, 1.0))
            proc.kill()  # mid-run: merging, broadcasting and checkpointing continuously
            proc.wait()
            stop.set()
            th.join(30)
        finally:
            if c is not None:
                c.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        meta, arrays = read_checkpoint(ckpt)
        versions = [fm["version"] for fm in meta["fragments"]]
        assert all(a >= b for a, b in zip(versions, last_versions)), (versions, last_versions)
        for f in range(2):
            # a base goes out only after the checkpoint that holds it: every base received is on disk, and the
            # checkpoint is at most one merge ahead (written, then killed before it was sent)
            got = max([v for ff, v in received if ff == f], default=0)
            assert got <= versions[f] <= got + 1, (f, got, versions[f])
            if (f, versions[f]) in received:
                assert np.array_equal(arrays[f]["base"], received[(f, versions[f])])
        last_versions = versions
    assert sum(last_versions) >= 8, last_versions  # merges happened between the kills
