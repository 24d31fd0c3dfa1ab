"""FragmentIO with a recording stand-in view: the writes an install makes for each mode (replace, blend, keep, the
island's own weights, base updates), the sources of absolute and relative bases, INIT streamed without holding the
fragment (a failing or stalled sender ends the read), start digests, and the push encoder's residual."""
import threading
import time
import types

import numpy as np
import pytest
import xxhash

from yeto_patch.island.boundary.fragment import Fragments
from yeto_patch.island.boundary.fragment_io import FragmentIO, StreamBridge
from yeto_patch.island.errors import EngineError
from yeto_patch.wire import codecs
from yeto_patch.wire.values import Base

SIZES = [3, 5]


class View:
    def __init__(self):
        self.calls = []

    def write(self, idx, source, **kw):
        self.calls.append(("write", list(idx), kw, [source(e, 0, n).copy() for e, n in zip(idx, SIZES)]))

    def snapshot_anchor(self, idx):
        self.calls.append(("snapshot_anchor", list(idx)))

    def read(self, idx, sink):
        for e in (range(len(SIZES)) if idx is None else idx):
            if sink is not None:
                for off in range(0, SIZES[e], 2):   # chunks of 2 values, in order
                    sink(e, off, np.arange(off, min(off + 2, SIZES[e]), dtype=np.float32) + 10 * e)


class Manifest(list):
    """A manifest's entries (names) and its length, as FragmentIO reads them."""
    @property
    def entries(self):
        return self


def io(rank=0, **kw):
    s = dict(error_feedback=True, push_dtype="int4", block=4, chunk_bytes=1024, timeout=2.0)
    s.update(kw)
    view = View()
    manifest = Manifest([types.SimpleNamespace(name="a"), types.SimpleNamespace(name="b")])
    return FragmentIO(view, manifest, types.SimpleNamespace(**s), rank), view


def fragment(rank0=True):
    return Fragments([[0, 1]], [8], SIZES, rank0=rank0)[0]


def full(v=2):
    return Base(0, v, "f32", np.arange(8, dtype=np.float32))


def test_replace_writes_the_base_once_and_sets_the_anchor():
    fio, view = io()
    fio.install(fragment(), full(), None, 0, False)
    ((op, idx, kw, vals),) = view.calls
    assert (op, idx, kw) == ("write", [0, 1], dict(mode="replace", set_anchor=True))
    np.testing.assert_array_equal(np.concatenate(vals), np.arange(8, dtype=np.float32))


@pytest.mark.parametrize("alpha", [0.5, 1.0])   # blend, keep
def test_blend_and_keep_write_with_the_anchor_as_the_base(alpha):
    fio, view = io()
    fio.install(fragment(), full(), alpha, 0, False)
    assert view.calls[0][2] == dict(mode="blend", alpha=alpha, set_anchor=True, anchor="value")


def test_base_updates_go_to_the_anchors_first_and_the_last_one_installs():
    fio, view = io()
    body = codecs.encode("int8", np.ones(8, np.float32), 256)
    base = Base(0, 5, "int8", None, deltas=(("int8", 256, body),) * 3, start=2, size=8)
    fio.install(fragment(), base, None, 3, False)
    kws = [c[2] for c in view.calls]
    assert kws == [dict(mode="blend", alpha=1.0, set_anchor=True, anchor="value", relative=True)] * 2 + \
        [dict(mode="replace", set_anchor=True, relative=True)]


def test_the_islands_own_weights_become_the_anchor_without_a_write():
    fio, view = io()
    base = Base(0, 3, "held", None, deltas=(), start=2, size=8, held=True)
    fio.install(fragment(), base, None, 0, True)
    assert view.calls == [("snapshot_anchor", [0, 1])]


def test_other_ranks_follow_without_values():
    fio, view = io(rank=1)
    view.write = lambda idx, source, **kw: view.calls.append((source, kw.get("relative")))
    fio.install(fragment(rank0=False), None, 0.5, 2, False)
    assert view.calls == [(None, True), (None, True)]


def test_init_is_streamed_in_order_and_the_digests_are_the_tensors_values():
    fio, view = io()
    got = []
    fio.send_init(fragment(), lambda it: got.extend(a.copy() for a in it))
    np.testing.assert_array_equal(np.concatenate(got), np.r_[np.arange(3), np.arange(5) + 10].astype(np.float32))
    digests = fio.start_digests()
    assert digests == [xxhash.xxh3_64(np.arange(3, dtype="<f4").tobytes()).hexdigest(),
                       xxhash.xxh3_64((np.arange(5) + 10).astype("<f4").tobytes()).hexdigest()]


def test_a_sender_that_fails_or_stalls_ends_the_init_read():
    fio, view = io()
    with pytest.raises(RuntimeError, match="link gone"):
        fio.send_init(fragment(), lambda it: (next(it), (_ for _ in ()).throw(RuntimeError("link gone"))))
    stalled = threading.Event()
    bridge = StreamBridge(lambda it: stalled.wait(5), timeout=0.5, what="INIT of fragment 0")
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="the syncer did not take data for 0s|not finished"):
        for _ in range(10):
            bridge.put(np.zeros(1, np.float32))
        bridge.close()
    assert time.monotonic() - t0 < 4
    stalled.set()


def test_the_push_encoder_carries_the_fragments_residual():
    fio, _ = io()
    frag = fragment()
    enc = fio.push_encoder(frag)
    enc.feed(np.full(8, 0.3, np.float32))
    enc.finish()
    assert frag.side.residual is not None and frag.side.residual.shape == (8,)
    assert fio.push_encoder(frag).residual is frag.side.residual   # the same residual, carried
