"""Background sender: order, back-pressure by bytes, failures re-raised on the next call, never swallowed."""
import threading
import time

import pytest

from yeto_patch.wire.frames import WireTimeout
from yeto_patch.wire.sender import BackgroundSender, SenderClosed

pytestmark = pytest.mark.timeout(30)


def test_runs_in_order_and_drains():
    s = BackgroundSender(1000)
    out = []
    for i in range(20):
        s.submit(lambda i=i: out.append(i), 10)
    s.drain(5)
    assert out == list(range(20)) and s.queued_bytes == 0
    s.close(5)


def test_back_pressure_blocks_until_bytes_free():
    s = BackgroundSender(100)
    gate = threading.Event()
    s.submit(gate.wait, 60)  # running, holds 60 bytes
    s.submit(lambda: None, 40)  # fits exactly
    with pytest.raises(WireTimeout, match="still holds 100 bytes"):
        s.submit(lambda: None, 1, timeout=0.2)
    done = threading.Event()

    def blocked():
        s.submit(lambda: None, 50)
        done.set()
    th = threading.Thread(target=blocked)
    th.start()
    assert not done.wait(0.3)  # blocked by back-pressure
    gate.set()
    assert done.wait(5)
    th.join()
    s.close(5)


def test_job_larger_than_bound_runs_when_idle():
    s = BackgroundSender(10)
    ran = []
    s.submit(lambda: ran.append(1), 1000)
    s.submit(lambda: ran.append(2), 1000)  # waits for the first to finish, then runs alone
    s.close(5)
    assert ran == [1, 2]


def test_failure_reraised_on_next_call_and_stays():
    s = BackgroundSender(1000)
    ran = []
    gate = threading.Event()

    def boom():
        gate.wait()
        raise ConnectionResetError("syncer went away")
    s.submit(boom, 10)
    s.submit(lambda: ran.append("queued behind failure"), 10)
    gate.set()
    with pytest.raises(ConnectionResetError, match="syncer went away"):
        s.drain(5)
    with pytest.raises(ConnectionResetError):
        s.check()
    with pytest.raises(ConnectionResetError):
        s.submit(lambda: ran.append("after"), 1)
    with pytest.raises(ConnectionResetError):
        s.close(5)
    assert ran == [] and s.failed


def test_failure_surfaces_on_submit():
    s = BackgroundSender(1000)
    s.submit(lambda: 1 / 0, 1)
    deadline = time.monotonic() + 5
    while not s.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ZeroDivisionError):
        s.submit(lambda: None, 1)


def test_drain_timeout_and_closed():
    s = BackgroundSender(1000)
    gate = threading.Event()
    s.submit(gate.wait, 1)
    with pytest.raises(WireTimeout, match="did not drain"):
        s.drain(0.2)
    gate.set()
    s.close(5)
    with pytest.raises(SenderClosed):
        s.submit(lambda: None, 1)
    with pytest.raises(ValueError):
        BackgroundSender(0)


def test_abort_drops_queued_jobs_and_lets_the_running_one_end():
    s = BackgroundSender(1000)
    gate, started, ran = threading.Event(), threading.Event(), []
    s.submit(lambda: (started.set(), gate.wait(5), ran.append("first")), 10)
    for i in range(3):
        s.submit(lambda i=i: ran.append(i), 10)
    assert started.wait(5)   # the first job is running when the link is declared gone
    threading.Timer(0.2, gate.set).start()
    s.abort(timeout=5)
    assert ran == ["first"] and s.queued_bytes == 0
    with pytest.raises(SenderClosed):
        s.submit(lambda: None, 1)
