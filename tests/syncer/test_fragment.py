"""The fragment owner's public interface (syncer/model/fragment.py): INIT, streams and the write lock, base updates,
digests, checkpoint arrays."""
import threading

import numpy as np
import pytest
import xxhash

from yeto_patch.syncer.model.fragment import GlobalFragment
from yeto_patch.syncer.model.outer import OuterOptimizer
from yeto_patch.wire import codecs

pytestmark = pytest.mark.timeout(30)


def vals(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_init_refusal_names_the_first_bad_value_in_one_pass(jit, threads):
    from yeto_patch.syncer.model import outer_jit
    from yeto_patch.syncer.model.guard import init_refusal
    from yeto_patch.syncer.model.runner import ChunkRunner
    runner = ChunkRunner(threads, chunk=1 << 18)
    was = outer_jit.enabled()
    outer_jit.set_enabled(jit and outer_jit.available())
    try:
        assert init_refusal("INIT of fragment 0", vals(3 << 20), runner) is None
        assert init_refusal("INIT of fragment 0", np.zeros(0, np.float32), runner) is None
        edge = vals(1000)
        edge[7] = np.float32(1e30)                          # the largest usable value is usable
        assert init_refusal("x", edge, runner) is None
        bad = vals(3 << 20)
        bad[(1 << 20) + 5] = np.inf
        assert init_refusal("INIT of fragment 2", bad, runner) == (
            "nonfinite", "INIT of fragment 2 has a non-finite value near 1048576")
        bad[(2 << 20) + 9] = np.float32(3e36)               # a finite value too large comes first
        code, why = init_refusal("INIT of fragment 2", bad, runner)
        assert code == "bad-init" and "element 2097161" in why and "a base must stay usable" in why
        nan = vals(10)
        nan[9] = np.nan
        assert init_refusal("y", nan, runner)[0] == "nonfinite"
    finally:
        outer_jit.set_enabled(was)
        runner.close()


def test_init_install_and_drop():
    f = GlobalFragment(2, 10)
    assert not f.has_base and f.index == 2 and f.version == 0
    with pytest.raises(ValueError, match="must hold 10 float32 values, got 9 float32"):
        f.check_init(vals(9))
    with pytest.raises(ValueError, match="float64"):
        f.check_init(np.zeros(10))
    v = vals(10)
    f.install_init(v, shadow=True)
    assert f.has_base and f.t.base is v                # kept, not copied
    assert np.array_equal(f.t.shadow, v) and f.t.shadow is not v
    ro = vals(10, 1)
    ro.flags.writeable = False
    g = GlobalFragment(0, 10)
    g.install_init(ro, shadow=False)
    assert g.t.base is not ro and g.t.base.flags.writeable and g.t.shadow is None
    f.drop_init()
    assert not f.has_base and f.t.shadow is None


def test_outgoing_is_the_shadow_with_base_updates_and_the_base_for_the_final_model():
    f = GlobalFragment(0, 8)
    f.install_init(vals(8), shadow=False)
    assert f.outgoing(final=False) is f.t.base
    f.install_init(vals(8), shadow=True)
    f.t.shadow[:] = 0
    assert f.outgoing(final=False) is f.t.shadow and f.outgoing(final=True) is f.t.base


def test_encode_update_moves_the_shadow_and_offers_the_update_to_holders_of_the_previous_version():
    n = 1000
    f = GlobalFragment(0, n)
    f.install_init(vals(n), shadow=True)
    f.t.base += vals(n, 2) * 0.1    # as a merge would
    f.version = 1
    before = f.t.shadow.copy()
    assert f.update_for(0) is None  # nothing encoded yet
    f.encode_update("int8", 256, np.empty(n, np.float32), 1, threads=1)
    body = f.update_for(0)
    assert body is not None and f.update_for(1) is None and f.update_for(None) is None
    want = before + codecs.decode("int8", codecs.encode("int8", f.t.base - before), n)
    assert np.array_equal(f.t.shadow, want)
    assert np.array_equal(before + codecs.decode("int8", body, n), want)
    f.version = 2                   # a later merge without an update: none offered
    assert f.update_for(1) is None


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_an_unencodable_update_sends_the_full_base():
    n = 16
    f = GlobalFragment(0, n)
    f.install_init(vals(n), shadow=True)
    f.t.base[3] = 3.4e38
    f.t.shadow[3] = -3.4e38         # base - shadow overflows to inf: not encodable
    f.encode_update("int4", 256, np.empty(n, np.float32), 1, threads=1)
    assert f.update_for(0) is None and np.array_equal(f.t.shadow, f.t.base)


def test_digests_per_tensor_cached_per_version_and_array():
    f = GlobalFragment(0, 10)
    f.install_init(vals(10), shadow=False)
    want = [xxhash.xxh3_64_hexdigest(f.t.base[:4].tobytes()), xxhash.xxh3_64_hexdigest(f.t.base[4:].tobytes())]
    d = f.digests(f.t.base, [4, 6])
    assert d == want and f.digests(f.t.base, [4, 6]) is d        # cached
    f.version += 1
    assert f.digests(f.t.base, [4, 6]) is not d                  # a new version computes again
    other = f.t.base.copy()
    other[0] += 1
    assert f.digests(other, [4, 6])[0] != want[0] and f.digests(other, [4, 6])[1] == want[1]


def test_a_writer_waits_for_readers_and_can_decline_to_wait():
    f = GlobalFragment(0, 4)
    events = []
    with f.reading():
        with f.writing(wait=False) as got:
            assert got is False                      # a stream holds the base: no wait
        t = threading.Thread(target=lambda: (f.writing().__enter__(), events.append("w"), f.rw.release_write()))
        t.start()
        t.join(0.2)
        assert events == []                          # the writer waits for the stream
    t.join(5)
    assert events == ["w"]
    with f.writing(wait=False) as got:
        assert got is True


def test_checkpoint_arrays_round_trip():
    n = 12
    f = GlobalFragment(1, n)
    f.install_init(vals(n), shadow=True)
    OuterOptimizer("nesterov").ensure_state(f.t)
    f.version = 7
    arrays = {k: v.copy() for k, v in f.arrays().items()}
    assert set(arrays) == {"base", "momentum", "shadow"}
    g = GlobalFragment(1, n)
    g.restore(arrays, 7, shadow=True)
    assert g.version == 7 and all(np.array_equal(getattr(g.t, k), arrays[k]) for k in arrays)
    h = GlobalFragment(1, n)
    h.restore({"base": arrays["base"]}, 7, shadow=True)        # no shadow in the checkpoint: shadow = base
    assert np.array_equal(h.t.shadow, h.t.base) and h.t.shadow is not h.t.base
