"""Refusals and failures surface on every rank of an island as a clear error within the timeout, never a hang:
a wrong key, a model the run does not know (wrong manifest), a syncer that dies mid-run, and a bad YETO_* value
(every rank names the variable)."""
import time

import pytest

from tests.shim import procs as P

TIMEOUT = 40


def _island(tmp_path, name, port, env, layout=("--tp", "2"), steps=12):
    return P.start_island(tmp_path, name, port, list(layout), steps,
                          dict(YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_TIMEOUT=TIMEOUT, **env))


def _every_rank_says(tmp_path, name, *needles):
    errs = P.rank_stderr(str(tmp_path / name))
    assert sorted(errs) == [0, 1], errs
    for rank, text in errs.items():
        for n in needles:
            assert n in text, f"rank {rank} of {name} does not say {n!r}:\n{text[-3000:]}"


@pytest.mark.timeout(300)
def test_wrong_key_is_refused_on_every_rank(tmp_path):
    port = P.free_port()
    syncer = P.start_syncer(tmp_path, port, islands=1, fragments=2, key=P.key_file(tmp_path, "good.key"))
    bad = P.key_file(tmp_path, "bad.key", "ffffffffffffffffffffffffffffffff")
    island = _island(tmp_path, "wrongkey", port, dict(YETO_DILOCO_KEY_FILE=bad))
    t0 = time.time()
    rcs = P.wait_all([island], timeout=240)
    assert rcs[0] not in (0, None), P.logs([island, syncer])
    _every_rank_says(tmp_path, "wrongkey", "yeto-patch", "connect to the syncer")
    errs = P.rank_stderr(str(tmp_path / "wrongkey"))
    assert any(w in errs[0].lower() for w in ("auth", "key")), errs[0][-2000:]
    assert time.time() - t0 < 200
    syncer.kill()
    assert "auth" in syncer.text().lower()


@pytest.mark.timeout(300)
def test_a_different_model_is_refused_on_every_rank(tmp_path):
    port = P.free_port()
    key = P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=2, fragments=2, key=key)
    barrier = ["--start-barrier", str(tmp_path / "barrier")]
    two = _island(tmp_path, "two_layers", port, dict(YETO_DILOCO_KEY_FILE=key), steps=400,
                  layout=("--tp", "2", *barrier))
    four = _island(tmp_path, "four_layers", port, dict(YETO_DILOCO_KEY_FILE=key), steps=400,
                   layout=("--tp", "2", "--layers", "4", *barrier))
    deadline = time.time() + 240    # whichever connects second brings a model the run does not know
    while time.time() < deadline and two.poll() is None and four.poll() is None:
        time.sleep(0.3)
    refused, other = (two, four) if two.poll() is not None else (four, two)
    rcs = P.wait_all([refused], timeout=60)
    P.wait_all([other, syncer], timeout=0)
    assert rcs[0] not in (0, None), P.logs([two, four, syncer])
    _every_rank_says(tmp_path, refused.name, "yeto-patch", "manifest")


@pytest.mark.timeout(300)
def test_syncer_dying_mid_run_ends_every_rank_with_the_cause(tmp_path):
    port = P.free_port()
    key = P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=1, fragments=2, key=key)
    island = _island(tmp_path, "orphan", port, dict(YETO_DILOCO_KEY_FILE=key), steps=400)
    deadline = time.time() + 200
    while "merged fragment 1 -> v1" not in syncer.text() and time.time() < deadline and island.poll() is None:
        time.sleep(0.3)
    assert "merged fragment 1" in syncer.text(), P.logs([island, syncer])
    syncer.kill()
    t0 = time.time()
    rcs = P.wait_all([island], timeout=TIMEOUT + 120)
    assert rcs[0] not in (0, None), P.logs([island])
    assert time.time() - t0 < TIMEOUT + 100
    _every_rank_says(tmp_path, "orphan", "yeto-patch", "syncer")


@pytest.mark.timeout(300)
def test_bad_variable_stops_every_rank_naming_it(tmp_path):
    island = _island(tmp_path, "badvar", P.free_port(), dict(YETO_DILOCO_PUSH_DTYPE="int3", YETO_DILOCO_INSECURE=1))
    rcs = P.wait_all([island], timeout=200)
    assert rcs[0] not in (0, None), P.logs([island])
    _every_rank_says(tmp_path, "badvar", "ConfigError: YETO_DILOCO_PUSH_DTYPE='int3' is not accepted: use one of "
                                         "f32, bf16, int8, int4, int4-log")
