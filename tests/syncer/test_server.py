"""Scripted islands over loopback: the syncer end to end (handshake, INIT, rounds, refusals, final cut)."""
import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from yeto_patch.syncer.model.checkpoint import read_checkpoint
from yeto_patch.wire import codecs
from yeto_patch.wire.client import SyncerRefusal, probe
from yeto_patch.wire.frames import MsgType, PeerError
from yeto_patch.wire.transport import connect

from .helpers import (KEY, MANIFEST, client, finish_all, fragment_flat, hello_meta, init_values, join_all, make_server,
                      manifest_meta, raw_hello, running)
from .reference import RefFragment

pytestmark = pytest.mark.timeout(60)


def test_diloco_matches_numpy_reference_over_many_rounds(tmp_path):
    tape = tmp_path / "tape.jsonl"
    ckpt = tmp_path / "s.bin"
    server, addr = make_server(islands=3, fragments=3, merge={"weights": "tokens"}, tape=str(tape),
                               checkpoint=str(ckpt), checkpoint_every=4)
    with running(server):
        values = init_values()
        cs, ws, layout, bases = join_all(addr, ["a", "b", "c"], values)
        assert ws[0].needs_init == [0, 1, 2] and ws[1].needs_init == [] and ws[2].needs_init == []
        refs = [RefFragment(fragment_flat(values, layout, f)) for f in range(3)]
        for c_bases in bases:  # every island starts from the same weights
            for f in range(3):
                assert c_bases[f].version == 0 and np.array_equal(c_bases[f].values, refs[f].base)
        rng = np.random.default_rng(1)
        # tokens per step of a, b, c: fixed by each island's first merged push (each within MAX_RATIO of the
        # others' low median: no weight is capped)
        tps = (40, 60, 75)
        for rnd in range(5):
            for f in range(3):
                n = refs[f].base.size
                fold = []
                for k, c in enumerate(cs):
                    d = (rng.standard_normal(n) * 0.01).astype(np.float32)
                    claim = 10 * tps[k] * (1 if rnd == 0 else int(rng.integers(1, 1000)))   # later claims: unread
                    r = c.push(f, base_version=rnd, local_step=10 * (rnd + 1), steps=10, tokens=claim,
                               codec="f32", body=codecs.encode("f32", d), wait=True)
                    assert r.status == "accepted"
                    fold.append((d, float(10 * tps[k])))
                refs[f].merge(fold)
                for c in cs:
                    b = c.wait_base(f, rnd + 1, 20)
                    assert b.version == rnd + 1 and b.dtype == "f32"
                    assert np.array_equal(b.values, refs[f].base)
        for f in range(3):
            assert np.array_equal(server.coord.frags[f].t.momentum, refs[f].m)
        # final cut: every island reports its last step; final model f32 with versions, acknowledged
        for res in finish_all(cs, 50):
            assert sorted(res) == [0, 1, 2]
            for f in range(3):
                assert res[f].final and res[f].version == 5 and np.array_equal(res[f].values, refs[f].base)
        assert server.wait(20) == 0
        for c in cs:
            c.close()
    recs = [json.loads(line) for line in tape.read_text().splitlines()]
    assert len(recs) == 15 and all(r["ok"] for r in recs)
    r0 = recs[0]
    assert {"fragment", "version", "responders", "total_weight", "bytes", "quorum_s", "merge_s",
            "outer_grad_norm"} <= set(r0)
    assert sorted(x["island"] for x in r0["responders"]) == ["a", "b", "c"] and r0["responders"][0]["lag"] == 0
    meta, arrays = read_checkpoint(str(ckpt))
    assert meta["final"] is True and [fm["version"] for fm in meta["fragments"]] == [5, 5, 5]
    for f in range(3):
        assert np.array_equal(arrays[f]["base"], refs[f].base) and np.array_equal(arrays[f]["momentum"], refs[f].m)
    assert set(meta["ledger"]) == {"a", "b", "c"} and meta["ledger"]["a"]["pushes"] == 15


