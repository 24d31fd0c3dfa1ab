"""Islands and syncers are started by different people: an island launched before its syncer waits for it (the
same back-off as a reconnect, bounded by YETO_DILOCO_TIMEOUT) and then trains its run to the final cut."""
import time

import numpy as np
import pytest

from tests.shim import procs as P


@pytest.mark.timeout(420)
def test_an_island_started_before_its_syncer_joins_when_it_comes_up(tmp_path):
    port = P.free_port()
    key = P.key_file(tmp_path)
    env = dict(YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_TIMEOUT=90)
    island = P.start_island(tmp_path, "early", port, ["--tp", "2"], 6, env)
    deadline = time.time() + 240
    while time.time() < deadline and "does not answer yet" not in island.text() and island.poll() is None:
        time.sleep(0.5)
    assert "does not answer yet" in island.text(), island.text()[-4000:]
    # the start-up policy before issue #13 bug 8 gave up after the back-offs that fit in half the timeout (about
    # 36 s here); the syncer comes up later than that, well within YETO_DILOCO_TIMEOUT
    time.sleep(50)
    assert island.poll() is None, island.text()[-4000:]
    syncer = P.start_syncer(tmp_path, port, islands=1, fragments=2, key=key)
    rcs = P.wait_all([island, syncer], timeout=300)
    assert rcs == [0, 0], P.logs([island, syncer])
    final, _ = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    model = P.island_model(str(tmp_path / "early"))
    assert sorted(model) == sorted(final)
    for k, v in final.items():
        assert np.array_equal(model[k], v), k
