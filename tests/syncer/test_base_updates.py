"""--base-wire int8/int4/topk:F+intB: merged bases go out as encoded updates of a shadow base that every island
holds exactly; what was not sent (quantization error, values a sparse update left out) stays in base - shadow and
is carried into the next update."""
import numpy as np
import pytest

from yeto_patch.syncer.model.checkpoint import read_checkpoint
from yeto_patch.wire import codecs
from yeto_patch.wire.client import Base
from yeto_patch.wire.frames import MsgType, ProtocolError

from .helpers import client, finish_all, fragment_flat, init_values, join_all, make_server, running
from .reference import RefFragment

pytestmark = pytest.mark.timeout(60)
F = 3


def _round(cs, f, rnd, n, rng, fold):
    for c in cs:
        d = (rng.standard_normal(n) * 0.02).astype(np.float32)
        r = c.push(f, base_version=rnd, local_step=rnd, steps=1, tokens=1, codec="f32", body=codecs.encode("f32", d),
                   wait=True)
        assert r.status == "accepted"
        fold.append((d, 1.0))


#: bytes of f32 bases over those of the codec's updates, at least (int8 ~3.9x, int4 ~7.8x, topk:0.05+int2 ~49x,
#: topk:0.1+int8 ~19x); and max |base - shadow| over the base's largest move, at most (a dense update leaves one
#: update's rounding; a sparse one carries every value it left out until its turn comes)
SAVING = {"int8": 3.5, "int4": 6.5, "topk:0.05+int2": 40.0, "topk:0.1+int8": 15.0}
LAG = {"int8": 0.2, "int4": 0.2, "topk:0.05+int2": 1.0, "topk:0.1+int8": 1.0}


@pytest.mark.parametrize("codec", list(SAVING))
def test_islands_follow_the_shadow_bit_for_bit_and_the_base_exactly(tmp_path, codec):
    ckpt = tmp_path / "s.bin"
    server, addr = make_server(islands=2, fragments=F, base_wire=codec, checkpoint=str(ckpt), checkpoint_every=1)
    values = init_values(seed=4)
    with running(server):
        cs, ws, layout, bases = join_all(addr, ["a", "b"], values)
        assert ws[0].base_wire == codec
        refs = [RefFragment(fragment_flat(values, layout, f)) for f in range(F)]
        shadow = [r.base.copy() for r in refs]             # what the islands hold, computed independently
        held = [[bases[k][f] for f in range(F)] for k in range(2)]
        rng = np.random.default_rng(2)
        nbytes = 0
        for rnd in range(6):
            for f in range(F):
                n = refs[f].base.size
                fold = []
                _round(cs, f, rnd, n, rng, fold)
                refs[f].merge(fold)
                enc = codecs.encode(codec, refs[f].base - shadow[f])
                shadow[f] = shadow[f] + codecs.decode(codec, enc, n)
                for k, c in enumerate(cs):
                    b = c.wait_base(f, rnd + 1, 20)
                    assert b.relative and b.start == rnd and b.dtype == codec and b.version == rnd + 1
                    assert bytes(b.deltas[0][2]) == enc.tobytes()
                    nbytes += enc.nbytes
                    held[k][f] = held[k][f].then(b)
                    assert held[k][f].version == rnd + 1
                    assert np.array_equal(held[k][f].values, shadow[f])
        for f in range(F):
            t = server.coord.frags[f].t
            assert np.array_equal(t.base, refs[f].base)        # the outer step is untouched by the wire
            assert np.array_equal(t.shadow, shadow[f])
            # what the islands lack is one update's quantization error (dense), or what waits its turn (sparse)
            step = np.abs(codecs.decode(codec, codecs.encode(codec, t.base - t.shadow), t.base.size)
                          - (t.base - t.shadow)).max()
            assert 0 < np.abs(t.base - t.shadow).max() < LAG[codec] * np.abs(refs[f].base - fragment_flat(
                values, layout, f)).max()
            assert step <= np.abs(t.base - t.shadow).max()
        full = sum(4 * refs[f].base.size for f in range(F)) * 6 * 2
        assert nbytes < full / SAVING[codec]
        # the checkpoint holds the shadow (a resumed syncer sends it to rejoining islands)
        _, arrays = read_checkpoint(str(ckpt))
        assert all(np.array_equal(arrays[f]["shadow"], shadow[f]) for f in range(F))

        # an island that reconnects gets the full f32 shadow, then updates again
        cs[1].close()
        b2 = client(addr, "b")
        b2.connect()
        got = b2.wait_ready(20)
        for f in range(F):
            assert got[f].dtype == "f32" and not got[f].relative and np.array_equal(got[f].values, shadow[f])
        cs[1] = b2
        fold = []
        _round(cs, 0, 6, refs[0].base.size, rng, fold)
        refs[0].merge(fold)
        assert cs[1].wait_base(0, 7, 20).relative

        # the final model is the syncer's base itself, in f32
        for res in finish_all(cs, 7):
            for f in range(F):
                assert res[f].dtype == "f32" and np.array_equal(res[f].values, refs[f].base)
        assert server.wait(20) == 0
        for c in cs:
            c.close()


