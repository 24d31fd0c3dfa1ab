"""The island's keep-alive (yeto_patch/island/keepalive.py) with real threads: callbacks run only while their own
thread waits, every every_s seconds once the wait lasted that long; a wait does not return while a call runs; a
failing callback is logged once and dropped; with nothing registered a wait starts no thread. And the hook's
SectionPulse restarts exactly the sections its client has open (yeto_patch/hooks/mlm_ft.py; the real client
under ft_launcher: tests/shim/test_ft_launcher.py)."""
import logging
import threading
import time

import pytest

from yeto_patch.hooks.mlm_ft import SectionPulse
from yeto_patch.island import keepalive
from yeto_patch.island.keepalive import KeepAlive


def _sleeper(ka, seconds):
    @ka.waiting
    def wait():
        time.sleep(seconds)
        return "done"
    return wait


def test_nothing_registered_costs_no_thread():
    ka = KeepAlive()
    assert _sleeper(ka, 0.01)() == "done"
    assert ka._thread is None


def test_calls_come_every_period_of_a_long_wait_and_never_in_a_short_one():
    ka, times = KeepAlive(), []
    ka.register("x", lambda: times.append(time.monotonic()), every_s=0.1)
    t0 = time.monotonic()
    _sleeper(ka, 0.05)()
    time.sleep(0.15)                     # (outside a wait: no call)
    assert times == []
    t1 = time.monotonic()
    _sleeper(ka, 0.55)()
    end = time.monotonic()
    assert 3 <= len(times) <= 6, times
    assert all(t1 + 0.09 <= t <= end for t in times), (t0, t1, times)
    time.sleep(0.25)                     # the wait ended: no more calls
    assert ka.calls("x") == len(times) and len(times) <= 6


def test_only_the_registering_threads_waits_count():
    ka, calls = KeepAlive(), []
    ka.register("mine", lambda: calls.append(threading.get_ident()), every_s=0.05)
    other = threading.Thread(target=_sleeper(ka, 0.3))
    other.start()
    other.join()
    assert calls == []
    _sleeper(ka, 0.2)()
    assert calls and set(calls) != {threading.get_ident()}   # (called from the keep-alive thread, for this one)


def test_nested_waits_are_one_wait():
    ka = KeepAlive()
    ka.register("x", lambda: None, every_s=0.1)

    @ka.waiting
    def outer():
        for _ in range(6):
            _sleeper(ka, 0.05)()          # inner waits end every 50 ms: the outer one still counts
    outer()
    assert ka.calls("x") >= 2


def test_a_wait_returns_only_after_the_call_in_flight():
    ka, spans = KeepAlive(), []

    def slow():
        t = time.monotonic()
        time.sleep(0.3)
        spans.append((t, time.monotonic()))
    ka.register("slow", slow, every_s=0.05)
    _sleeper(ka, 0.1)()
    returned = time.monotonic()
    assert spans and spans[-1][1] <= returned, (spans, returned)


def test_a_failing_callback_is_logged_once_and_dropped(caplog):
    ka, n = KeepAlive(), []

    def broken():
        n.append(1)
        raise OSError("rank monitor gone")
    ka.register("broken", broken, every_s=0.05)
    with caplog.at_level(logging.WARNING, logger="yeto_patch"):
        assert _sleeper(ka, 0.3)() == "done"
        assert _sleeper(ka, 0.2)() == "done"
    assert len(n) == 1
    warned = [r.getMessage() for r in caplog.records if "keep-alive broken failed" in r.getMessage()]
    assert len(warned) == 1 and "rank monitor gone" in warned[0]


def test_unregister_stops_the_calls():
    ka = KeepAlive()
    ka.register("x", lambda: None, every_s=0.05)
    ka.unregister("x")
    _sleeper(ka, 0.2)()
    assert ka.registered() == [] and ka.calls("x") == 0
    with pytest.raises(ValueError):
        ka.register("y", lambda: None, every_s=0)


def test_the_islands_waits_are_waits():
    """The functions that block the training thread on rank 0, the syncer or background work run as waits."""
    from yeto_patch.island.boundary.background import BackgroundLane
    from yeto_patch.island.boundary.channel import IslandChannel
    from yeto_patch.island.boundary.parts import IslandParts
    from yeto_patch.island.boundary.push_lane import PushLane
    for fn in (IslandChannel.rank0, IslandParts.await_ready, BackgroundLane._wait, PushLane.wait_snapshots):
        assert fn.__code__ is keepalive.KEEPALIVE.waiting(lambda: None).__code__, fn.__qualname__


class FakeCalc:
    def __init__(self):
        self.open_sections = {}


class FakeClient:
    """RankMonitorClient's section interface as the FT package implements it (an open section is recorded only
    when the monitor times it; opening an open one or closing a closed one is an error)."""

    def __init__(self, timed=("setup", "step", "checkpointing")):
        self.is_initialized, self.timed, self.sent = True, timed, []
        self.timeouts_calc = FakeCalc()

    def start_section(self, s):
        if s in self.timed:
            assert s not in self.timeouts_calc.open_sections
            self.timeouts_calc.open_sections[s] = time.monotonic()
        self.sent.append(("open", s))

    def end_section(self, s):
        if s in self.timed:
            del self.timeouts_calc.open_sections[s]
        self.sent.append(("close", s))


def test_section_pulse_restarts_the_open_sections():
    c = FakeClient()
    pulse = SectionPulse(c)
    pulse()                               # nothing open (a warm-up iteration): nothing sent
    assert c.sent == []
    c.start_section("step")
    c.sent.clear()
    pulse()
    assert c.sent == [("close", "step"), ("open", "step")] and list(c.timeouts_calc.open_sections) == ["step"]
    c.is_initialized = False              # after shutdown: nothing
    pulse()
    assert len(c.sent) == 2 and pulse.pulses == 2
    c.timeouts_calc = object()            # a client that does not show its open sections: the keep-alive fails
    c.is_initialized = True
    with pytest.raises(RuntimeError, match="open_sections"):
        pulse()


def test_the_hook_registers_megatrons_client_after_setup_and_drops_it_at_shutdown(monkeypatch):
    import sys
    import types

    from yeto_patch.hooks import mlm_ft
    client = FakeClient()
    ft = types.ModuleType(mlm_ft.TARGET)
    ft.get_rank_monitor_client = lambda: client
    monkeypatch.setitem(sys.modules, mlm_ft.TARGET, ft)
    try:
        assert mlm_ft.setup_wrapper(lambda: "set up", None, (), {}) == "set up"
        assert mlm_ft.KEEPALIVE_NAME in keepalive.KEEPALIVE.registered()
        client.start_section("step")
        _sleeper(keepalive.KEEPALIVE, 1.3 * mlm_ft.PULSE_EVERY_S)()     # a wait on this thread: one pulse
        assert ("close", "step") in client.sent and list(client.timeouts_calc.open_sections) == ["step"]
        assert mlm_ft.shutdown_wrapper(lambda: "closed", None, (), {}) == "closed"
        assert mlm_ft.KEEPALIVE_NAME not in keepalive.KEEPALIVE.registered()
        ft.get_rank_monitor_client = lambda: None                       # without --enable-ft-package
        mlm_ft.setup_wrapper(lambda: None, None, (), {})
        assert mlm_ft.KEEPALIVE_NAME not in keepalive.KEEPALIVE.registered()
    finally:
        keepalive.KEEPALIVE.unregister(mlm_ft.KEEPALIVE_NAME)
