"""Which island's INIT becomes the run's initial base (syncer/model/initializer.py): by default the lowest island id once
every island of the roster joined, whatever the order they connect in (or --init-wait after the first join);
`first` takes the first to join; an island id names it; an island declaring YETO_DILOCO_INITIALIZER=1 is taken as
soon as it joins, and a declaration the syncer cannot honour is refused at the join, never lost silently."""
import threading
import time

import numpy as np
import pytest

from yeto_patch.syncer.model.initializer import InitChoice, policy_arg
from yeto_patch.wire.frames import PeerError

from .helpers import MANIFEST, client, fragment_flat, init_values, join_all, make_server, running

pytestmark = pytest.mark.timeout(60)
DIGESTS = {k: [f"{k:016x}"] * len(MANIFEST) for k in range(3)}   # start digests of three different weights


def start_all(cs, ws, values):
    """Every client waits for its initial bases, INITing with its own weights if asked; {island: bases}."""
    layout, bases = ws[0].layout, {}

    def ready(c):
        bases[c.island_id] = c.wait_ready(20, init_source=lambda f: [values[c.island_id][i] for i in layout[f]])
    ts = [threading.Thread(target=ready, args=(c,), daemon=True) for c in cs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return layout, bases


def assert_start(bases, values, layout, source, islands):
    assert sorted(bases) == sorted(islands)
    for n in islands:
        for f in range(len(layout)):
            assert np.array_equal(bases[n][f].values, fragment_flat(values[source], layout, f)), (n, f)


@pytest.mark.parametrize("order", [["c", "b", "a"], ["a", "c", "b"], ["b", "a", "c"]])
def test_default_is_the_lowest_id_of_the_complete_roster_whatever_the_connection_order(order):
    server, addr = make_server(islands=3, fragments=2, initializer="lowest-id")
    with running(server):
        cs = [client(addr, n) for n in order]
        ws = []
        for c in cs[:2]:
            ws.append(c.connect())
            time.sleep(0.2)
            assert c.init_requested() == []            # nobody initializes before the roster is complete
        ws.append(cs[2].connect())
        assert [w.needs_init for w in ws[:2]] == [[], []]
        assert ws[2].needs_init == ([0, 1] if order[2] == "a" else [])
        values = {n: init_values(seed=k) for k, n in enumerate("abc")}   # every island's own weights
        layout, bases = start_all(cs, ws, values)
        assert_start(bases, values, layout, "a", "abc")
        for c in cs:
            c.close()


def test_first_is_the_first_to_join():
    server, addr = make_server(islands=3, fragments=2, initializer="first", rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        values = init_values(seed=3)
        cs, ws, layout, bases = join_all(addr, ["c", "a"], values)
        assert ws[0].needs_init == [0, 1] and ws[1].needs_init == []
        for f in range(2):
            assert np.array_equal(bases[1][f].values, fragment_flat(values, layout, f))
        for c in cs:
            c.close()


def test_lowest_id_takes_those_present_once_the_init_wait_ended():
    server, addr = make_server(islands=3, fragments=2, initializer="lowest-id", init_wait_s=1.0)
    with running(server):
        cs = [client(addr, n) for n in ("c", "b")]
        ws = [c.connect() for c in cs]
        time.sleep(0.3)
        assert [c.init_requested() for c in cs] == [[], []]
        values = {n: init_values(seed=k) for k, n in enumerate("bc")}
        layout, bases = start_all(cs, ws, values)       # after about a second: b, the lowest id present
        assert_start(bases, values, layout, "b", "bc")
        for c in cs:
            c.close()


def test_a_declared_initializer_is_taken_as_soon_as_it_joins():
    """A fine-tune: island b loaded the pretrained weights (YETO_DILOCO_INITIALIZER=1); a (lower id, random
    weights) joined first and the roster is not complete: b's weights are the start at once."""
    server, addr = make_server(islands=3, fragments=2, initializer="lowest-id")
    with running(server):
        a = client(addr, "a", held=DIGESTS[0])
        b = client(addr, "b", held=DIGESTS[1], initializer=True)
        ws = [a.connect(), b.connect()]
        assert ws[1].needs_init == [0, 1]
        values = {"a": init_values(seed=0), "b": init_values(seed=1)}
        layout, bases = start_all([a, b], ws, values)
        assert_start(bases, values, layout, "b", "ab")
        c = client(addr, "c", held=DIGESTS[2])           # a later island with other weights takes the start too
        c.connect()
        got = c.wait_ready(20, init_source=None)
        assert all(np.array_equal(got[f].values, fragment_flat(values["b"], layout, f)) for f in range(2))
        for x in (a, b, c):
            x.close()


@pytest.mark.parametrize("case", ["two declarations", "named another", "after the run started", "while it starts"])
def test_a_declaration_the_syncer_cannot_honour_is_refused_at_the_join(case):
    server, addr = make_server(islands=2, fragments=2, rounds={"quorum": 1, "grace_s": 0.0},
                               initializer="a" if case == "named another" else "first")
    with running(server):
        first = client(addr, "a", held=DIGESTS[0], initializer=case == "two declarations")
        w = first.connect()
        assert w.needs_init == [0, 1]   # ("while it starts": asked to INIT, nothing sent yet)
        if case == "after the run started":
            first.wait_ready(20, init_source=lambda f: [init_values()[i] for i in w.layout[f]])
        with pytest.raises(PeerError) as e:
            client(addr, "b", held=DIGESTS[1], initializer=True).connect()
        assert e.value.code == "init" and "YETO_DILOCO_INITIALIZER" in str(e.value)
        same = client(addr, "b2", held=DIGESTS[0], initializer=True)   # the same weights: nothing is lost
        if case != "named another":
            same.connect()
            same.close()
        first.close()


def test_a_declared_initializer_that_leaves_is_not_replaced_by_other_weights_within_the_init_wait():
    t = [0.0]
    choice = InitChoice("lowest-id", roster=2, wait_s=3.0, clock=lambda: t[0])

    class S:
        def __init__(self, island, declares=False):
            self.island, self.declares_init, self.declared, self.closed = island, declares, None, False
    a, b = S("a"), S("b", declares=True)
    assert choice.choose([a, b], [a, b]) is b
    assert choice.choose([a], [a]) is None               # b left before its INIT: wait for it
    assert choice.choose([a, b], [a, b]) is b
    assert choice.choose([a], [a]) is None               # b left again ...
    t[0] = 2.9
    assert choice.choose([a], [a]) is None and choice.deadline() == 3.0
    t[0] = 3.0                                           # ... and did not come back within --init-wait
    assert choice.choose([a], [a]) is a and "left before its INIT" in choice.why(a)
    assert policy_arg("lowest-id") == "lowest-id" and policy_arg("island-7") == "island-7"
    with pytest.raises(ValueError):
        policy_arg("bad\nid")


def test_a_declared_initializer_that_leaves_before_init_does_not_keep_the_run_from_starting():
    """Issue 35: an island that joined declaring itself the initializer and left before sending INIT kept the run from
    ever starting (--init-wait 3 --init-timeout 3: still nothing after 16 s). Now the policy chooses among the
    islands present --init-wait after it left. The control: the declared island stays and starts the run."""
    for leaves in (True, False):
        server, addr = make_server(islands=2, fragments=2, initializer="lowest-id", init_wait_s=3.0,
                                   init_timeout_s=3.0)
        with running(server):
            z = client(addr, "z", held=DIGESTS[0], initializer=True)
            wz = z.connect()
            assert wz.needs_init == [0, 1]
            if leaves:
                z.abort()                                  # a key holder: declares, then leaves before its INIT
            a = client(addr, "a", held=DIGESTS[1])
            t0 = time.monotonic()
            wa = a.connect()
            values = {"a": init_values(seed=1), "z": init_values(seed=2)}
            cs = [a] if leaves else [a, z]
            layout, bases = start_all(cs, [wa], values)
            took = time.monotonic() - t0
            assert_start(bases, values, layout, "a" if leaves else "z", [c.island_id for c in cs])
            assert took < (6.0 if leaves else 2.0), took
            for c in cs:
                c.close()
