"""The round state machine without sockets: folding, quorum, carry, staleness, refusals."""
import numpy as np
import pytest

from yeto_patch.syncer.model.runner import ChunkRunner
from yeto_patch.syncer.rounds.coordinator import Coordinator
from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings
from yeto_patch.syncer.rounds.pushes import ReceivedPush, PushRefused
from yeto_patch.wire import codecs

from .reference import RefFragment

pytestmark = pytest.mark.timeout(60)

MAN = [("a", (40, 5), "float32"), ("b", (300,), "float32"), ("c", (7, 7), "float32"), ("d", (128,), "float32")]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(islands=2, clock=None, **ms):
    ms.setdefault("weights", "equal")   # (the arithmetic of folds and carries; checked weights: test_weights.py)
    c = Coordinator(MergeSettings(**ms), RoundSettings(islands=islands, grace_s=2.0, timeout_s=10.0, lease_s=30.0),
                    ChunkRunner(2, chunk=64), clock=clock or Clock())
    c.set_manifest(MAN, 2)
    rng = np.random.default_rng(0)
    for i, f in enumerate(c.frags):
        c.init_fragment(i, rng.standard_normal(f.numel).astype(np.float32))
    for k in range(islands):
        c.join(f"i{k}", "inc0")
    return c


def push(c, island, frag, base, delta, **kw):
    kw.setdefault("steps", 1)   # (a push of no new steps weighs nothing and answers no round)
    return c.accept(ReceivedPush(island=island, fragment=frag, base_version=base, codec=kw.pop("codec", "f32"),
                         block=256, body=codecs.encode(kw.pop("codec2", "f32"), delta), **kw))


@pytest.mark.parametrize("exact", [False, True])
def test_many_rounds_match_reference(exact):
    c = make(islands=3, exact=exact, weights="steps")
    refs = [RefFragment(f.t.base, lr=0.7, mu=0.9) for f in c.frags]
    rng = np.random.default_rng(5)
    for rnd in range(6):
        for fi, f in enumerate(c.frags):
            order = list(rng.permutation(3))
            ds = {}
            for k in order:
                d = (rng.standard_normal(f.numel) * 0.05).astype(np.float32)
                steps = int(rng.integers(4, 9))   # (within 2x of each other: no weight is capped)
                ds[k] = (d, float(steps))
                assert push(c, f"i{k}", fi, rnd, d, steps=steps) == ("accepted", 0)
            assert c.due() == [fi] if fi == 1 else fi in c.due()
            rec = c.merge(fi)
            assert rec.ok and rec.version == rnd + 1
            # (until a second push of some fragment merged, no merged weight was on record to cap a push against
            # (an island's first push of a fragment is not recorded): the pushes were held and folded at merge
            # time, in island order, as with --exact; syncer/rounds/weights.py)
            held = rnd == 0 or (rnd == 1 and fi == 0)
            fold = [ds[k] for k in (sorted(ds) if exact or held else order)]
            refs[fi].merge(fold)
            assert np.array_equal(f.t.base, refs[fi].base)
            assert np.array_equal(f.t.momentum, refs[fi].m)


def test_quorum_grace_and_timeout():
    clock = Clock()
    c = Coordinator(MergeSettings(), RoundSettings(islands=3, quorum=2, grace_s=2.0, timeout_s=10.0, lease_s=30.0),
                    ChunkRunner(1), clock=clock)
    c.set_manifest(MAN, 2)
    for i, f in enumerate(c.frags):
        c.init_fragment(i, np.zeros(f.numel, np.float32))
    for k in range(3):
        c.join(f"i{k}", "x")
    n = c.frags[0].numel
    push(c, "i0", 0, 0, np.ones(n, np.float32))
    push(c, "i1", 0, 0, np.ones(n, np.float32))
    assert c.due() == []  # quorum reached, grace running, i2 stalled
    clock.t += 2.5
    assert c.due() == [0]
    rec = c.merge(0)
    assert [r["island"] for r in rec.responders] == ["i0", "i1"] and rec.expected == ["i0", "i1", "i2"]
    # below quorum: waits, but --round-timeout bounds every round that is not a fixed roster's (issue 35: a
    # member that only sends heartbeats must not stall the others' rounds): past it, the lone answer merges
    push(c, "i0", 0, 1, np.ones(n, np.float32))
    clock.t += 9
    assert c.due() == [] and c.next_deadline() == pytest.approx(clock.t + 1.0)
    clock.t += 1.5
    assert c.due() == [0]


