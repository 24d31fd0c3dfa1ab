"""What tells island processes apart does not come from the `random` module: Megatron seeds it with --seed, the same
on every island of a run and again when an island is relaunched, so an incarnation drawn from it would be the same
for all of them (the syncer would take a relaunched island for its earlier process) and every island would redial
a restarted syncer with the same back-off jitter."""
import random

import numpy as np
import pytest

from tests.shim.procs import free_port
from yeto_patch.wire import transport
from yeto_patch.wire.client import SyncerClient

def _client(name):
    return SyncerClient("127.0.0.1:1", None, name, [("w", np.zeros(4, np.float32).shape, "f32")], insecure=True)


def test_incarnations_differ_under_the_same_seed():
    drawn = []
    for name in ("a", "b", "a"):       # two islands, then island a relaunched: each process seeds the same way
        random.seed(1234)
        drawn.append(_client(name).incarnation)
    assert len(set(drawn)) == 3, drawn
    assert all(0 <= x < 2 ** 63 for x in drawn)


def test_back_off_jitter_differs_under_the_same_seed(monkeypatch):
    slept = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    port = free_port()                  # (nothing listens there)
    waits = []
    for _ in range(2):                  # two islands, each seeded with --seed 1234, redialling a syncer that is down
        random.seed(1234)
        slept.clear()
        with pytest.raises(transport.ConnectError):
            transport.connect(f"127.0.0.1:{port}", timeout=1.0, retries=3, backoff=1.0)
        waits.append(list(slept))
    assert len(waits[0]) == 3 and all(0.8 <= w / 2 ** i <= 1.2 for i, w in enumerate(waits[0])), waits
    assert waits[0] != waits[1], waits
