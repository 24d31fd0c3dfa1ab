"""The demo's process supervision: a failing child ends the wait with its error; every child is stopped."""
import os
import sys
import time

import pytest

from yeto_patch.demo.layout import parse_layout, parse_layouts
from yeto_patch.demo.procs import ChildFailed, Supervisor, error_excerpt


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_failure_surfaces_with_traceback_and_everything_stops(tmp_path):
    grandchild_pid = tmp_path / "gc.pid"
    sleeper_code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(600)']); open(%r, 'w').write(str(p.pid)); time.sleep(600)"
                    % str(grandchild_pid))
    failer_code = "import time; time.sleep(0.5); raise RuntimeError('island exploded: bad things')"
    with pytest.raises(ChildFailed) as ei:
        with Supervisor(str(tmp_path / "logs"), grace_s=2) as sup:
            sleeper = sup.start("sleeper", [sys.executable, "-c", sleeper_code])
            sup.start("failer", [sys.executable, "-c", failer_code])
            t0 = time.time()
            sup.wait(sup.children, timeout_s=60)
    assert time.time() - t0 < 30
    err = ei.value
    assert err.name == "failer" and err.returncode == 1
    assert "RuntimeError: island exploded: bad things" in str(err)
    assert not _alive(sleeper.pid)
    gc = int(grandchild_pid.read_text())
    deadline = time.time() + 5
    while _alive(gc) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(gc), "a grandchild in the child's process group survived"


def test_timeout_names_the_late_child(tmp_path):
    with Supervisor(str(tmp_path), grace_s=1) as sup:
        c = sup.start("slow", [sys.executable, "-c", "import time; time.sleep(60)"])
        with pytest.raises(TimeoutError, match="slow still running"):
            sup.wait([c], timeout_s=0.5)
    assert not _alive(c.pid)


def test_error_excerpt_prefers_the_rank_traceback():
    log = "\n".join([
        "W1129 some torchrun warning",
        "[rank1]: Traceback (most recent call last):",
        "[rank1]:   File \"train.py\", line 3, in <module>",
        "[rank1]: yeto_patch.config.ConfigError: YETO_DILOCO_PUSH_DTYPE='int3' is not accepted",
        "Traceback (most recent call last):",
        "  File \"torchrun\", line 8",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ])
    ex = error_excerpt(log)
    assert "ConfigError: YETO_DILOCO_PUSH_DTYPE" in ex and "ChildFailedError" not in ex
    assert error_excerpt("a\nb\nc") == "a\nb\nc"


def test_layouts():
    assert parse_layout("tp2").nproc == 2 and parse_layout("tp2pp2").nproc == 4
    assert parse_layout("pp2").name == "pp2" and parse_layout("single").nproc == 1
    assert [x.name for x in parse_layouts("tp2,pp2", 3)] == ["tp2", "pp2", "tp2"]
    with pytest.raises(ValueError, match="not understood"):
        parse_layout("tq2")