def test_quorum_with_a_stalled_island_and_carry_of_its_late_push():
    server, addr = make_server(islands=3, fragments=2, rounds={"quorum": 2, "grace_s": 0.3},
                               merge={"outer": "avg", "late_factor": 0.5})
    with running(server):
        values = init_values()
        cs, ws, layout, bases = join_all(addr, ["a", "b", "slow"], values)
        n = ws[0].numels[0]
        base0 = bases[0][0].values.copy()
        t0 = time.monotonic()
        for c, v in zip(cs[:2], (0.1, 0.3)):   # (small beside a base of about 1 per value: the guard)
            c.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(n, v, np.float32)), wait=True)
        b = cs[0].wait_base(0, 1, 10)  # merged without the stalled island after the grace period
        assert time.monotonic() - t0 >= 0.25
        assert np.allclose(b.values, base0 - np.float32(0.2), atol=1e-6)
        rec = server.records[-1]
        assert [r["island"] for r in rec.responders] == ["a", "b"] and "slow" in rec.expected
        # (the next round must wait for all three: a long grace so a loaded machine cannot split it)
        server.coord.rs = dataclasses.replace(server.coord.rs, grace_s=60.0)
        # the stalled island's push relative to v0 arrives late: carried into the next round at half weight
        r = cs[2].push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                       body=codecs.encode("f32", np.full(n, 0.8, np.float32)), wait=True)
        assert (r.status, r.lag) == ("carried", 1)
        for c in cs:
            c.push(0, base_version=1, local_step=2, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(n, 0.1, np.float32)), wait=True)
        b2 = cs[0].wait_base(0, 2, 10)
        g = (np.float32(0.3) + np.float32(0.5) * np.float32(0.8)) / np.float32(3.5)
        assert np.allclose(b2.values, b.values - g, atol=1e-6)
        rec = server.records[-1]
        assert [(r["island"], r["lag"], r["carried"]) for r in rec.responders] == [
            ("a", 0, False), ("b", 0, False), ("slow", 0, False), ("slow", 1, True)]
        for c in cs:
            c.close()


def test_refusals_stale_duplicate_nan_surface_as_exceptions_state_unchanged():
    server, addr = make_server(islands=2, fragments=2, merge={"max_base_lag": 1},
                               rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        cs, ws, layout, bases = join_all(addr, ["a", "b"])
        a, b = cs
        n = ws[0].numels[1]
        # (small: a push of 1 per value on a base of about 1, twice by one island alone, is refused as an outlier)
        one = codecs.encode("f32", np.full(n, 0.01, np.float32))
        for v in range(2):  # fragment 1 to v2 with island a alone (quorum 1)
            a.push(1, base_version=v, local_step=v, steps=1, tokens=1, codec="f32", body=one, wait=True)
            a.wait_base(1, v + 1, 10)
        with pytest.raises(SyncerRefusal, match="pull") as e:
            b.push(1, base_version=0, local_step=5, steps=1, tokens=1, codec="f32", body=one, wait=True)
        assert e.value.code == "stale"
        frag = server.coord.frags[1]
        before = (frag.t.base.copy(), frag.t.momentum.copy(), frag.version)
        bad = np.ones(n, np.float32)
        bad[7] = np.nan
        with pytest.raises(SyncerRefusal, match="non-finite") as e:
            b.push(1, base_version=2, local_step=5, steps=1, tokens=1, codec="f32", body=bad.view(np.uint8),
                   wait=True)
        assert e.value.code == "nonfinite"
        assert np.array_equal(frag.t.base, before[0]) and np.array_equal(frag.t.momentum, before[1])
        assert frag.version == before[2] and not server.coord.rounds[frag.index].answers
        # an int4 push whose scales are broken is refused too
        enc = codecs.encode("int4", np.ones(n, np.float32)).copy()
        enc[:4] = np.frombuffer(np.float32(np.inf).tobytes(), np.uint8)
        with pytest.raises(SyncerRefusal):
            b.push(1, base_version=2, local_step=5, steps=1, tokens=1, codec="int4", body=enc, wait=True)
        # a refusal of a push sent without waiting surfaces on the next call
        b.push(1, base_version=0, local_step=5, steps=1, tokens=1, codec="f32", body=one)
        deadline = time.monotonic() + 10
        with pytest.raises(SyncerRefusal, match="pull"):
            while time.monotonic() < deadline:
                b.poll()
                time.sleep(0.05)
        # duplicates: same island, fragment and base
        a.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
               body=codecs.encode("f32", np.ones(ws[0].numels[0], np.float32)), wait=True)
        with pytest.raises(SyncerRefusal, match="duplicate"):
            a.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.ones(ws[0].numels[0], np.float32)), wait=True)
        # the connection is still usable after refusals
        b.push(1, base_version=2, local_step=6, steps=1, tokens=1, codec="f32", body=one, wait=True)
        assert b.wait_base(1, 3, 10).version == 3
        for c in cs:
            c.close()


