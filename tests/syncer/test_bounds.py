"""Numbers and meta a peer sends are bounded (issue 13, bugs 1, 4, 6, 7): out-of-range counters are refused
with a reply that is valid JSON on a connection that stays open, a checkpoint stays writable whatever was
accepted (and after a resume from one that was not), weights never overflow, a second INIT is an ERROR, and
malformed meta gets a best-effort ERROR before the syncer closes."""
import json
import time

import numpy as np
import pytest

from yeto_patch.syncer.model.checkpoint import Snapshot, read_checkpoint, write_checkpoint
from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.syncer.rounds.pushes import ReceivedPush, PushRefused
from yeto_patch.wire.schema import INT64_MAX, MAX_PUSH_STEPS, MAX_PUSH_TOKENS
from yeto_patch.wire import codecs
from yeto_patch.wire.client import SyncerRefusal
from yeto_patch.wire.frames import MsgType

from .helpers import client, join_all, make_server, running
from .test_init_meta import peer_error, send_raw

pytestmark = pytest.mark.timeout(90)
HUGE = 10 ** 4300 - 1   # the largest integer Python's JSON decoder reads (4300 digits)


def push_text(fragment, base_version, numel, **kw) -> bytes:
    fields = {"fragment": fragment, "base_version": base_version, "local_step": 1, "steps": 1, "tokens": 1,
              "codec": "f32", "block": 256, "numel": numel, "final": False, **kw}
    return ("{" + ",".join(f'"{k}":{v if isinstance(v, str) and v[:1] in "1234567890-" else json.dumps(v)}'
                           for k, v in fields.items()) + "}").encode()


def refusal_of(c, timeout=10.0) -> SyncerRefusal:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c.wait_event(0.2)
        except SyncerRefusal as e:
            return e
    raise AssertionError("no refusal")


def merge_one_round(server, cs, layout, base, steps=1, tokens=1):
    """Every island pushes every fragment relative to ``base``; waits for the merged bases."""
    for f in range(len(layout)):
        for c in cs:
            c.push(f, base_version=base, local_step=base + 1, steps=steps, tokens=tokens, codec="f32",
                   body=np.full(cs[0].welcome.numels[f], 0.01, np.float32), wait=True)
        for c in cs:
            c.wait_base(f, base + 1, 20)


# ----------------------------------------------------------------------------------------------- bug 1
def test_out_of_range_counters_are_refused_and_checkpoints_stay_writable(tmp_path):
    ck = str(tmp_path / "s.ckpt")
    server, addr = make_server(islands=1, fragments=2, checkpoint=ck, checkpoint_every=1)
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a"])
        a, n = cs[0], ws[0].numels[0]
        body = np.zeros(n, np.float32).tobytes()
        for field in ("steps", "tokens", "local_step", "block"):
            for v in (str(HUGE), str(1 << 63), "-1"):
                send_raw(a, MsgType.PUSH, push_text(0, 0, n, **{field: v}), body)
                e = refusal_of(a)
                assert e.code == "bad-push" and field in str(e) and len(str(e)) < 400, str(e)[:300]
        for field, v in (("steps", MAX_PUSH_STEPS + 1), ("tokens", MAX_PUSH_TOKENS + 1)):
            send_raw(a, MsgType.PUSH, push_text(0, 0, n, **{field: str(v)}), body)
            assert refusal_of(a).code == "bad-push"
        for v in ("1", "yes", None):   # blend is a boolean (1, a string, null: refused)
            send_raw(a, MsgType.PUSH, push_text(0, 0, n, blend=v), body)
            e = refusal_of(a)
            assert e.code == "bad-push" and "blend" in str(e), str(e)[:300]
        merge_one_round(server, cs, layout, 0, steps=MAX_PUSH_STEPS, tokens=MAX_PUSH_TOKENS)  # the maxima: taken
        merge_one_round(server, cs, layout, 1)
        assert server.exit_code is None and server.coord.versions() == [2, 2]
        meta, _ = read_checkpoint(ck)
        assert meta["ledger"]["a"]["steps"] == 2 * (MAX_PUSH_STEPS + 1) and meta["fragments"][0]["version"] == 2
        a.close()


def test_a_resume_from_a_checkpoint_with_an_unbounded_total_survives_the_next_push(tmp_path):
    ck = str(tmp_path / "s.ckpt")
    server, addr = make_server(islands=1, fragments=2, checkpoint=ck, checkpoint_every=1)
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a"])
        merge_one_round(server, cs, layout, 0)
        cs[0].close()
    meta, arrays = read_checkpoint(ck)   # as a syncer without bounds would have written it
    meta["ledger"]["a"].update(steps=HUGE, tokens=HUGE, pushes=HUGE, last_step=HUGE)
    write_checkpoint(ck, Snapshot(meta, arrays))
    server, addr = make_server(islands=1, fragments=2, checkpoint=ck, checkpoint_every=1, resume=True)
    with running(server):
        a = client(addr, "a")
        a.connect()
        a.wait_ready(20)
        merge_one_round(server, [a], layout, 1)
        assert server.exit_code is None and server.coord.versions() == [2, 2]
        meta, _ = read_checkpoint(ck)
        e = meta["ledger"]["a"]
        assert meta["fragments"][1]["version"] == 2 and (e["steps"], e["tokens"], e["pushes"]) == (INT64_MAX,) * 3
        a.close()


