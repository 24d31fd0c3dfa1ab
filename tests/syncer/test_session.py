"""syncer/net/session.py on its own: what a connection's writer and reader report when a send fails."""
import logging
import socket
import threading

import pytest

from yeto_patch.syncer.net.session import Session
from yeto_patch.wire import transport
from yeto_patch.wire.frames import WireTimeout

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def make_session():
    """Makes Sessions over real loopback connections (their peers are closed after the test)."""
    made = []

    def make(**kwargs):
        ls = transport.listen("127.0.0.1:0")
        peer = socket.create_connection(ls.getsockname()[:2], timeout=5)
        sock, _ = ls.accept()
        ls.close()
        made.append(peer)
        return Session(transport.Connection(sock, timeout=1.0), lambda *a: None, **kwargs)

    yield make
    for peer in made:
        peer.close()


def test_a_failed_send_is_logged_once_whichever_thread_reports_it(caplog, make_session):
    """The writer and the reader woken by its failure both report it (Session.send_failed): one warning, naming
    the cause, and the connection closed."""
    s = make_session()
    s.named("b")
    cause = WireTimeout("send to b stalled for more than 1.0s")
    with caplog.at_level(logging.INFO, logger="yeto"):
        threads = [threading.Thread(target=s.send_failed, args=(cause,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
    lines = [r.getMessage() for r in caplog.records if "send failed" in r.getMessage()]
    assert lines == ["island b: send failed (send to b stalled for more than 1.0s); closing its connection"]
    assert s.closed


def test_a_failed_send_after_the_run_is_over_is_not_a_warning(caplog, make_session):
    s = make_session(quiet=lambda: True)
    with caplog.at_level(logging.INFO, logger="yeto"):
        s.send_failed(WireTimeout("late"))
    assert not [r for r in caplog.records if "send failed" in r.getMessage()] and s.closed
