"""One island cannot speak for another (issue #13): with per-island keys an id can only be claimed with its own
key; with the shared key a connected id can be claimed again only by its own session (the resumption secret
both sides derived at its handshake), or once that connection is gone; reconnects and restarts keep working."""
import time

import numpy as np
import pytest

from yeto_patch.wire import codecs
from yeto_patch.wire.frames import PeerError

from .helpers import KEY, client, init_values, make_server, running

pytestmark = pytest.mark.timeout(60)
VALUES = init_values()
KA, KB = b"a" * 32, b"b" * 32


def _other_process(addr):
    """The same syncer under another address: a client there holds no resumption secret of this process's
    sessions, as another process (or another key holder) would."""
    return "localhost:" + addr.rsplit(":", 1)[1]


def _ready(c):
    w = c.connect()
    c.wait_ready(20, init_source=lambda f: [VALUES[i] for i in w.layout[f]])
    return w


def test_a_connected_island_id_cannot_be_taken_over_with_the_shared_key():
    server, addr = make_server(islands=2, fragments=1, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a")
        w = _ready(a)
        eve = client(_other_process(addr), "a", connect_retries=0)
        with pytest.raises(PeerError) as e:
            eve.connect()
        assert e.value.code == "island-taken" and "resumption" in e.value.message
        assert server.sessions["a"].conn is a.conn or not server.sessions["a"].closed
        r = a.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.zeros(w.numels[0], np.float32)), wait=True)
        assert r.status == "accepted"   # the real island is undisturbed
        a.close()


def test_the_same_session_reconnects_while_its_old_connection_is_still_open():
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a")
        _ready(a)
        old = server.sessions["a"]
        # the link is cut without the syncer noticing (no FIN): the old connection stays open on its side
        a2 = client(addr, "a", incarnation=a.incarnation)
        a2.connect()
        a2.wait_ready(20)
        assert server.sessions["a"] is not old
        deadline = time.monotonic() + 5
        while not old.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert old.closed   # replaced
        a2.close()
        a.abort()


def test_a_restarted_island_joins_once_its_old_connection_is_gone():
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a")
        _ready(a)
        a.abort()   # the process died: its socket closes, the secret is lost with it
        deadline = time.monotonic() + 10
        while True:
            r = client(_other_process(addr), "a", connect_retries=0)   # new incarnation, no secret
            try:
                r.connect()
                break
            except PeerError as e:
                assert e.code == "island-taken"
                assert time.monotonic() < deadline, "the restarted island was never let in"
                time.sleep(0.1)
        r.wait_ready(20)
        r.close()


def test_per_island_keys():
    server, addr = make_server(islands=3, fragments=1, key=None, island_keys={"a": KA, "b": KB},
                               rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        a = client(addr, "a", key=KA)
        w = _ready(a)
        for island, key in (("b", KA), ("a", KB), ("c", KA), ("c", KEY)):
            with pytest.raises(PeerError) as e:
                client(addr, island, key=key, connect_retries=0).connect()
            assert e.value.code == "auth", (island, e.value)
        b = client(addr, "b", key=KB)
        b.connect()
        b.wait_ready(20)
        r = b.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.zeros(w.numels[0], np.float32)), wait=True)
        assert r.status == "accepted"
        a.close()
        b.close()


def test_island_key_directory(tmp_path):
    from yeto_patch.syncer import cli
    from yeto_patch.wire import auth
    from yeto_patch.wire.frames import AuthError
    for name, key in (("a.key", KA), ("b.key", KB), ("notes.txt", b"ignored")):
        p = tmp_path / name
        p.write_bytes(key + b"\n")
        p.chmod(0o600)
    assert auth.load_island_keys(str(tmp_path)) == {"a": KA, "b": KB}
    cfg = cli.config_from_args(cli.build_parser().parse_args(["--island-keys", str(tmp_path), "--listen",
                                                              "0.0.0.0:0", "--encrypt"]))
    assert cfg.island_keys == {"a": KA, "b": KB} and cfg.encrypt
    (tmp_path / "b.key").chmod(0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        auth.load_island_keys(str(tmp_path))
    with pytest.raises(AuthError, match="cannot read the island key directory"):
        auth.load_island_keys(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AuthError, match="no <island id>.key"):
        auth.load_island_keys(str(tmp_path / "empty"))