def test_resume_keeps_the_shadow(tmp_path):
    ckpt = tmp_path / "s.bin"
    server, addr = make_server(islands=1, fragments=1, base_wire="int4", checkpoint=str(ckpt), checkpoint_every=1)
    values = init_values(seed=1)
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a"], values)
        fold = []
        _round(cs, 0, 0, ws[0].numels[0], np.random.default_rng(0), fold)
        cs[0].wait_base(0, 1, 20)
        shadow = server.coord.frags[0].t.shadow.copy()
        assert not np.array_equal(shadow, server.coord.frags[0].t.base)
        cs[0].abort()
    server2, addr2 = make_server(islands=1, fragments=1, base_wire="int4", checkpoint=str(ckpt), resume=True)
    with running(server2):
        assert np.array_equal(server2.coord.frags[0].t.shadow, shadow)
        c = client(addr2, "a", incarnation=cs[0].incarnation)
        c.connect()
        got = c.wait_ready(20)
        assert got[0].version == 1 and np.array_equal(got[0].values, shadow)
        c.close()


def test_sparse_updates_deliver_everything_eventually():
    """A sparse base wire sends each block's largest differences first: with nothing new merged, the islands'
    shadow closes on the base merge after merge (what was left out is carried, never dropped)."""
    server, addr = make_server(islands=1, fragments=1, base_wire="topk:0.05+int2")
    values = init_values(seed=3)
    with running(server):
        cs, ws, layout, bases = join_all(addr, ["a"], values)
        n = ws[0].numels[0]
        held = bases[0][0]
        _round(cs, 0, 0, n, np.random.default_rng(5), [])
        held = held.then(cs[0].wait_base(0, 1, 20))
        t = server.coord.frags[0].t
        gaps = [float(np.abs(t.base - held.values).max())]
        zero = codecs.encode("f32", np.zeros(n, np.float32))
        for rnd in range(1, 41):
            r = cs[0].push(0, base_version=rnd, local_step=rnd, steps=1, tokens=1, codec="f32", body=zero, wait=True)
            assert r.status == "accepted"
            b = cs[0].wait_base(0, rnd + 1, 20)
            assert b.relative and b.dtype == "topk:0.05+int2"
            held = held.then(b)
            assert np.array_equal(held.values, t.shadow)
            gaps.append(float(np.abs(t.base - held.values).max()))
        assert gaps[0] > 0 and gaps[-1] < 0.05 * gaps[0], gaps
        assert all(b <= a for a, b in zip(gaps, gaps[1:])), gaps   # (seeded: 0.029 -> 0.0008 in 40 merges)
        cs[0].close()


