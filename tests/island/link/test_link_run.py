"""One run per handshake (issue 26, finding 3): the syncer names its run in its authenticated HELLO_OK; an island
refuses a syncer of another run on reconnect (a relay redirected it to a second syncer of the same model and
key) and, restarted from a sync state, a syncer of another run than the one it saved, saying so. The refusal
is transient: once its own run's syncer answers again the island reconnects."""
import threading
import time
import types

import pytest

from tests.island.link.test_syncer_link import _joined, settings
from tests.syncer.helpers import KEY, MANIFEST, init_values
from tests.syncer.relay import Relay
from yeto_patch.island.boundary import sync_state
from yeto_patch.island.errors import EngineError
from yeto_patch.island.link.sharded import ShardedLink
from yeto_patch.syncer.net.server import ServerConfig, SyncerServer
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.wire.client import SyncerClient
from yeto_patch.wire.transport import ConnectError

pytestmark = pytest.mark.timeout(120)


def _syncer(run_id, port=0):
    cfg = ServerConfig(listen=f"127.0.0.1:{port}", islands=2, fragments=2, key=KEY, run_id=run_id, initializer="first",
                       merge=MergeSettings(outer="avg"), rounds=RoundSettings(islands=2, quorum=1, grace_s=0.0,
                                                                   timeout_s=30.0, lease_s=20.0), merge_threads=1)
    s = SyncerServer(cfg)
    s.start()
    return s


def _initialized(s, seed):
    """Another island INITs syncer ``s`` with its own weights (the same model) and stays connected."""
    c = SyncerClient("127.0.0.1:%d" % s.address[1], KEY, "other", MANIFEST, timeout=10, connect_retries=2)
    w = c.connect()
    vals = init_values(seed=seed)
    c.wait_ready(10, init_source=lambda f: [vals[i] for i in w.layout[f]])
    return c


def test_a_reconnect_redirected_to_another_runs_syncer_is_refused_and_named(tmp_path, caplog):
    a, b = _syncer("run-A"), _syncer("run-B")
    other = _initialized(b, seed=5)
    relay = Relay(a.address[1])
    try:
        link, frags, _ = _joined(tmp_path, relay.port)   # joined run A through the relay
        link.settings.timeout = 3.0
        link.resilient = True
        relay.target = ("127.0.0.1", b.address[1])   # from now on the relay sends new connections to B
        caplog.set_level("WARNING", logger="yeto_patch")
        t0 = time.monotonic()
        with pytest.raises(EngineError) as ei:
            link.reconnect(ConnectionResetError("cut"))
        assert time.monotonic() - t0 >= 2.9   # tried again until the timeout (it may be a redirect)
        msg = str(ei.value)
        assert "run 'run-B'" in msg and "run 'run-A'" in msg, msg
        assert any("run 'run-B'" in r.getMessage() for r in caplog.records)   # said at the first refusal
        assert "a" not in b.coord.members   # refused before its MANIFEST: it never joined run B
        assert link.run_id == "run-A"
    finally:
        relay.close()
        other.close()
        a.stop()
        b.stop()


def test_the_refusal_is_transient_its_own_runs_syncer_is_joined_again(tmp_path):
    a, b = _syncer("run-A"), _syncer("run-B")
    other = _initialized(b, seed=5)
    relay = Relay(a.address[1])
    try:
        link, frags, values = _joined(tmp_path, relay.port)
        link.resilient = True
        relay.target = ("127.0.0.1", b.address[1])
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("ok", link.reconnect(ConnectionResetError("cut"))))
        th.start()
        deadline = time.monotonic() + 20
        while relay.connections < 3 and time.monotonic() < deadline:   # at least two attempts met run B
            time.sleep(0.05)
        relay.target = ("127.0.0.1", a.address[1])
        th.join(30)
        assert "ok" in out and link.run_id == "run-A"
        assert "a" in a.coord.alive_members() and "a" not in b.coord.members
        link.close()
    finally:
        relay.close()
        other.close()
        a.stop()
        b.stop()


def test_an_island_restarted_from_its_sync_state_refuses_a_syncer_of_another_run(tmp_path):
    """The run ids saved with the sync state are what the restarted island's link expects (engine: ``runs=``)."""
    a = _syncer("run-A")
    try:
        link, frags, _ = _joined(tmp_path, a.address[1])
        sharded = ShardedLink(settings(tmp_path, a.address[1]), MANIFEST)
        sharded.links.append(link)
        st = types.SimpleNamespace(island_id="a", push_dtype="f32", block=256, error_feedback=False)
        sync_state.save(str(tmp_path), 8, st, 8, "d", frags, run_ids=sharded.run_ids)
        assert sync_state.saved_runs(str(tmp_path), 8) == ["run-A"]
        assert sync_state.saved_runs(str(tmp_path), 9) is None
        link.close()
    finally:
        a.stop()
    b = _syncer("run-B", port=a.address[1])   # another run at the same address
    other = _initialized(b, seed=5)
    try:
        restarted = ShardedLink(settings(tmp_path, b.address[1], timeout=3.0), MANIFEST,
                                runs=sync_state.saved_runs(str(tmp_path), 8))
        with pytest.raises(ConnectError, match="run 'run-B'.*run 'run-A'"):
            restarted.open()
        assert "a" not in b.coord.members
        fresh = ShardedLink(settings(tmp_path, b.address[1], timeout=3.0), MANIFEST)   # no saved state: joins
        assert fresh.open().fragments == 2 and fresh.run_ids == ["run-B"]
        fresh.close()
    finally:
        other.close()
        b.stop()
