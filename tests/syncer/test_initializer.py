"""Which island's INIT becomes the run's initial base: with a fixed roster the lowest island id once every island
of the roster joined (whatever the order they connect in), with an elastic roster the first to join."""
import threading
import time

import numpy as np
import pytest

from .helpers import client, fragment_flat, init_values, join_all, make_server, running

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("order", [["c", "b", "a"], ["a", "c", "b"], ["b", "a", "c"]])
def test_fixed_roster_base_is_the_lowest_id_whatever_the_connection_order(order):
    server, addr = make_server(islands=3, fragments=2, init_lowest_id=True)
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
        layout = ws[0].layout
        values = {n: init_values(seed=k) for k, n in enumerate("abc")}   # every island's own weights
        bases = {}

        def ready(c):
            bases[c.island_id] = c.wait_ready(20, init_source=lambda f: [values[c.island_id][i] for i in layout[f]])
        ts = [threading.Thread(target=ready, args=(c,), daemon=True) for c in cs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert sorted(bases) == ["a", "b", "c"]
        for n in "abc":
            for f in range(2):
                assert np.array_equal(bases[n][f].values, fragment_flat(values["a"], layout, f)), (n, f)
        for c in cs:
            c.close()


def test_elastic_roster_base_is_the_first_to_join():
    server, addr = make_server(islands=3, fragments=2, rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        values = init_values(seed=3)
        cs, ws, layout, bases = join_all(addr, ["c", "a"], values)
        assert ws[0].needs_init == [0, 1] and ws[1].needs_init == []
        for f in range(2):
            assert np.array_equal(bases[1][f].values, fragment_flat(values, layout, f))
        for c in cs:
            c.close()
