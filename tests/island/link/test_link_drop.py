"""Nothing lost on a link drop (issue 35, item 6), against a real in-process syncer over loopback (no torch).

Island b merges a round of fragment 0 without island a (quorum 1); a receives that base, then makes its own push
relative to the older anchor and hands it to its link just as the link is cut. The base that arrived before the
push was made is not its answer: it goes in as a newer base, the link sends the push once it is back (the
reconnecting thread does, without waiting for a poll), and the push ends merged into a later round (its merge
figures name a's lag) or refused. Before, the newer base was installed as the push's answer, the reconnect sent
only unanswered pushes, and the push was never sent: no merge, no refusal, no log line.
"""
import socket
import time

import numpy as np

from tests.island.link.test_syncer_link import settings
from tests.syncer.helpers import MANIFEST, join_all, make_server
from yeto_patch.island.boundary.fragment import Fragments, PushWire
from yeto_patch.island.link.syncer import SyncerLink
from yeto_patch.wire import codecs


def _poll_until(link, frags, ready, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what
        link.wait(0.2)
        frags.receive(link.poll())


def _install(st, answers):
    b = st.side.arrived
    st.take_arrived(b.version, len(b.deltas) if b.relative else 0, bool(b.held))
    return st.installed(b.version, answers=answers)


def test_a_push_handed_to_a_cut_link_after_a_newer_base_is_sent_and_merged(tmp_path):
    s, addr = make_server(islands=2, fragments=2, rounds={"quorum": 1, "grace_s": 0.0},
                          merge={"max_base_lag": 4})
    try:
        (b,), _, layout, _ = join_all(addr, ["b"])   # b initializes the run
        port = int(addr.rsplit(":", 1)[1])
        link = SyncerLink(settings(tmp_path, port), MANIFEST, step=lambda: 7)
        w = link.open()
        frags = Fragments(w.layout, w.numels, [int(np.prod(sh)) for _, sh, _ in MANIFEST], announced=w.fragments)
        link.attach(frags)
        records = []
        link.record = lambda event, **kw: records.append((event, kw))
        _poll_until(link, frags, lambda: all(st.side.arrived is not None for st in frags), "initial bases")
        for st in frags:
            _install(st, answers=True)
        link.resilient = True
        st = frags[0]

        def b_pushes(version):
            delta = np.full(st.numel, 0.125, np.float32)
            b.push(0, base_version=version, local_step=4 * (version + 1), steps=4, tokens=40, codec="f32",
                   body=codecs.encode("f32", delta, 256))
            b.wait_base(0, version + 1, 20)

        b_pushes(0)   # v1: merged without island a
        _poll_until(link, frags, lambda: st.side.arrived is not None and st.side.arrived.version == 1, "v1 at a")

        st.count(5)
        st.begin_push(8)   # a's push, relative to its anchor v0, made after v1 arrived
        link.client.conn.sock.shutdown(socket.SHUT_RDWR)   # the link is cut as the push is handed over
        st.push_handed(PushWire(codecs.encode("f32", np.full(st.numel, -0.5, np.float32), 256), "f32"))
        link.send_push(st.outgoing(blend=False))

        # the island's driver: newer bases go in as newer bases; the push waits for its own answer
        newer, answered_by, b_again = [], None, False
        deadline = time.monotonic() + 30
        while st.push is not None:
            assert time.monotonic() < deadline, f"a's push never answered; held by the link: {link.unanswered()}"
            link.wait(0.2)
            frags.receive(link.poll())
            if st.answered():
                answered_by = st.side.arrived.version
                assert _install(st, answers=True) is not None
            elif st.newer_at_hand():
                newer.append(st.side.arrived.version)
                _install(st, answers=False)
            if not b_again and st.side.wire is not None and st.side.wire.send_ms is not None:
                time.sleep(0.3)   # a's push went out again on the new link: b's next push closes the round it is in
                b_pushes(1)
                b_again = True
        if not b_again:   # (the round after v1 closes in any case: a push of a's that reached the syncer is in it)
            b_pushes(1)
            _poll_until(link, frags, lambda: any(e == "merge" and kw["version"] == 2 for e, kw in records), "v2")
        merged = [kw for e, kw in records if e == "merge" and kw["fragment"] == 0 and "lag" in kw]
        assert merged, f"a's push was never merged nor refused: {records}"
        assert answered_by == merged[0]["version"] and merged[0]["lag"] == merged[0]["version"] - 1
        assert 1 in newer, newer                           # v1 went in as a newer base, not as the answer
        assert [e for e, _ in records].count("reconnect") == 1 and link.unanswered() == []
        link.close()
        b.close()
    finally:
        s.stop()
