"""Vocabulary rows unlike the run's (pure logic, no megatron): the run's rows beyond this island's padded rows
are virtual items (no shard parts: read as zeros, never installed); a syncer's manifest refusal that differs only
in a vocabulary entry's row count is recognised; the start-up message says which rows stay local."""
from yeto_patch.island.masters.layout import EntryLayout, ShardLayout, build_items
from yeto_patch.island.masters.names import Entry, Manifest, run_vocab_rows, vocab_rows_message
from yeto_patch.syncer.model.layout import first_difference

EMB = "embedding.word_embeddings.weight"


def test_run_rows_beyond_the_local_padding_are_virtual_items():
    V_pad, H, T, run_rows = 8, 3, 2, 12
    for chunk in (4, 100):
        lay = EntryLayout((V_pad, H), run_rows * H, T, 0, 1,
                          [ShardLayout([(0, V_pad // T * H, 0)], (0,)) for _ in range(T)])
        items = build_items(0, lay, chunk)
        real = [i for i in items if not i.virtual]
        virtual = [i for i in items if i.virtual]
        assert sum(i.count for i in real) == V_pad * H and max(i.offset + i.count for i in real) == V_pad * H
        assert min(i.offset for i in virtual) == V_pad * H and sum(i.count for i in virtual) == (run_rows - V_pad) * H
        assert all(i.parts(lay) == [] and i.count <= chunk for i in virtual)
        covered = sorted((i.offset, i.offset + i.count) for i in items)
        assert covered[0][0] == 0 and covered[-1][1] == run_rows * H
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_a_refusal_for_vocabulary_rows_only_gives_the_runs_rows():
    mine = [("decoder.final_layernorm.weight", (64,), "float32"), (EMB, (128, 64), "float32")]
    run = [("decoder.final_layernorm.weight", (64,), "float32"), (EMB, (256, 64), "float32")]
    text = "this island's parameter manifest differs from the run's: " + first_difference(run, mine)
    assert run_vocab_rows(text, mine) == {EMB: 256}
    # any other difference is not a vocabulary padding question
    other = [("decoder.final_layernorm.weight", (32,), "float32"), (EMB, (128, 64), "float32")]
    assert run_vocab_rows("x: " + first_difference(other, mine), mine) is None
    wider = [("decoder.final_layernorm.weight", (64,), "float32"), (EMB, (128, 32), "float32")]
    assert run_vocab_rows("x: " + first_difference(wider, mine), mine) is None
    assert run_vocab_rows("bad manifest", mine) is None


def test_start_up_message_names_the_local_rows_and_the_megatron_option():
    m = Manifest(entries=[Entry(EMB, (256, 64))], local=[], real_vocab_size=100)
    msg = vocab_rows_message(m, EMB, 128)
    assert "rows 0..127 are merged" in msg and "padding rows 128..255 stay local" in msg
    assert "--make-vocab-size-divisible-by" in msg and "real vocabulary is 100" in msg
    m = Manifest(entries=[Entry(EMB, (128, 64))], local=[], real_vocab_size=None)
    assert "the run's rows 128..255 are not held here" in vocab_rows_message(m, EMB, 256)
