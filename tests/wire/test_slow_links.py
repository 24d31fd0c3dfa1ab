"""Send and receive on one connection keep their own deadlines: a receive waiting (briefly, in a loop, as the
island's and the syncer's readers do) never shortens a concurrent send's timeout (issue #13, bug 2)."""
import socket
import threading
import time

import pytest

from yeto_patch.wire import transport
from yeto_patch.wire.frames import BrokenHere, MsgType, WireTimeout

pytestmark = pytest.mark.timeout(60)
BODY = 32 << 20


def _pair(timeout):
    ls = transport.listen("127.0.0.1:0")
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    raw.connect(ls.getsockname()[:2])
    s, _ = ls.accept()
    ls.close()
    return raw, transport.Connection(s, timeout=timeout)


def _poll_reader(conn, stop):
    """What the readers do: wait for the next message in short slices, forever."""
    while not stop.is_set():
        try:
            conn.recv(timeout=0.2)
        except WireTimeout:
            if conn.broken:
                return
        except Exception:  # noqa: BLE001 - the connection went away
            return


def _drain(raw, pause_after, pause_s, box):
    got = 0
    paused = False
    while True:
        if not paused and got >= pause_after:
            time.sleep(pause_s)
            paused = True
        try:
            d = raw.recv(1 << 20)
        except OSError:
            break
        if not d:
            break
        got += len(d)
    box["got"] = got


def test_a_pause_shorter_than_the_timeout_does_not_fail_a_send():
    raw, conn = _pair(timeout=30.0)
    stop = threading.Event()
    rd = threading.Thread(target=_poll_reader, args=(conn, stop), daemon=True)
    rd.start()
    box = {}
    dr = threading.Thread(target=_drain, args=(raw, 8 << 20, 1.5, box), daemon=True)
    dr.start()
    t0 = time.monotonic()
    conn.send(MsgType.PUSH, {"x": 1}, b"\0" * BODY)   # old code: WireTimeout after ~0.2 s of the pause
    took = time.monotonic() - t0
    assert took >= 1.4 and not conn.broken
    raw.shutdown(socket.SHUT_WR)
    conn.close()
    dr.join(10)
    stop.set()
    rd.join(5)
    assert box["got"] > BODY


def test_a_peer_that_reads_nothing_for_longer_than_the_timeout_is_dropped_truthfully():
    raw, conn = _pair(timeout=1.5)
    stop = threading.Event()
    rd = threading.Thread(target=_poll_reader, args=(conn, stop), daemon=True)
    rd.start()
    t0 = time.monotonic()
    with pytest.raises(WireTimeout, match=r"stalled for more than 1.5s") as e:
        conn.send(MsgType.PUSH, {"x": 1}, b"\0" * BODY)
    took = time.monotonic() - t0
    assert 1.5 <= took < 6, took   # the stall really lasted the timeout (old code: ~0.2 s)
    assert "read nothing for 1." in str(e.value)
    assert conn.broken
    stop.set()
    rd.join(5)
    raw.close()
    conn.close()


def test_a_read_woken_by_the_sends_stall_reports_the_stall_not_the_peer():
    """The syncer's reader waits for the island's next message while its writer streams a base. When the send
    times out it shuts the socket down, and the read wakes to an empty socket: that read must name the stall
    (BrokenHere), not claim the peer closed the connection (the syncer then logged the wrong cause, or none)."""
    raw, conn = _pair(timeout=1.0)
    box = {}

    def read_once():
        try:
            conn.recv(timeout=30)
        except Exception as e:  # noqa: BLE001 - the test looks at what was raised
            box["error"] = e
            box["at"] = time.monotonic()

    rd = threading.Thread(target=read_once, daemon=True)
    rd.start()
    time.sleep(0.2)   # the read is now waiting in poll
    with pytest.raises(WireTimeout) as sent:
        conn.send(MsgType.BASE, {"x": 1}, b"\0" * BODY)
    broke_at = time.monotonic()
    rd.join(5)
    assert isinstance(box.get("error"), BrokenHere), box
    assert str(box["error"]) == str(sent.value) and "stalled for more than 1.0s" in str(box["error"])
    assert box["at"] - broke_at < 2   # woken by the break, not by its own 30 s wait
    raw.close()
    conn.close()
