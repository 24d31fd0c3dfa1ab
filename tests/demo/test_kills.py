"""The demo's --kill schedule (yeto_patch/demo/kills.py): its checks, and a real process tree killed whole and
launched again, without the supervisor taking the kill for a failure. (The whole path with real islands:
test_island_kill.py.)"""
import json
import os
import sys
import time

import pytest

from yeto_patch.demo.kills import Killer, descendants, parse_kills
from yeto_patch.demo.procs import Supervisor


def test_parse_kills_checks_each_event():
    (e,) = parse_kills(["1:40:5"], islands=2, steps=100, save_interval=20)
    assert (e.island, e.step, e.seconds) == (1, 40, 5.0)
    for texts, why in ((["1:40"], "ISLAND:STEP:SECONDS"), (["2:40:5"], "island 2 of 2"),
                       (["0:10:5"], "STEP must be in 20..99"), (["0:100:5"], "STEP must be in"),
                       (["0:40:-1"], "SECONDS"), (["0:40:1", "0:60:1"], "one kill per island")):
        with pytest.raises(ValueError, match=why):
            parse_kills(texts, islands=2, steps=100, save_interval=20)
    with pytest.raises(ValueError, match="needs --save-interval"):
        parse_kills(["0:40:5"], islands=2, steps=100, save_interval=0)
    assert parse_kills(["0:30:1"], 1, 100, 20, first=10) and not parse_kills([], 1, 100, 0)
    with pytest.raises(ValueError, match="30..99"):
        parse_kills(["0:25:1"], 1, 100, 20, first=10)


# a launcher whose worker sits in a session of its own (as torchrun's do): the process group alone misses it
TREE = ("import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        "time.sleep(120)\n")


def test_an_island_is_killed_whole_and_launched_again(tmp_path):
    log = tmp_path / "island.jsonl"
    with Supervisor(str(tmp_path / "logs"), grace_s=2) as sup:
        first = sup.start("island", [sys.executable, "-c", TREE])
        deadline = time.time() + 30
        while not descendants(first.pid) and time.time() < deadline:
            time.sleep(0.05)
        workers = descendants(first.pid)
        assert workers
        islands = [first]
        (ev,) = parse_kills(["0:3:0.2"], 1, 10, 2)
        relaunched = []

        def relaunch(k, n):
            relaunched.append((k, n))
            return sup.start(f"island-relaunch{n}", [sys.executable, "-c", "pass"])
        with Killer([ev], sup, islands, lambda k: str(log), relaunch) as killer:
            log.write_text("".join(json.dumps({"event": "train", "step": s}) + "\n" for s in (1, 2)))
            time.sleep(0.3)
            assert ev.killed_t is None and first.poll() is None      # not at its step yet
            with open(log, "a") as f:
                f.write(json.dumps({"event": "train", "step": 3}) + "\n")
            sup.wait(lambda: islands, 30, tick=killer.check, tick_every_s=0.1)
            killer.check()
        assert relaunched == [(0, 1)] and islands[0] is not first and islands[0].poll() == 0
        assert ev.killed_step == 3 and ev.restarted_t - ev.killed_t >= 0.2
        assert first.poll() == -9 and first.retired
        for pid in workers:     # its worker in a session of its own died with it
            deadline = time.time() + 5
            while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.time() < deadline:
                time.sleep(0.05)
            assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", pid
        sup.check()             # the kill is no failure


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rindex(")") + 2]
    except OSError:
        return "gone"
