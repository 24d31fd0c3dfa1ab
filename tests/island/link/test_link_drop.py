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

from tests.island.link.test_sharded_link import until as _poll_until
from tests.island.link.test_syncer_link import settings
from tests.syncer.helpers import MANIFEST, join_all, make_server
from yeto_patch.island.boundary.fragment import Fragments, PushWire
from yeto_patch.island.link.syncer import SyncerLink
from yeto_patch.wire import codecs


def _install(st, answers):
    b = st.side.arrived
    st.take_arrived(b.version, len(b.deltas) if b.relative else 0, bool(b.held))
    return st.installed(b.version, answers=answers)


class Run:
    """A syncer merging with quorum 1 (grace 0), island b (a scripted client that initializes the run) and island
    a's SyncerLink with its fragments at v0; b's first push merges v1 without a, and a has received v1."""

    def __init__(self, tmp_path):
        self.s, addr = make_server(islands=2, fragments=2, rounds={"quorum": 1, "grace_s": 0.0},
                                   merge={"max_base_lag": 4})
        (self.b,), _, _, _ = join_all(addr, ["b"])
        self.link = link = SyncerLink(settings(tmp_path, int(addr.rsplit(":", 1)[1])), MANIFEST, step=lambda: 7)
        w = link.open()
        self.frags = frags = Fragments(w.layout, w.numels, [int(np.prod(sh)) for _, sh, _ in MANIFEST],
                                       announced=w.fragments)
        link.attach(frags)
        self.records = []
        link.record = lambda event, **kw: self.records.append((event, kw))
        _poll_until(link, frags, lambda: all(st.side.arrived is not None for st in frags), "initial bases")
        for st in frags:
            _install(st, answers=True)
        link.resilient = True
        self.st = st = frags[0]
        self.b_pushes(0)   # v1: merged without island a
        _poll_until(link, frags, lambda: st.side.arrived is not None and st.side.arrived.version == 1, "v1 at a")

    def b_pushes(self, version):
        """b's push relative to `version`, merged at once (quorum 1); returns b's new base."""
        delta = np.full(self.st.numel, 0.125, np.float32)
        self.b.push(0, base_version=version, local_step=4 * (version + 1), steps=4, tokens=40, codec="f32",
                    body=codecs.encode("f32", delta, 256))
        return self.b.wait_base(0, version + 1, 20)

    def a_pushes_into_a_cut_link(self):
        """a's push, relative to its anchor v0, made after v1 arrived and handed over as the link is cut."""
        st = self.st
        st.count(5)
        st.begin_push(8)
        self.link.client.conn.sock.shutdown(socket.SHUT_RDWR)
        st.push_handed(PushWire(codecs.encode("f32", np.full(st.numel, -0.5, np.float32), 256), "f32"))
        self.link.send_push(st.outgoing(blend=False))

    def close(self):
        self.link.close()
        self.b.close()
        self.s.stop()


def test_a_push_handed_to_a_cut_link_after_a_newer_base_is_sent_and_merged(tmp_path):
    run = Run(tmp_path)
    try:
        link, frags, st, records, b_pushes = run.link, run.frags, run.st, run.records, run.b_pushes
        run.a_pushes_into_a_cut_link()

        # the island's driver: newer bases go in as newer bases; the push waits for its own answer
        newer, answered_by, b_again = [], None, False
        deadline = time.monotonic() + 30
        while st.push is not None:
            assert time.monotonic() < deadline, f"a's push never answered; held by the link: {link.unanswered()}"
            link.wait(0.2)
            frags.receive(link.poll())
            if st.answered():   # (as the engine's driver: an answer at hand goes in, else the push settles)
                if st.side.arrived is not None and st.side.arrived.version > st.anchor_version:
                    answered_by = st.side.arrived.version
                    assert _install(st, answers=True) is not None
                else:   # the syncer carried it into the next merge after v1 went in: done
                    answered_by = st.anchor_version
                    assert st.settle() is not None
            elif st.newer_at_hand():
                newer.append(st.side.arrived.version)
                _install(st, answers=False)
            if not b_again and st.side.wire is not None and st.side.wire.send_ms is not None:
                time.sleep(0.3)   # a's push went out again on the new link: b's next push closes the round it is in
                b_pushes(1)
                b_again = True
        if not b_again:   # (the round after v1 closes in any case: a push of a's that reached the syncer is in it)
            run.b_pushes(1)
        _poll_until(link, frags, lambda: any(e == "merge" and kw["version"] == 2 for e, kw in records), "v2")
        merged = [kw for e, kw in records if e == "merge" and kw["fragment"] == 0 and "lag" in kw]
        assert merged, f"a's push was never merged nor refused: {records}"
        # merged once, relative to v0; the island moved on when the merge took it, or (the syncer carried it into
        # the next merge, PUSH_REPLY 'carried') with the newer base v1 while the link held it until that merge
        assert len(merged) == 1 and merged[0]["lag"] == merged[0]["version"] - 1, merged
        assert answered_by in (1, merged[0]["version"]), answered_by
        assert 1 in newer, newer                           # v1 went in as a newer base, not as the answer
        assert [e for e, _ in records].count("reconnect") == 1 and link.unanswered() == []
    finally:
        run.close()


def test_the_reconnecting_thread_sends_the_held_push_without_waiting_for_a_poll(tmp_path):
    """An island in a long compute pause does not poll: its link, once back, sends the push at once."""
    run = Run(tmp_path)
    try:
        first = run.link.client
        run.a_pushes_into_a_cut_link()
        deadline = time.monotonic() + 10
        while run.link.outage is None:   # the poll that notices the cut (it starts the reconnect) ...
            assert time.monotonic() < deadline, "the cut link was never noticed"
            run.frags.receive(run.link.poll())
            time.sleep(0.05)
        while run.link.client is first:
            assert time.monotonic() < deadline, "no reconnect"
            run.link.wait(0.5)   # ... and no poll after it: the reconnecting thread rings the bell when it is up
        time.sleep(0.5)
        base = run.b_pushes(1)   # the round after v1 closes: a's push, sent again by the reconnect, is in it
        assert base.merge is not None and base.merge["islands"] == 2, base.merge
    finally:
        run.close()
