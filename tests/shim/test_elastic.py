"""An island killed and kept down longer than the others' YETO_DILOCO_TIMEOUT does not stop them, and rejoins from
its checkpoint (Megatron-LM's own loop on real megatron-core, attached only through the environment; the syncer at
its defaults: elastic rounds, the adaptive grace window).

Island b is SIGKILLed at a random moment of iteration CRASH (its checkpoint is at SAVE) and relaunched with --load
DOWN seconds later, longer than YETO_DILOCO_TIMEOUT of island a, which trains on meanwhile (it is held at GO until b
crashed and at BACK until b rejoined, so the timeline does not depend on the machine's speed): its rounds merge
without b (b is down: its connection is gone) and it never waits at its tau bound long enough to fail. b restores
its sync state, rejoins, and both islands end with the final cut. Runtime: about 3 minutes on the 2-core machine."""
import importlib.util
import json
import os
import time

import pytest

from tests.shim import procs as P
from tests.shim.test_megatron_lm_loop import mlm_args, torchrun

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron-core < 0.17 ships no megatron.training")

ITERS, SAVE, CRASH, GO, BACK = 40, 8, 10, 5, 30
TIMEOUT, DOWN = 25, 40


def env(port, key, name, tmp):
    return dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID=name,
                YETO_DILOCO_SYNC_EVERY=4, YETO_DILOCO_TIMEOUT=TIMEOUT, YETO_DILOCO_METRICS=str(tmp / f"{name}.jsonl"))


def args(seed, ckpt, extra=()):
    return [*mlm_args(ckpt, ["--seed", str(seed), "--save", ckpt, "--save-interval", str(SAVE), "--hidden-dropout",
                             "0", "--attention-dropout", "0", *extra]), "--train-iters", str(ITERS)]


def wait_for(proc, text, timeout):
    deadline = time.time() + timeout
    while text not in proc.text() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.3)
    return text in proc.text()


@pytest.mark.timeout(1200)
def test_an_island_down_longer_than_the_timeout_stops_nobody_and_rejoins_from_its_checkpoint(tmp_path):
    port = P.free_port()
    key = P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=2, fragments=2, key=key, elastic=True,
                            extra=["--lease", "8", "--initializer", "a"])   # (a starts alone: it initializes)
    crashed, rejoined = tmp_path / "b-crashed", tmp_path / "b-rejoined"
    a = torchrun(tmp_path, "a", args(1, str(tmp_path / "ca"), ["--sleep-per-iteration", "0.8", "--hold-at-iteration",
                                                               str(GO), str(crashed), "--hold-at-iteration",
                                                               str(BACK), str(rejoined)]), env(port, key, "a", tmp_path))
    procs = [syncer, a]
    try:
        assert wait_for(a, "joined the syncer", 400), P.logs(procs)   # a initializes the run
        b = torchrun(tmp_path, "b", args(2, str(tmp_path / "cb"), ["--crash-at-iteration", str(CRASH)]),
                     env(port, key, "b", tmp_path))
        procs.append(b)
        deadline = time.time() + 900
        while b.poll() is None and time.time() < deadline:
            time.sleep(0.3)
        assert b.poll() not in (None, 0), P.logs(procs)                # b's rank 0 SIGKILLed itself
        t_kill = time.time()
        crashed.write_text("")
        while time.time() < t_kill + DOWN and a.poll() is None:
            time.sleep(0.5)
        assert a.poll() is None, P.logs(procs)                        # a is still training, DOWN s later
        b2 = torchrun(tmp_path, "b2", args(2, str(tmp_path / "cb"), ["--load", str(tmp_path / "cb")]),
                      env(port, key, "b", tmp_path))
        procs.append(b2)
        assert wait_for(b2, "joined the syncer", 400), P.logs(procs)
        t_back = time.time()
        rejoined.write_text("")
        rcs = P.wait_all([syncer, a, b2], timeout=600)
        assert rcs == [0, 0, 0], P.logs(procs)
    finally:
        for p in procs:
            p.kill()
    assert "saved the island's sync state for iteration 8" in b.text(), b.text()[-3000:]
    assert "resuming the island's sync state of iteration 8" in b2.text(), b2.text()[-3000:]
    assert "timed out" not in a.text() and "Traceback" not in a.text()
    with open(tmp_path / "tape.jsonl") as f:
        tape = [json.loads(line) for line in f if line.strip()]
    alone = [t for t in tape if t_kill + 2 < t["time"] < t_back and [r["island"] for r in t["responders"]] == ["a"]]
    assert len(alone) >= 4, [(t["time"] - t_kill, t["responders"]) for t in tape]   # a merged on without b
    assert any(r["island"] == "b" for t in tape if t["time"] > t_back for r in t["responders"])   # b rejoined
    syncer_log = syncer.text()
    assert "final cut acknowledged by ['a', 'b']" in syncer_log, syncer_log[-3000:]
    assert os.path.exists(tmp_path / "cb" / "yeto_sync" / "iter_0000008.bin")
