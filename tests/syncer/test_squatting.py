"""Handshake slots cannot be squatted (issue 13): connections from several addresses that never say HELLO fill
--max-handshakes, yet honest islands from another address still join, because the address holding the most slots
(or, among equals, a handshake older than EVICT_AFTER_S) gives way to a newcomer."""
import socket
import threading
import time

import pytest

from yeto_patch.syncer.net import admission as admission_mod
from yeto_patch.wire.frames import ProtocolError

from .helpers import client, make_server, running

pytestmark = pytest.mark.timeout(180)


def squat(addr, stop, sources, held):
    """Keep opening connections from each source address that send nothing; reopen the ones the syncer closes."""
    host, port = addr.rsplit(":", 1)
    socks = []
    while not stop.is_set():
        socks = [s for s in socks if s.fileno() != -1 and not _closed(s)]
        for src in sources:
            if stop.is_set():
                break
            try:
                s = socket.create_connection((host, int(port)), timeout=2, source_address=(src, 0))
                socks.append(s)
            except OSError:
                pass
        held.append(len(socks))
        time.sleep(0.2)
    for s in socks:
        s.close()


def _closed(s):
    s.setblocking(False)
    try:
        return s.recv(1 << 16, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


@pytest.mark.parametrize("sources", [[f"127.0.0.{i}" for i in range(2, 10)],    # 8 addresses, 16 slots each
                                     [f"127.0.{i}.{j}" for i in range(2, 4) for j in range(2, 42)]])  # 80, 1 each
def test_honest_islands_join_while_squatters_hold_every_handshake_slot(sources, monkeypatch):
    monkeypatch.setattr(admission_mod, "EVICT_AFTER_S", 2.0)   # (5 s by default; a handshake here takes ms)
    server, addr = make_server(islands=1, fragments=1, handshake_timeout_s=60.0, max_handshakes=32)
    with running(server):
        stop, held = threading.Event(), []
        t = threading.Thread(target=squat, args=(addr, stop, sources, held), daemon=True)
        t.start()
        try:
            deadline = time.monotonic() + 20
            while (not held or held[-1] < 32) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held and held[-1] >= 32, held[-5:]   # every slot is squatted
            joined, attempts = 0, 0
            for i in range(45):   # each join retried with a short back-off for up to 15 s, as an island's link does
                end = time.monotonic() + 15
                while True:
                    attempts += 1
                    c = client(addr, "honest", timeout=10)
                    try:
                        c.connect()
                        joined += 1
                        break
                    except ProtocolError:
                        if time.monotonic() > end:
                            raise
                        time.sleep(0.2)
                    finally:
                        c.close()
        finally:
            stop.set()
            t.join(10)
        assert joined == 45, (joined, attempts)


def test_a_handshake_whose_hello_verified_keeps_its_slot_while_a_stranger_can_give_way(monkeypatch):
    """docs/protocol.md (Limits): when every slot is taken, a handshake still UNAUTHENTICATED after EVICT_AFTER_S
    gives way first; a key holder whose HELLO verified (sending a large manifest over a slow link, say) keeps its
    slot even when it is the oldest (issue 26, finding 7)."""
    from yeto_patch.wire import auth
    from yeto_patch.wire.frames import MsgType

    from .helpers import MANIFEST, manifest_meta, raw_hello
    monkeypatch.setattr(admission_mod, "EVICT_AFTER_S", 0.5)
    server, addr = make_server(islands=1, fragments=1, handshake_timeout_s=30.0, max_handshakes=4)
    host, port = addr.rsplit(":", 1)
    with running(server):
        conn = raw_hello(addr, "a", auth.manifest_digest(MANIFEST))[0]   # the oldest handshake: HELLO verified
        assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK               # ... and its MANIFEST not sent yet
        squatters = [socket.create_connection((host, int(port)), timeout=2, source_address=(f"127.0.0.{i}", 0))
                     for i in (2, 3, 4)]
        time.sleep(0.8)   # every handshake is older than EVICT_AFTER_S; the table is full
        newcomer = socket.create_connection((host, int(port)), timeout=2, source_address=("127.0.0.5", 0))
        newcomer.settimeout(5)
        assert newcomer.recv(28)[:4] == b"YETO"   # admitted: its CHALLENGE came
        assert _drained_until_closed(squatters[0], 5)   # the oldest stranger gave way ...
        assert not any(_drained_until_closed(s, 0.3) for s in squatters[1:])   # ... and only it
        conn.send(MsgType.MANIFEST, manifest_meta(MANIFEST))
        assert conn.recv(timeout=5)[0] == MsgType.WELCOME   # the key holder's handshake completed
        for s in squatters + [newcomer]:
            s.close()
        conn.close()


def _drained_until_closed(s, timeout) -> bool:
    """Read what ``s`` received (its CHALLENGE) until the syncer closes it (True) or ``timeout`` passes (False)."""
    s.settimeout(0.1)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if s.recv(1 << 16) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


@pytest.mark.parametrize("idle", [8, 0])
def test_idle_authenticated_handshakes_give_way_to_an_island_that_joins(idle, monkeypatch):
    """Issue 35: authenticated handshakes left idle after HELLO_OK (a key holder's, every slot, each under its own
    id) kept an honest island out for the whole 10 s it tried. An authenticated handshake idle IDLE_AUTH_S now gives
    way when every slot is taken (ids not in the run first). The control: no idle handshakes."""
    from yeto_patch.wire import auth
    from yeto_patch.wire.frames import MsgType

    from .helpers import MANIFEST, raw_hello
    monkeypatch.setattr(admission_mod, "IDLE_AUTH_S", 1.0)
    server, addr = make_server(islands=1, fragments=1, handshake_timeout_s=60.0, max_handshakes=8,
                               max_handshakes_per_host=16)
    with running(server):
        idlers = []
        for k in range(idle):   # every slot: HELLO verified, MANIFEST never sent
            conn = raw_hello(addr, f"sybil-{k}", auth.manifest_digest(MANIFEST))[0]
            assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK
            idlers.append(conn)
        t0 = time.monotonic()
        while True:   # the honest island retries with a short back-off, as an island's link does, for 10 s
            c = client(addr, "honest", timeout=10)
            try:
                c.connect()
                break
            except ProtocolError:
                assert time.monotonic() - t0 < 10, "the idle authenticated handshakes kept the island out"
                time.sleep(0.2)
            finally:
                c.close()
        assert time.monotonic() - t0 < (4.0 if idle else 1.0)
        for conn in idlers:
            conn.close()
