"""Pure layout logic of yeto_patch.island.masters.view (no megatron, no processes)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from yeto_patch.island.masters.collective import IslandError
from yeto_patch.island.masters.layout import EntryLayout, ShardLayout, build_items, chunk_rounds, cover


def _megatron_shards(full, dim, T, stride):
    """How megatron splits a master weight with partition_stride (tensor_parallel/layers.py
    _initialize_affine_weight_cpu): split into T*stride blocks along dim, rank r takes blocks r::T."""
    blocks = np.split(full, T * stride, axis=dim)
    return [np.concatenate(blocks[r::T], axis=dim) for r in range(T)]


@settings(max_examples=60, deadline=None)
@given(outer=st.integers(1, 5), inner=st.integers(1, 6), T=st.sampled_from([1, 2, 4]), s=st.sampled_from([1, 2]),
       B=st.integers(1, 4), dim_first=st.booleans(), chunk=st.integers(1, 200))
def test_items_reassemble_megatron_shards(outer, inner, T, s, B, dim_first, chunk):
    L = B * s * T
    shape = (L, outer * inner) if dim_first else (outer, L, inner)
    dim = 0 if dim_first else 1
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    shards = [x.reshape(-1) for x in _megatron_shards(full, dim, T, s)]
    lay = EntryLayout(shape, full.size, T, dim if T > 1 else -1, s if T > 1 else 1,
                      [ShardLayout([(0, shards[r].size, 0)], (0,)) for r in range(T)])
    if T == 1:
        lay = EntryLayout(shape, full.size, 1, -1, 1, [ShardLayout([(0, full.size, 0)], (0,))])
    items = build_items(0, lay, chunk)
    out = np.full(full.size, np.nan, dtype=np.float32)
    for it in items:
        assert it.count <= max(chunk, 1)
        piece = np.empty(it.count, dtype=np.float32)
        outer_, s_, T_, seg = lay.geometry
        if it.rows is not None:
            n_o = it.rows[1] - it.rows[0]
            v = piece.reshape(n_o, s_, T_, seg)
            for r, a, b in it.parts(lay):
                v[:, :, r, :] = shards[r][a:b].reshape(n_o, s_, seg)
        else:
            (r, a, b), = it.parts(lay)
            piece[:] = shards[r][a:b]
        assert np.all(np.isnan(out[it.offset: it.offset + it.count]))   # no overlaps
        out[it.offset: it.offset + it.count] = piece
    np.testing.assert_array_equal(out, full.reshape(-1))
    for rnd in chunk_rounds(items, chunk):
        assert len(rnd) == 1 or sum(i.count for i in rnd) <= chunk


def test_truncated_vocab_items_stop_at_real_rows():
    V_pad, H, T, real = 8, 3, 2, 5
    lay = EntryLayout((V_pad, H), real * H, T, 0, 1,
                      [ShardLayout([(0, V_pad // T * H, 0)], (0,)) for _ in range(T)])
    items = build_items(0, lay, 4)
    assert sum(i.count for i in items) == real * H
    assert max(i.offset + i.count for i in items) == real * H
    assert all(i.rows is None for i in items)


def test_cover_picks_lowest_rank_and_requires_full_coverage():
    # two replicas owning everything (non-distributed optimizer): the lowest rank reads all
    assert cover("w", 0, 10, [(3, 0, 10), (1, 0, 10)]) == [(0, 10, 1)]
    # distributed optimizer ranges + a tied copy owning everything on a higher rank
    assert cover("w", 0, 10, [(2, 0, 4), (0, 4, 10), (5, 0, 10)]) == [(0, 4, 2), (4, 10, 0)]
    # holders without masters (0, 0) are fine; a gap is an error that names the parameter
    with pytest.raises(IslandError, match="'w' shard 1: local elements \\[4"):
        cover("w", 1, 10, [(0, 0, 4), (1, 0, 0), (2, 6, 10)])
