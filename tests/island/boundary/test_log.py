"""BoundaryLog: one JSON line per event, flushed as written; a boundary record completed from the push, the figures
measured on its way and the install that answered it; an install that answered no push; nothing at start."""
import json

import numpy as np

from yeto_patch.island.boundary.fragment import Push, PushPhase, PushWire
from yeto_patch.island.boundary.log import BoundaryLog


def lines(path):
    return [json.loads(x) for x in open(path)]


def test_events_carry_island_time_and_fields_and_reach_the_file_at_once(tmp_path):
    p = tmp_path / "sub" / "m.jsonl"
    log = BoundaryLog(str(p), "a")
    log.write("start", step=0, fragments=2, versions=[0, 0], extra=np.float32(1.5))
    (rec,) = lines(p)   # (read before close: flushed per line)
    assert rec["event"] == "start" and rec["island"] == "a" and rec["extra"] == 1.5 and rec["time"] > 0
    log.close()
    log.close()   # idempotent
    log.write("after", step=1)   # a closed log drops records, it does not raise
    assert len(lines(p)) == 1


def test_a_boundary_record_joins_push_figures_and_install(tmp_path):
    p = tmp_path / "m.jsonl"
    log = BoundaryLog(str(p), "b")
    push = Push(step=10, base_version=3, steps=10, tokens=640, phase=PushPhase.AT_SYNCER)
    wire = PushWire(np.zeros(8, np.uint8), "int4", {"bytes": 8, "gather_ms": 1.5, "wait_ms": 2.0}, send_ms=4.0)
    log.installed(15, 2, 4, "blend", "answer", 12.345, 0, push, wire, staged_wait_ms=0.0, after_step=False)
    (rec,) = lines(p)
    assert rec["event"] == "boundary" and rec["step"] == 10 and rec["fragment"] == 2 and rec["version"] == 4
    assert (rec["base_version"], rec["steps"], rec["tokens"], rec["codec"], rec["bytes"]) == (3, 10, 640, "int4", 8)
    assert (rec["pull_lag"], rec["install_ms"], rec["wait_ms"], rec["send_ms"]) == (5, 12.35, 2.0, 4.0)
    assert rec["installed"] is True and rec["mode"] == "blend" and rec["after_step"] is False
    log.close()


def test_an_install_that_answered_no_push_is_its_own_record_but_not_at_start(tmp_path):
    p = tmp_path / "m.jsonl"
    log = BoundaryLog(str(p), "c")
    log.installed(0, 0, 1, "replace", "start", 3.0, 0)
    log.installed(7, 1, 5, "blend", "arrived", 3.0, 2, stage_ms=9.0)
    (rec,) = lines(p)
    assert (rec["event"], rec["fragment"], rec["version"], rec["reason"], rec["updates"], rec["stage_ms"]) == \
        ("install", 1, 5, "arrived", 2, 9.0)
    log.close()


def test_no_path_no_file():
    log = BoundaryLog(None, "d")
    log.write("start", step=0)
    log.installed(1, 0, 1, "replace", "arrived", 1.0, 0)
    log.close()