def test_wrong_key_replayed_handshake_and_wrong_manifest_refused():
    server, addr = make_server(islands=2, fragments=2)
    with running(server):
        good = client(addr, "a")
        good.connect()
        # wrong key: the syncer refuses with an auth error
        bad = client(addr, "b", key=b"x" * 32)
        with pytest.raises(PeerError) as e:
            bad.connect()
        assert e.value.code == "auth"
        # replay: record a valid HELLO for one challenge, send it against a new challenge
        conn = connect(addr, timeout=5, retries=0)
        conn.recv(timeout=5)
        from yeto_patch.wire import auth
        t, meta, _ = connect(addr, timeout=5, retries=0).recv(timeout=5)  # someone else's challenge
        dig = auth.manifest_digest(MANIFEST)
        conn.send(MsgType.HELLO, hello_meta(meta, "b", 7, auth.new_nonce(), dig))
        with pytest.raises(PeerError) as e:
            conn.recv(timeout=5)
        assert e.value.code == "auth"
        conn.close()
        # a manifest altered after MACing is refused as well (its digest is what the MAC covers)
        conn, _, _ = raw_hello(addr, "b", dig, incarnation=7)
        assert conn.recv(timeout=5)[0] == MsgType.HELLO_OK
        altered = manifest_meta(MANIFEST)
        altered["manifest"][0][1] = [65, 16]
        conn.send(MsgType.MANIFEST, altered)
        with pytest.raises(PeerError, match="authenticated manifest digest") as e:
            conn.recv(timeout=5)
        assert e.value.code == "auth"
        conn.close()
        # different manifest: refused naming the first differing entry
        other = list(MANIFEST)
        other[2] = ("decoder.layers.0.mlp.linear_fc1.weight", (33, 16), "float32")
        c = client(addr, "b", manifest=other)
        with pytest.raises(PeerError) as e:
            c.connect()
        assert e.value.code == "manifest" and "entry 2" in e.value.message and "[33, 16]" in e.value.message
        # a third island beyond --islands 2 is refused
        client(addr, "b").connect()
        with pytest.raises(PeerError, match="expects 2"):
            client(addr, "c").connect()
        info = probe(addr, KEY)
        assert info["probe"] and info["fragments"] == 2 and sorted(info["members"]) == ["a", "b"]
        with pytest.raises(PeerError):
            probe(addr, b"y" * 32)
        good.close()


def test_disconnect_and_rejoin_gets_current_bases():
    # quorum 1 of 2: the others go on without an island that dropped (a fixed roster waits: test_rounds.py)
    server, addr = make_server(islands=2, fragments=2, rounds={"quorum": 1, "grace_s": 100.0, "lease_s": 1.0})
    with running(server):
        cs, ws, layout, bases = join_all(addr, ["a", "b"])
        a, b = cs
        n0 = ws[0].numels[0]
        b.conn.close()  # the link drops without a goodbye
        t0 = time.monotonic()
        a.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="int4",
               body=codecs.encode("int4", np.full(n0, 0.5, np.float32)), wait=True)
        assert a.wait_base(0, 1, 10).version == 1  # merged once b left the expected set (lease)
        assert time.monotonic() - t0 >= 0.8
        b.close()
        b2 = client(addr, "b")  # same id, new incarnation
        w = b2.connect()
        assert w.needs_init == [] and w.versions == [1, 0]
        got = b2.wait_ready(10)
        for f in range(2):
            assert got[f].dtype == "f32" and np.array_equal(got[f].values, server.coord.frags[f].t.base)
        for c in (a, b2):
            c.push(0, base_version=1, local_step=2, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.zeros(n0, np.float32)), wait=True)
        assert b2.wait_base(0, 2, 10).version == 2
        assert [r["island"] for r in server.records[-1].responders] == ["a", "b"]
        a.close()
        b2.close()


