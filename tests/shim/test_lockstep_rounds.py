"""Lock-step rounds across speeds (issue 35, item 5), end to end on real megatron-core: with a fixed roster
(``--quorum``) and each island's H pinned in proportion to its speed (a slow island pushes every 3 steps, a fast
one every 6), round k of a fragment merges the k-th push of each island whatever the timing: the same two islands
with their speeds swapped (the slow one sleeping after each step, then the fast one) end with bit-identical
models, and every merge until the fast island's last push holds both (the syncer's advice of an H per island,
said after a minute of waiting, is tested in tests/syncer/test_lockstep.py). Runtime: about a minute."""
import json

import numpy as np
import pytest

from tests.shim import procs as P

STEPS, FRAGMENTS = 24, 2
ENV = dict(YETO_DILOCO_OVERLAP_STEPS=1, YETO_DILOCO_CHUNK_BYTES="64K", YETO_DILOCO_TIMEOUT=120)
H = {"a": 3, "b": 6}


def run(tmp, sleep: dict):
    tmp.mkdir()
    key = P.key_file(tmp)
    port = P.free_port()
    syncer = P.start_syncer(tmp, port, fragments=FRAGMENTS, key=key, extra=["--lease", "20"])
    islands = [P.start_island(tmp, x, port, ["--data-seed", str(k + 1), "--step-sleep", str(sleep.get(x, 0.0))],
                              STEPS, dict(ENV, YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_SYNC_EVERY=H[x]), nproc=1)
               for k, x in enumerate("ab")]
    rcs = P.wait_all([*islands, syncer], timeout=600)
    assert rcs == [0, 0, 0], P.logs([*islands, syncer])
    with open(tmp / "tape.jsonl") as f:
        tape = [json.loads(line) for line in f if line.strip()]
    model, _ = P.syncer_model(str(tmp / "syncer.ckpt"))
    return tape, model


@pytest.mark.timeout(900)
def test_rounds_keyed_by_push_count_do_not_depend_on_the_islands_speeds(tmp_path):
    tape1, model1 = run(tmp_path / "a-slow", {"a": 0.3})
    tape2, model2 = run(tmp_path / "b-slow", {"b": 0.3})
    # each fragment's rounds (the fragments' merges interleave by timing), with the islands each held
    merged = [{f: [sorted(r["island"] for r in t["responders"]) for t in tape if t["fragment"] == f]
               for f in range(FRAGMENTS)} for tape in (tape1, tape2)]
    assert merged[0] == merged[1]
    # b pushes each fragment every 6 steps (and once more at its final cut when its last boundary came before it),
    # a every 3: each fragment's first rounds hold both, the rest a alone (b has finished)
    for rounds in merged[0].values():
        both = sum(1 for who in rounds if who == ["a", "b"])
        assert STEPS // H["b"] <= both <= STEPS // H["b"] + 1, rounds
        assert rounds == [["a", "b"]] * both + [["a"]] * (len(rounds) - both), rounds
    assert sorted(model1) == sorted(model2)
    for k in model1:
        assert np.array_equal(model1[k], model2[k]), (k, float(np.abs(model1[k] - model2[k]).max()))
