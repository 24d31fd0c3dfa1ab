"""Run control (issue 13, bug 9): an early FINAL does not end a run whose roster has not joined, a stalled INIT
is bounded and handed to another island, and an absurd first manifest is refused at HELLO."""
import threading
import time

import numpy as np
import pytest

from yeto_patch.wire import codecs
from yeto_patch.wire.frames import PeerError

from .helpers import MANIFEST, client, fragment_flat, init_values, make_server, running

pytestmark = pytest.mark.timeout(60)


def test_final_of_the_only_joined_island_does_not_end_the_run_before_the_roster_joined():
    server, addr = make_server(islands=2, fragments=3)
    with running(server):
        values = init_values()
        a = client(addr, "a")
        wa = a.connect()
        a.wait_ready(20, init_source=lambda f: [values[i] for i in wa.layout[f]])
        for f in range(3):  # waits for b: --islands 2 is the quorum and b never joined
            a.push(f, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(wa.numels[f], 0.01, np.float32)), wait=True)
        res = {}
        t = threading.Thread(target=lambda: res.update(a.finish(last_step=1, timeout=30)))
        t.start()
        time.sleep(1.5)
        assert not server.final_started, "a's FINAL ended the run before island b ever joined"
        assert not a.final_cut and server.coord.versions() == [0, 0, 0]
        b = client(addr, "b")
        b.connect()
        bb = b.wait_ready(20)
        for f in range(3):  # b's pushes answer the open rounds (a's pushes are in them): one merge each
            b.push(f, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.zeros(wa.numels[f], np.float32)), wait=True)
            assert bb[f].version == 0
        fb = b.finish(last_step=1, timeout=30)
        t.join(30)
        assert sorted(res) == [0, 1, 2] and [res[f].version for f in range(3)] == [1, 1, 1]
        assert [fb[f].version for f in range(3)] == [1, 1, 1]
        assert server.wait(20) == 0
        for c in (a, b):
            c.close()


@pytest.mark.parametrize("init_wait", [30.0, 1.0])
def test_elastic_final_of_the_only_joined_island_waits_for_the_roster_or_the_init_wait(init_wait):
    """Issue 35: with --islands 2 and elastic rounds, the only island that joined could send FINAL and end the run.
    FINALs now end a run only once its roster is complete or --init-wait passed since the first join; the control
    (--init-wait 1 s) ends the run on the same FINAL once the wait passed."""
    server, addr = make_server(islands=2, fragments=2, rounds={"quorum": None, "grace_s": None},
                               init_wait_s=init_wait)
    with running(server):
        values = init_values()
        a = client(addr, "a")
        wa = a.connect()
        a.wait_ready(20, init_source=lambda f: [values[i] for i in wa.layout[f]])
        res = {}
        t = threading.Thread(target=lambda: res.update(a.finish(last_step=1, timeout=30)))
        t.start()
        time.sleep(2.0)
        assert server.final_started == (init_wait < 2.0)
        if init_wait > 2.0:   # b joins and finishes too: the roster is complete, the run ends
            b = client(addr, "b")
            b.connect()
            b.wait_ready(20)
            b.finish(last_step=1, timeout=30)
            b.close()
        t.join(30)
        assert sorted(res) == [0, 1]
        assert server.wait(20) == 0
        a.close()


def test_partial_init_by_a_heartbeating_island_is_bounded_and_another_island_initializes():
    server, addr = make_server(islands=2, fragments=3, rounds={"lease_s": 1.0}, io_timeout_s=1.0)
    with running(server):
        bad_values, values = init_values(seed=5), init_values(seed=6)
        a = client(addr, "a")
        wa = a.connect()
        assert wa.needs_init == [0, 1, 2]
        a.send_init(0, [bad_values[i] for i in wa.layout[0]])  # ... and then only heartbeats
        b = client(addr, "b")
        wb = b.connect()
        assert wb.needs_init == []
        t0 = time.monotonic()
        bases = b.wait_ready(15, init_source=lambda f: [values[i] for i in wb.layout[f]])
        assert time.monotonic() - t0 < 10
        for f in range(3):  # the run is b's INIT, none of a's partial one
            assert bases[f].version == 0 and np.array_equal(bases[f].values, fragment_flat(values, wb.layout, f))
        got = a.wait_base(0, 0, 10)  # a is still served (it kept its connection) with b's base
        assert np.array_equal(got.values, fragment_flat(values, wa.layout, 0))
        for f in range(3):
            assert np.array_equal(server.coord.frags[f].t.base, fragment_flat(values, wb.layout, f))
        for c in (a, b):
            c.close()


def test_absurd_first_manifest_is_refused_at_hello():
    server, addr = make_server(islands=1, fragments=1)
    with running(server):
        huge = [("w", (1 << 20, 1 << 20), "float32")]  # 2**40 parameters, 4 TiB
        c = client(addr, "a", manifest=huge)
        with pytest.raises(PeerError) as e:
            c.connect()
        assert e.value.code == "manifest" and "--max-model-bytes" in str(e.value)
        assert server.coord.manifest is None  # nothing was fixed: a sane island still starts the run
        ok = client(addr, "b")
        w = ok.connect()
        assert w.needs_init == [0]
        ok.close()


def test_max_model_bytes_setting_bounds_the_manifest():
    server, addr = make_server(islands=1, fragments=1, max_model_bytes=1000)
    with running(server):
        c = client(addr, "a")  # the helpers' manifest: 3,616 parameters, 14 KiB
        with pytest.raises(PeerError) as e:
            c.connect()
        n = sum(int(np.prod(shape)) for _, shape, _ in MANIFEST)
        assert e.value.code == "manifest" and f"{n} parameters" in str(e.value)