def test_initializer_leaving_mid_init_hands_over_and_bf16_bases():
    server, addr = make_server(islands=2, fragments=3, base_wire="bf16", rounds={"quorum": 1, "grace_s": 0.0})
    with running(server):
        values = init_values(seed=3)
        a = client(addr, "a")
        wa = a.connect()
        b = client(addr, "b")
        wb = b.connect()
        assert wa.needs_init == [0, 1, 2] and wb.needs_init == []
        a.send_init(0, [values[i] for i in wa.layout[0]])
        a.conn.close()
        a.close()
        src = lambda f: [values[i] for i in wb.layout[f]]  # noqa: E731
        got = b.wait_ready(10, init_source=src)
        for f in range(3):
            assert np.array_equal(got[f].values, fragment_flat(values, wb.layout, f))
        n = wb.numels[2]
        b.push(2, base_version=0, local_step=1, steps=1, tokens=1, codec="bf16",
               body=codecs.encode("bf16", np.full(n, 0.25, np.float32)), wait=True)
        nb = b.wait_base(2, 1, 10)
        assert nb.dtype == "bf16"
        ref = codecs.decode("bf16", codecs.encode("bf16", server.coord.frags[2].t.base), n)
        assert np.array_equal(nb.values, ref)
        b.close()


def test_total_rounds_final_cut_without_island_request():
    server, addr = make_server(islands=1, fragments=2, rounds={"total_rounds": 1, "quorum": 1})
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["solo"])
        c = cs[0]
        for f in range(2):
            c.push(f, base_version=0, local_step=1, steps=1, tokens=1, codec="int8",
                   body=codecs.encode("int8", np.full(ws[0].numels[f], 0.1, np.float32)), wait=True)
        deadline = time.monotonic() + 10
        while not c.final_cut and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.final_cut
        res = c.finish(timeout=10)
        assert [res[f].version for f in range(2)] == [1, 1]
        assert server.wait(10) == 0
        c.close()


def test_concurrent_pushes_exact_mode_is_bit_exact_and_final_pushes_end_the_run():
    server, addr = make_server(islands=4, fragments=2, merge={"exact": True, "weights": "steps"})
    with running(server):
        values = init_values(seed=4)
        names = ["d", "b", "a", "c"]
        cs, ws, layout, bases = join_all(addr, names, values)
        refs = [RefFragment(fragment_flat(values, layout, f)) for f in range(2)]
        rng = np.random.default_rng(8)
        for rnd in range(3):
            last = rnd == 2
            for f in range(2):
                n = refs[f].base.size
                deltas = {nm: ((rng.standard_normal(n) * 0.01).astype(np.float32), int(rng.integers(10, 20)))
                          for nm in names}   # (steps within 2x of each other: no weight is capped)
                errs = []

                def go(c, nm):
                    try:
                        d, st = deltas[nm]
                        c.push(f, base_version=rnd, local_step=20 * (rnd + 1), steps=st, tokens=0, codec="f32",
                               body=codecs.encode("f32", d), final=last, wait=True)
                    except Exception as e:  # noqa: BLE001
                        errs.append(e)

                th = [threading.Thread(target=go, args=(c, nm)) for c, nm in zip(cs, names)]
                [t.start() for t in th]
                [t.join(20) for t in th]
                assert not errs
                refs[f].merge([(deltas[nm][0], float(deltas[nm][1])) for nm in sorted(names)])
                for c in cs:
                    assert np.array_equal(c.wait_base(f, rnd + 1, 20).values, refs[f].base)
        # every island pushed its final deltas; FINAL from each ends the run with the same model
        out = {}
        th = [threading.Thread(target=lambda c=c: out.__setitem__(c.island_id, c.finish(last_step=3, timeout=20)))
              for c in cs]
        [t.start() for t in th]
        [t.join(30) for t in th]
        assert sorted(out) == sorted(names)
        for res in out.values():
            assert [res[f].version for f in range(2)] == [3, 3]
            assert all(np.array_equal(res[f].values, refs[f].base) for f in range(2))
        assert server.wait(20) == 0
        for c in cs:
            c.close()


