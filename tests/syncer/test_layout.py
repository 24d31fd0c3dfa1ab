import time

import pytest

from yeto_patch.syncer.model.layout import first_difference, fragment_numels, normalize_manifest, partition

pytestmark = pytest.mark.timeout(60)


def naive(manifest, p):
    """The rescanning greedy (quadratic): the specification the heap version must match."""
    numel = lambda s: int(__import__("math").prod(s)) if s else 1  # noqa: E731
    order = sorted(range(len(manifest)), key=lambda i: (-numel(manifest[i][1]), manifest[i][0], i))
    bins, totals = [[] for _ in range(p)], [0] * p
    for i in order:
        b = min(range(p), key=lambda j: (totals[j], j))
        bins[b].append(i)
        totals[b] += numel(manifest[i][1])
    return [sorted(b) for b in bins]


def test_matches_rescanning_greedy_and_is_deterministic():
    import random
    rng = random.Random(3)
    for trial in range(20):
        n = rng.randint(8, 300)
        man = [(f"layer.{rng.randint(0, 50)}.w{i}", (rng.choice([1, 2, 3, 4, 64]), rng.choice([1, 8, 8, 16])), "float32")
               for i in range(n)]
        p = rng.randint(1, 8)
        assert partition(man, p) == naive(man, p)
        assert partition(list(man), p) == partition(man, p)


def test_ties_by_name_and_first_smallest_bin():
    man = [("b", (4,), "float32"), ("a", (4,), "float32"), ("c", (2,), "float32"), ("d", (2,), "float32")]
    # order: a(4) b(4) c(2) d(2); a->bin0, b->bin1, c->bin0 (tie 4/4, first wins), d->bin1
    assert partition(man, 2) == [[1, 2], [0, 3]]
    assert fragment_numels(man, partition(man, 2)) == [6, 6]


def test_cost_does_not_grow_with_the_fragment_count():
    """A rescanning greedy costs O(n * P); the heap O(n log P). CPU time (not wall time: the machine is shared)
    for 1024 fragments stays within a small factor of the time for 2."""
    man = [(f"t{i:06d}", (1 + (i * 7919) % 4096,), "float32") for i in range(50_000)]

    def cpu(p):
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            lay = partition(man, p)
            best = min(best, time.process_time() - t0)
        assert sorted(i for b in lay for i in b) == list(range(len(man)))
        return best

    small, large = cpu(2), cpu(1024)
    assert large < 8 * small + 0.05, (small, large)  # rescanning would be ~500x


def test_refusals_and_first_difference():
    with pytest.raises(ValueError, match="duplicate"):
        normalize_manifest([("a", [1], "float32"), ("a", [2], "float32")])
    with pytest.raises(ValueError, match="non-empty fragments"):
        partition([("a", (1,), "float32")], 2)
    a = normalize_manifest([("a", [2, 3], "float32"), ("b", [4], "float32")])
    b = normalize_manifest([("a", [2, 3], "float32"), ("b", [5], "float32")])
    msg = first_difference(a, b)
    assert "entry 1" in msg and "'b'" in msg and "[4]" in msg and "[5]" in msg
    assert "extra entry" in first_difference(a, a + [("c", (1,), "float32")])
    assert first_difference(a, a) == ""