def test_final_and_init_fields_are_bounded(caplog):
    server, addr = make_server(islands=1, fragments=2)
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a"])
        send_raw(cs[0], MsgType.FINAL, f'{{"last_step":{HUGE}}}'.encode())
        e = peer_error(cs[0])
        assert e.code == "protocol" and "last_step" in e.message and len(e.message) < 400
        cs[0].close()
    assert "Traceback" not in caplog.text


# ----------------------------------------------------------------------------------------------- bug 4
@pytest.mark.parametrize("weights", ["steps", "tokens"])
def test_huge_weights_are_refused_without_an_internal_error(weights, caplog):
    server, addr = make_server(islands=2, fragments=1, merge={"weights": weights}, rounds={"quorum": 2})
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a", "b"])
        a, b = cs
        n = ws[0].numels[0]
        body = np.full(n, 0.5, np.float32).tobytes()
        for v in (10 ** 400, int(4e38), (1 << 64) - 1):
            send_raw(b, MsgType.PUSH, push_text(0, 0, n, **{weights: str(v)}), body)
            e = refusal_of(b)
            assert e.code == "bad-push" and weights in str(e), str(e)[:300]
        # the honest round still merges, with finite weights
        a.push(0, base_version=0, local_step=3, steps=3, tokens=3, codec="f32",
               body=np.full(n, 0.01, np.float32), wait=True)
        b.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
               body=np.full(n, 0.05, np.float32), wait=True)
        for c in cs:
            assert c.wait_base(0, 1, 20)
        rec = server.records[-1]
        # (a's 3 is capped at weights.MAX_RATIO x b's 1: nobody is on record in the run's first round, so the cap is
        # the round's other pushes, weights.WeightBook.cap_in_round)
        assert rec.ok and rec.total_weight == 3.0 and np.isfinite(rec.grad_norm)
        for c in cs:
            c.close()
    assert "Traceback" not in caplog.text and "internal error" not in caplog.text


def test_the_largest_weights_merge_finite():
    c = Coordinator(MergeSettings(weights="tokens", outer="avg"), RoundSettings(islands=3), ChunkRunner(1))
    c.set_manifest([("w", (64,), "float32")], 1)
    c.init_fragment(0, np.zeros(64, np.float32))
    for i in "abc":
        c.join(i, "1")
    d = [np.full(64, x, np.float32) for x in (0.25, -0.5, 1.0)]
    for i, delta in zip("abc", d):
        c.accept(ReceivedPush(i, 0, 0, "f32", 256, codecs.encode("f32", delta), steps=1, tokens=MAX_PUSH_TOKENS))
    rec = c.merge(0)
    assert rec.ok and np.isfinite(rec.total_weight) and rec.total_weight == 3.0 * MAX_PUSH_TOKENS
    assert np.allclose(c.frags[0].t.base, -(0.25 - 0.5 + 1.0) / 3)
    with pytest.raises(PushRefused, match="tokens") as e:
        c.accept(ReceivedPush("a", 0, 1, "f32", 256, codecs.encode("f32", d[0]), tokens=MAX_PUSH_TOKENS + 1))
    assert e.value.code == "bad-push"


# ----------------------------------------------------------------------------------------------- bug 6
def test_a_refusal_echoes_only_valid_bounded_values_and_the_connection_stays_open():
    server, addr = make_server(islands=1, fragments=2)
    with running(server):
        cs, ws, layout, _ = join_all(addr, ["a"])
        a, n = cs[0], ws[0].numels[0]
        body = np.zeros(n, np.float32).tobytes()
        cases = [("1e999", "0", "bad-fragment"), ("-1e999", "0", "bad-fragment"), (str(HUGE), "0", "bad-fragment"),
                 ("0", "1e999", "bad-base"), ("0", str(-HUGE), "bad-base"), ("0.5", "0", "bad-fragment")]
        for frag, base, code in cases:
            send_raw(a, MsgType.PUSH, push_text(frag, base, n), body)
            e = refusal_of(a)
            assert e.code == code, (frag, base, e)
            assert e.fragment in (None, 0) and e.base_version in (None, 0), (e.fragment, e.base_version)
            assert len(str(e)) < 400
        # a codec name that a reply naming it would carry past PUSH_REPLY's 1 MiB
        a.conn.send(MsgType.PUSH, {"fragment": 0, "base_version": 0, "codec": "x" * 1_049_000, "numel": n}, body)
        assert refusal_of(a).code == "bad-codec"
        merge_one_round(server, cs, layout, 0)   # the same connection goes on
        assert not a.conn_lost()
        a.close()


@pytest.mark.parametrize("fragment", ["1e999", str(HUGE), "-1", "0.0", '"0"', "true"])
def test_init_of_a_fragment_out_of_range_is_an_init_error(fragment, caplog):
    server, addr = make_server(islands=1, fragments=2)
    with running(server):
        a = client(addr, "a")
        a.connect()
        send_raw(a, MsgType.INIT, f'{{"fragment":{fragment},"numel":1,"dtype":"f32"}}'.encode(), b"\0" * 4)
        e = peer_error(a)
        assert e.code == "init" and "fragment" in e.message and len(e.message) < 400, e.message[:300]
        assert not server.coord.initialized
        a.close()
    assert "Traceback" not in caplog.text