def test_hostile_peers_do_not_disturb_the_run():
    import socket
    server, addr = make_server(islands=1, fragments=1, rounds={"quorum": 1})
    server.cfg.handshake_timeout_s = 0.5
    with running(server):
        host, port = addr.rsplit(":", 1)
        junk = socket.create_connection((host, int(port)))
        junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 100)
        silent = socket.create_connection((host, int(port)))  # connects and never speaks
        big = socket.create_connection((host, int(port)))
        from yeto_patch.wire.frames import encode_header
        big.sendall(encode_header(MsgType.HELLO, 64 << 10, 0))  # announces the largest HELLO, sends nothing more
        cs, ws, layout, _ = join_all(addr, ["solo"])
        c = cs[0]
        n = ws[0].numels[0]
        c.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="int4",
               body=codecs.encode("int4", np.full(n, 0.1, np.float32)), wait=True)
        assert c.wait_base(0, 1, 10).version == 1
        silent.settimeout(5)
        got = b""
        while True:  # the CHALLENGE, then the syncer closes after its handshake timeout
            piece = silent.recv(1 << 16)
            if not piece:
                break
            got += piece
        assert got[:4] == b"YETO"
        for s in (junk, silent, big):
            s.close()
        c.close()


def test_island_verifies_the_syncer():
    """An impostor syncer without the key cannot produce a valid HELLO_OK; a keyless syncer is refused too."""
    from yeto_patch.wire import auth, secure
    from yeto_patch.wire.client import recoverable
    from yeto_patch.wire.transport import Connection, listen
    srv = listen("127.0.0.1:0")
    addr = "127.0.0.1:%d" % srv.getsockname()[1]

    def impostor(keyed):
        s, _ = srv.accept()
        c = Connection(s, timeout=5)
        c.send(MsgType.CHALLENGE, {"nonce": auth.new_nonce().hex(), "protocol": 3, "auth": keyed,
                                   "frames": "mac" if keyed else "none", "ephemeral": secure.Ephemeral().public.hex()})
        try:
            c.recv(timeout=5)
            c.send(MsgType.WELCOME, {"island_id": "a", "server_mac": "00" * 32, "layout": [[0]], "numels": [1],
                                     "fragments": 1})
            c.recv(timeout=5)
        except Exception:  # noqa: BLE001 - the island hangs up
            pass
        c.close()

    from yeto_patch.wire.frames import AuthError
    for keyed, match in ((True, "HELLO_OK failed authentication"), (False, "without a key")):
        th = threading.Thread(target=impostor, args=(keyed,), daemon=True)
        th.start()
        with pytest.raises(AuthError, match=match) as e:
            client(addr, "a", connect_retries=0).connect()
        assert recoverable(e.value)   # nothing authenticated it (issue 26): the island's link tries again
        th.join(10)
    srv.close()


def test_island_that_finishes_after_the_syncer_left_still_gets_the_final_model():
    server, addr = make_server(islands=1, fragments=2, rounds={"total_rounds": 1, "quorum": 1},
                               final_ack_timeout_s=0.3)
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["late"])
        c = cs[0]
        for f in range(2):
            c.push(f, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.full(ws[0].numels[f], 0.1, np.float32)), wait=True)
        assert server.wait(20) == 0  # no ACK within 0.3 s: the syncer wrote its checkpoint and left
        res = c.finish(timeout=10)
        assert [res[f].version for f in range(2)] == [1, 1]
        assert all(np.array_equal(res[f].values, server.coord.frags[f].t.base) for f in range(2))
        c.close()


def test_a_base_still_streaming_delays_only_its_own_fragment():
    server, addr = make_server(islands=1, fragments=2, rounds={"quorum": 1})
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a"])
        c = cs[0]
        frag0 = server.coord.frags[0]
        frag0.rw.acquire_read()  # as if fragment 0's base were still streaming to a slow island
        try:
            for f in range(2):
                c.push(f, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                       body=codecs.encode("f32", np.full(ws[0].numels[f], 0.1, np.float32)), wait=True)
            assert c.wait_base(1, 1, 10).version == 1  # the other fragment merges meanwhile
            time.sleep(0.3)
            assert frag0.version == 0
        finally:
            frag0.rw.release_read()
        assert c.wait_base(0, 1, 10).version == 1
        c.close()