def test_client_refuses_updates_that_do_not_follow_its_base():
    c = client("127.0.0.1:1", "x")
    n = 300
    body = codecs.encode("int8", np.full(n, 0.5, np.float32))
    meta = {"fragment": 0, "version": 4, "dtype": "int8", "numel": n, "delta_from": 3, "block": 256}
    with pytest.raises(ProtocolError, match="last base received for it is vNone"):
        c._dispatch(MsgType.BASE, meta, memoryview(body))
    c._held[0] = 3
    with pytest.raises(ProtocolError, match="must be a full float32 base"):
        c._dispatch(MsgType.FINAL_BASE, dict(meta, final=True), memoryview(body))
    with pytest.raises(ProtocolError, match="bad dtype"):
        c._dispatch(MsgType.BASE, dict(meta, dtype="f32"), memoryview(body))
    bad = body.copy()
    bad[:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    with pytest.raises(ProtocolError, match="invalid scale"):
        c._dispatch(MsgType.BASE, meta, memoryview(bad))
    with pytest.raises(ProtocolError, match="must be"):
        c._dispatch(MsgType.BASE, meta, memoryview(body[:-1]))
    assert not c._bases and c._held == {0: 3}           # nothing of a refused update was kept
    c._dispatch(MsgType.BASE, meta, memoryview(body))
    got = c.poll()[0]
    assert got.relative and got.start == 3 and c._held == {0: 4}
    full = Base(0, 3, "f32", np.ones(n, np.float32))
    comp = full.then(got)
    assert comp.version == 4 and np.array_equal(comp.values, np.ones(n, np.float32) + codecs.decode("int8", body, n))
    with pytest.raises(ProtocolError, match="applies to v3, but the base held is v4"):
        comp.then(got)
    two = got.then(Base(0, 5, "int8", None, False, got.deltas, 4, n))
    assert two.relative and two.start == 3 and len(two.deltas) == 2


def test_client_checks_sparse_updates_like_pushes():
    """A sparse base update passes the codec's body checks before anything is kept: indices out of order, a
    name in a non-canonical spelling or a truncated body close the connection with a protocol error."""
    c = client("127.0.0.1:1", "x")
    n, codec = 600, "topk:0.05+int2"
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    body = codecs.encode(codec, x)
    meta = {"fragment": 0, "version": 4, "dtype": codec, "numel": n, "delta_from": 3, "block": 256}
    c._held[0] = 3
    nblocks = 3
    bad = body.copy()
    bad[4 * nblocks], bad[4 * nblocks + 1] = bad[4 * nblocks + 1], bad[4 * nblocks]   # two indices swapped
    with pytest.raises(ProtocolError, match="fragment 0 to v4"):
        c._dispatch(MsgType.BASE, meta, memoryview(bad))
    with pytest.raises(ProtocolError, match="bad dtype"):
        c._dispatch(MsgType.BASE, dict(meta, dtype="topk:0.050+int2"), memoryview(body))
    with pytest.raises(ProtocolError):
        c._dispatch(MsgType.BASE, meta, memoryview(body[:-1]))
    assert not c._bases and c._held == {0: 3}
    c._dispatch(MsgType.BASE, meta, memoryview(body))
    got = c.poll()[0]
    comp = Base(0, 3, "f32", np.zeros(n, np.float32)).then(got)
    assert np.array_equal(comp.values, codecs.decode(codec, body, n))


def _digests(values):
    import xxhash
    return [xxhash.xxh3_64_hexdigest(np.ascontiguousarray(v, "<f4").tobytes()) for v in values]


def test_islands_declaring_the_initial_weights_download_nothing_at_start():
    server, addr = make_server(islands=4, fragments=F, base_wire="int8", rounds={"quorum": 2, "grace_s": 0.0})
    values = init_values(seed=6)
    other = [v.copy() for v in values]
    other[1] = other[1] + np.float32(1.0)                 # island c holds a different tensor 1
    with running(server):
        a = client(addr, "a", held=_digests(values))
        wa = a.connect()
        layout = wa.layout
        b = client(addr, "b", held=_digests(values))
        b.connect()
        c = client(addr, "c", held=_digests(other))
        c.connect()
        src = lambda f: [values[i] for i in layout[f]]  # noqa: E731
        ga = a.wait_ready(20, init_source=src)
        gb, gc = b.wait_ready(20), c.wait_ready(20)
        f1 = next(f for f in range(F) if 1 in layout[f])
        for f in range(F):
            # the initializer and b hold the base already: a bodiless 'held' base each
            for g in (ga, gb):
                assert g[f].held and g[f].relative and not g[f].deltas and g[f].version == 0
            if f == f1:
                assert not gc[f].held and np.array_equal(gc[f].values, fragment_flat(values, layout, f))
            else:
                assert gc[f].held
        out = server.metrics.bytes_out.labels("base")._value.get()
        assert out == sum(4 * w for w in [wa.numels[f1]])          # only c's differing fragment went out in full
        # a second request for a version this connection already carried (an island joining while INIT
        # completes is asked twice) sends nothing
        for f in range(F):
            server.sessions["b"].post_base(f, "check")
            server.sessions["c"].post_base(f, "f32")
        server.sessions["b"].drain(5)
        server.sessions["c"].drain(5)
        assert server.metrics.bytes_out.labels("base")._value.get() == out and not b.poll() and not c.poll()
        # updates then apply to the held base (composed into a chain that starts from the island's weights)
        for k in (a, b):
            k.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(wa.numels[0], 0.01, np.float32)), wait=True)
        u = a.wait_base(0, 1, 20)
        assert u.relative and not u.held and u.start == 0
        assert ga[0].then(u).held and ga[0].then(u).start == 0 and len(ga[0].then(u).deltas) == 1
        # an island joining later with the initial weights gets the current shadow in full (it changed)
        d = client(addr, "d", held=_digests(values))
        d.connect()
        gd = d.wait_ready(20)
        assert not gd[0].held and gd[0].version == 1
        assert np.array_equal(gd[0].values, server.coord.frags[0].t.shadow)
        assert all(gd[f].held for f in range(1, F))              # fragments not merged yet: still held
        for k in (a, b, c, d):
            k.close()


def test_malformed_declarations_are_refused():
    server, addr = make_server(islands=1, fragments=F)
    with running(server):
        with pytest.raises(ValueError, match="16-hex-digit"):
            client(addr, "a", held=["0" * 16])
        bad = client(addr, "a", held=_digests(init_values()))
        bad.held[0] = "zz" * 8
        with pytest.raises(Exception, match="held"):
            bad.connect()