def test_carry_of_a_late_push_with_scaled_weight_and_staleness():
    c = make(islands=2, max_base_lag=1, late_factor=0.25, outer="avg")
    f = c.frags[0]
    n = f.numel
    b0 = f.t.base.copy()
    d0 = np.full(n, 1.0, np.float32)
    push(c, "i0", 0, 0, d0)
    c.rs = type(c.rs)(islands=2, quorum=1, grace_s=0.0, timeout_s=10.0, lease_s=30.0)
    assert c.due() == [0]
    c.merge(0)
    assert np.array_equal(f.t.base, b0 - d0)
    # i1 was slow: its push relative to v0 arrives after v1 merged -> carried
    assert push(c, "i1", 0, 0, np.full(n, 2.0, np.float32)) == ("carried", 1)
    assert c.due() == []  # a carried push alone does not answer a round
    push(c, "i0", 0, 1, np.full(n, 4.0, np.float32))
    rec = c.merge(0)
    w = 0.25
    g = (np.float32(4.0) + np.float32(w) * np.float32(2.0)) / np.float32(1 + w)
    assert np.allclose(f.t.base, b0 - d0 - g)
    assert [(r["island"], r["lag"], r["carried"]) for r in rec.responders] == [("i0", 0, False), ("i1", 1, True)]
    # lag 2 > max-base-lag 1: refused, telling the island to pull
    with pytest.raises(PushRefused, match="pull") as e:
        push(c, "i1", 0, 0, np.ones(n, np.float32) * 0 + 1)
    assert e.value.code == "stale"
    with pytest.raises(PushRefused, match="duplicate"):
        push(c, "i0", 0, 1, np.ones(n, np.float32))
    with pytest.raises(PushRefused, match="pull"):
        push(c, "i0", 0, 0, np.ones(n, np.float32))


def test_duplicate_and_nan_refused_state_unchanged():
    c = make(islands=2)
    f = c.frags[1]
    n = f.numel
    push(c, "i0", 1, 0, np.ones(n, np.float32))
    with pytest.raises(PushRefused, match="duplicate"):
        push(c, "i0", 1, 0, np.ones(n, np.float32))
    acc_before = c.rounds[1].acc.copy()
    base_before = f.t.base.copy()
    bad = np.ones(n, np.float32)
    bad[3] = np.nan
    body = bad.view(np.uint8)
    with pytest.raises(PushRefused, match="non-finite") as e:
        c.accept(ReceivedPush("i1", 1, 0, "f32", 256, body, steps=1))
    assert e.value.code == "nonfinite"
    assert np.array_equal(c.rounds[1].acc, acc_before) and list(c.rounds[1].answers) == ["i0"]
    assert np.array_equal(f.t.base, base_before)
    # the island may push a good delta afterwards
    push(c, "i1", 1, 0, np.ones(n, np.float32))
    assert c.due() == [1]


def test_lease_expiry_below_the_quorum_leaves_expected_set():
    """With --quorum below --islands a silent island stops being waited for once its lease expires."""
    clock = Clock()
    c = Coordinator(MergeSettings(), RoundSettings(islands=3, quorum=2, grace_s=100.0, timeout_s=1000.0,
                                                   lease_s=5.0), ChunkRunner(1), clock=clock)
    c.set_manifest(MAN, 1)
    c.init_fragment(0, np.zeros(c.frags[0].numel, np.float32))
    for i in "abc":
        c.join(i, "1")
    push(c, "a", 0, 0, np.ones(c.frags[0].numel, np.float32))
    push(c, "b", 0, 0, np.ones(c.frags[0].numel, np.float32))
    assert c.due() == []       # c is alive: every member has not answered, the grace period runs
    clock.t += 6               # c silent past its lease
    c.touch("a")
    c.touch("b")
    assert c.due() == [0]
    with pytest.raises(PushRefused, match="expects 3"):
        c.join("d", "1") if c.join("e", "1") else None