def test_every_refusal_is_reported_once():
    server, addr = make_server(islands=1, fragments=2, rounds={"quorum": 1}, merge={"max_base_lag": 0})
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a"])
        c = cs[0]
        for f in range(2):
            c.push(f, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
                   body=codecs.encode("f32", np.zeros(ws[0].numels[f], np.float32)), wait=True)
            c.wait_base(f, 1, 10)
        got = []
        for f in range(2):  # both stale (lag 1 > 0), sent without waiting
            while True:
                try:
                    c.push(f, base_version=0, local_step=2, steps=1, tokens=1, codec="f32",
                           body=codecs.encode("f32", np.zeros(ws[0].numels[f], np.float32)))
                    break
                except SyncerRefusal as e:  # the first one's refusal may surface from the second call
                    got.append((e.fragment, e.code))
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                c.wait_event(0.2)
            except SyncerRefusal as e:
                got.append((e.fragment, e.code))
        # two pushes of a connection are checked at once (the fold pool): their replies may come in either order
        assert sorted(got) == [(0, "stale"), (1, "stale")]
        c.poll()  # nothing more to report
        c.close()


def test_client_declares_a_silent_link_dead_and_classifies_errors():
    """A link that stops delivering without closing (no FIN, no RST) is declared dead after a lease of silence;
    link errors are recoverable (reconnect), refusals are not."""
    import socket
    import threading
    from yeto_patch.wire.client import recoverable
    from yeto_patch.wire.frames import AuthError, FrameError, PeerError, WireTimeout
    from yeto_patch.wire.transport import ConnectError
    server, addr = make_server(islands=1, fragments=2, rounds={"lease_s": 1.0})
    frozen = threading.Event()
    relay = socket.create_server(("127.0.0.1", 0))

    def pump(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    return
                if not frozen.is_set():
                    dst.sendall(data)
        except OSError:
            pass

    def serve():
        a, _ = relay.accept()
        host, port = addr.split(":")
        b = socket.create_connection((host, int(port)))
        threading.Thread(target=pump, args=(a, b), daemon=True).start()
        threading.Thread(target=pump, args=(b, a), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    with running(server):
        c = client(f"127.0.0.1:{relay.getsockname()[1]}", "a")
        w = c.connect()
        vals = init_values()
        c.wait_ready(10, init_source=lambda f: [vals[i] for i in w.layout[f]])
        assert not c.conn_lost()
        frozen.set()
        t0 = time.monotonic()
        while not c.conn_lost() and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert c.conn_lost() and time.monotonic() - t0 < 5
        with pytest.raises(WireTimeout, match="no message from the syncer") as e:
            c.check()
        assert recoverable(e.value)
        c.abort()
    relay.close()
    assert recoverable(ConnectionResetError()) and recoverable(ConnectError("refused")) and recoverable(
        FrameError("bad magic"))
    assert not any(recoverable(x) for x in (PeerError("auth", "bad key"), AuthError("mac"),
                                            SyncerRefusal("stale", "pull")))


def test_an_island_reserves_nothing_large_for_a_syncer_it_has_not_authenticated():
    """A rogue syncer (or a relay) announcing a 1 GiB message before the island verified it is refused from the
    chunk's envelope: the island reads at most 64 KiB from an unauthenticated peer (transient: its link retries)."""
    import struct

    import xxhash

    from yeto_patch.wire.client import recoverable
    from yeto_patch.wire.frames import FrameError
    from yeto_patch.wire.transport import listen
    srv = listen("127.0.0.1:0")
    addr = "127.0.0.1:%d" % srv.getsockname()[1]

    def rogue():
        s, _ = srv.accept()
        env = struct.pack("<QHHQQ", 1, MsgType.BASE, 0, 1 << 30, 0) + b"\0" * 64
        s.sendall(struct.pack("<4sHHIQQ", b"YETO", 1, MsgType.CHUNK, 0, len(env), xxhash.xxh3_64_intdigest(env)) + env)
        time.sleep(2)
        s.close()

    th = threading.Thread(target=rogue, daemon=True)
    th.start()
    t0 = time.monotonic()
    with pytest.raises(FrameError, match="announces 1073741824 bytes, above the maximum 65536") as e:
        client(addr, "a", connect_retries=0).connect()
    assert time.monotonic() - t0 < 1.5 and recoverable(e.value)
    th.join(10)
    srv.close()