def test_a_fixed_roster_waits_for_a_crashed_island_until_it_is_back():
    """With --quorum equal to --islands an island that crashed (lease expired) or said BYE still counts: the
    others wait for it instead of merging without it; an island that finished does not count."""
    clock = Clock()
    c = Coordinator(MergeSettings(), RoundSettings(islands=2, quorum=2, grace_s=1.0, timeout_s=100.0, lease_s=5.0),
                    ChunkRunner(1), clock=clock)
    c.set_manifest(MAN, 1)
    n = c.frags[0].numel
    c.init_fragment(0, np.zeros(n, np.float32))
    c.join("a", "1")
    c.join("b", "1")
    push(c, "a", 0, 0, np.ones(n, np.float32))
    clock.t += 6   # b silent past its lease
    c.touch("a")
    assert c.due() == []
    c.disconnected("b", bye=True)
    assert c.due() == []
    c.join("b", "2")   # b restarted
    push(c, "b", 0, 0, np.ones(n, np.float32))
    assert c.due() == [0]
    assert c.merge(0).ok
    c.finish("b", 10)  # b reached its last step: a goes on alone
    push(c, "a", 0, 1, np.ones(n, np.float32))
    assert c.due() == [0]


def test_fold_and_merge_bit_identical_for_1_and_n_threads():
    rng = np.random.default_rng(11)
    man = [("w", (300_001,), "float32"), ("v", (70_000,), "float32")]
    pushes = [[(k, codec, codecs.encode(codec, (rng.standard_normal(f_n) * 0.1).astype(np.float32)))
               for k, codec in enumerate(("int4", "int8", "bf16", "f32"))] for f_n in (300_001, 70_000)]
    init = [rng.standard_normal(n).astype(np.float32) for n in (300_001, 70_000)]
    results = []
    for threads in (1, 3, 4):
        c = Coordinator(MergeSettings(weights="tokens"), RoundSettings(islands=4),
                        ChunkRunner(threads, chunk=1 << 14), clock=Clock())
        c.set_manifest(man, 2)
        for i, f in enumerate(c.frags):
            assert f.numel == init[i].size
            c.init_fragment(i, init[i].copy())
        for k in range(4):
            c.join(f"i{k}", "x")
        for rnd in range(2):
            for fi, f in enumerate(c.frags):
                src = pushes[0] if f.numel == 300_001 else pushes[1]
                for k, codec, body in src:
                    c.accept(ReceivedPush(f"i{k}", fi, rnd, codec, 256, body, steps=1, tokens=10 + k))
                assert c.merge(fi).ok
        results.append([(f.t.base.tobytes(), f.t.momentum.tobytes()) for f in c.frags])
        c.runner.close()
    assert results[0] == results[1] == results[2]


def test_rounds_wait_for_islands_that_have_not_joined_yet():
    """A round is not closed by "every member answered" while fewer than quorum islands have joined: an island
    launched later than the first one must not find the run merged without it."""
    clock = Clock()
    c = Coordinator(MergeSettings(), RoundSettings(islands=2, quorum=2, grace_s=1.0, timeout_s=100.0, lease_s=50.0),
                    ChunkRunner(1), clock=clock)
    c.set_manifest(MAN, 1)
    c.init_fragment(0, np.zeros(c.frags[0].numel, np.float32))
    c.join("a", "1")
    push(c, "a", 0, 0, np.ones(c.frags[0].numel, np.float32))
    clock.t += 10
    c.touch("a")
    assert c.due() == []          # only one of two islands has joined
    c.join("b", "1")
    assert c.due() == []          # b joined but has not answered yet
    push(c, "b", 0, 0, np.ones(c.frags[0].numel, np.float32))
    assert c.due() == [0]


def test_quorum_one_merges_alone():
    clock = Clock()
    c = Coordinator(MergeSettings(), RoundSettings(islands=2, quorum=1, grace_s=1.0, timeout_s=100.0, lease_s=50.0),
                    ChunkRunner(1), clock=clock)
    c.set_manifest(MAN, 1)
    c.init_fragment(0, np.zeros(c.frags[0].numel, np.float32))
    c.join("a", "1")
    push(c, "a", 0, 0, np.ones(c.frags[0].numel, np.float32))
    assert c.due() == [0]


def test_a_push_being_folded_is_no_answer_yet_and_a_refused_one_leaves_no_trace(monkeypatch):
    import dataclasses
    import threading

    from yeto_patch.syncer.rounds import coordinator as rounds_mod
    c = make(islands=2)
    c.rs = dataclasses.replace(c.rs, quorum=1, grace_s=0.0)
    started, release = threading.Event(), threading.Event()
    real = rounds_mod.codecs.decode_accumulate

    def slow_decode(*a, **kw):  # the fold of the first push takes a while
        if not started.is_set():
            started.set()
            release.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(rounds_mod.codecs, "decode_accumulate", slow_decode)
    n = c.frags[0].numel
    bad = np.zeros(n, np.float32)
    bad[3] = np.nan
    out = []

    def hostile():
        try:
            c.accept(ReceivedPush(island="i1", fragment=0, base_version=0, codec="f32", block=256,
                                  body=bad.view(np.uint8), local_step=9, final=True))
        except PushRefused as e:
            out.append(e.code)

    th = threading.Thread(target=hostile)
    th.start()
    assert started.wait(10)
    assert c.due() == [] and c.next_deadline() is None  # not an answer while it is being folded
    release.set()
    th.join(10)
    assert out == ["nonfinite"]
    m = c.members["i1"]
    assert m.last_step == 0 and m.final_fragments == set() and c.due() == []  # no trace of it
    assert c.rounds[0].t_first is None and not c.rounds[0].answers
    assert push(c, "i0", 0, 0, np.ones(n, np.float32)) == ("accepted", 0)
    assert c.due() == [0]


def test_auto_outer_lr_from_the_round_pushes_steps():
    """MergeSettings(lr="auto"): the merge's lr follows the median steps its pushes report (recorded)."""
    c = make(islands=2, lr="auto")
    refs = {lr: RefFragment(c.frags[1].t.base, lr=lr, mu=0.9) for lr in (0.4,)}
    rng = np.random.default_rng(9)
    f = c.frags[1]
    ds = [(rng.standard_normal(f.numel) * 0.05).astype(np.float32) for _ in range(2)]
    for k, (d, steps) in enumerate(zip(ds, (8, 12))):
        assert push(c, f"i{k}", 1, 0, d, steps=steps) == ("accepted", 0)
    rec = c.merge(1)
    assert rec.ok and rec.outer_lr == 0.4 and rec.tape()["outer_lr"] == 0.4 and "outer lr 0.4" in rec.line()
    refs[0.4].merge([(d, 1.0) for d in ds])
    assert np.array_equal(f.t.base, refs[0.4].base)
    for k, d in enumerate(ds):
        assert push(c, f"i{k}", 1, 1, d, steps=50) == ("accepted", 0)
    assert c.merge(1).outer_lr == 0.7
    assert c.ms.resolved()["lr"] == "auto"
    for k, blend in enumerate((True, False)):   # half of the pushes blend (tau > 0): the blended rule
        assert push(c, f"i{k}", 1, 2, ds[k], steps=8, blend=blend) == ("accepted", 0)
    assert c.merge(1).outer_lr == 0.7


def test_sparse_pushes_warn_once_when_the_outer_step_has_momentum(caplog):
    """Sparse pushes with outer momentum: the syncer says once per push dtype that momentum repeats their bursts,
    naming the flags; the controls are quiet: outer lr 1 without momentum, int4, and int1 (whose pushes move every
    coordinate: with the product's defaults momentum helps it on Megatron-LM, docs/benchmarks.md)."""
    import logging
    rng = np.random.default_rng(3)

    def run(codecs_pushed, **ms):
        c = make(islands=2, **ms)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="yeto.syncer"):
            for k, codec in enumerate(codecs_pushed):
                d = (rng.standard_normal(c.frags[0].numel) * 0.01).astype(np.float32)
                push(c, f"i{k % 2}", 0, k // 2, d, codec=codec, codec2=codec)
                if k % 2:
                    c.merge(0)
        return [r.getMessage() for r in caplog.records if "sends a fraction of each push" in r.getMessage()]

    said = run(["topk:0.05+int2", "topk:0.05+int2", "topk:0.1+int2", "topk:0.05+int2"], lr=0.7, momentum=0.9)
    assert len(said) == 2 and "island i0 pushes topk:0.05+int2" in said[0] and "topk:0.1+int2" in said[1]
    assert "--outer-lr 1 --outer-momentum 0" in said[0]
    assert run(["topk:0.05+int2", "int1", "topk:0.1+int2", "int1"], lr=1.0, momentum=0.0) == []
    assert run(["int4", "int1", "int8", "int1"], lr=0.7, momentum=0.9) == []
