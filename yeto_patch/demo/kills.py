"""The demo's island kills (``--kill K:STEP:SECONDS``): island K is killed hard once its log reached STEP and
launched again SECONDS later, resuming from its own checkpoints (``--save-interval``).

The kill is what a lost node does to a job: SIGKILL to every process of the island's launcher (torchrun, its
workers, whatever they started), with no chance to save or say goodbye. The relaunch is the island's first
command again (``train_gpt.py --load`` of its checkpoint folder: weights, optimizer state, LR and data position
from its latest checkpoint, and yeto-patch's sync state saved beside it); the syncer and the other islands run
on meanwhile. Each event kills and relaunches once (the restarts are bounded by the schedule).

``Killer`` runs the schedule from a thread while the demo waits for its islands (it reads each island's step
from its JSONL log every 50 ms), replacing the killed island's process in the list the demo waits on.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

__all__ = ["KillEvent", "parse_kills", "Killer", "last_step", "descendants"]


class KillEvent:
    __slots__ = ("island", "step", "seconds", "killed_t", "killed_step", "restarted_t")

    def __init__(self, island: int, step: int, seconds: float):
        self.island, self.step, self.seconds = int(island), int(step), float(seconds)
        self.killed_t = self.killed_step = self.restarted_t = None

    def __str__(self):
        return f"{self.island}:{self.step}:{self.seconds:g}"

    def as_dict(self) -> dict:
        return dict(island=self.island, step=self.step, seconds=self.seconds, killed_t=self.killed_t,
                    killed_step=self.killed_step, restarted_t=self.restarted_t)


def parse_kills(texts, islands: int, steps: int, save_interval: int, first: int = 0) -> list:
    """--kill K:STEP:SECONDS values -> KillEvents; ValueError saying what is wrong. The islands train steps
    first+1..steps (`first`: the warm-up's)."""
    out = []
    for text in texts:
        parts = str(text).split(":")
        try:
            k, step, secs = int(parts[0]), int(parts[1]), float(parts[2])
            if len(parts) != 3:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"--kill {text!r}: use ISLAND:STEP:SECONDS (e.g. 1:40:5)") from None
        if not 0 <= k < islands:
            raise ValueError(f"--kill {text!r}: island {k} of {islands} (0-based)")
        if not save_interval:
            raise ValueError("--kill needs --save-interval: a killed island comes back from its checkpoints")
        if not first + save_interval <= step < steps:
            raise ValueError(f"--kill {text!r}: STEP must be in {first + save_interval}..{steps - 1} (a checkpoint "
                             f"every --save-interval steps before it, to come back from; not the last step)")
        if not 0 <= secs <= 600:
            raise ValueError(f"--kill {text!r}: SECONDS must be in 0..600")
        if any(e.island == k for e in out):
            raise ValueError(f"--kill {text!r}: one kill per island")
        out.append(KillEvent(k, step, secs))
    return out


def last_step(path: str) -> int:
    """The last training step a per-step JSONL log reached (0 before its first): train_gpt.py's ``train`` records,
    or records that name no event (benchmarks/torchft_replica.py's)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("event", "train") == "train" and isinstance(r.get("step"), int):
            return r["step"]
    return 0


def descendants(pid: int) -> list:
    """Every live process below `pid` (from /proc; torchrun starts its workers in sessions of their own, so the
    launcher's process group does not hold them)."""
    children: dict = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def kill_hard(child) -> None:
    """SIGKILL the island's launcher, its process group and every process below it, all at once."""
    procs = descendants(child.pid)
    for pid in [child.pid] + procs:
        try:
            os.kill(pid, signal.SIGSTOP)   # nobody runs on (or re-parents) while the rest are found and killed
        except (ProcessLookupError, PermissionError):
            pass
    procs += [p for p in descendants(child.pid) if p not in procs]
    child.signal_group(signal.SIGKILL)
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Killer:
    """Runs the kill schedule while the demo waits: `islands` is the list of the islands' processes (the one
    the demo waits on; a relaunched island replaces its entry), `log_of(k)` island k's JSONL path and
    `relaunch(k, n)` starts island k again (its n-th relaunch) and returns its process."""

    def __init__(self, events, sup, islands, log_of, relaunch, every_s=0.05):
        self.events, self.sup, self.islands, self.log_of, self.relaunch = list(events), sup, islands, log_of, relaunch
        self.every_s = every_s
        self.error = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="yeto-demo-kills")

    def __enter__(self):
        if self.events:
            self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._t.is_alive():
            self._t.join(timeout=10)
        return False

    def check(self):
        """Raise what went wrong in the schedule's thread (the demo's wait calls it)."""
        if self.error is not None:
            raise self.error

    def _run(self):
        try:
            pending = list(self.events)
            while pending and not self._stop.wait(self.every_s):
                for ev in list(pending):
                    if self._advance(ev):
                        pending.remove(ev)
            # this thread lives as long as the demo waits: Linux sends a child's parent-death signal (the demo's
            # children ask for SIGTERM) when the THREAD that started it ends, so a relaunched island would die
            self._stop.wait()
        except Exception as err:  # noqa: BLE001  (reported by check() in the demo's thread)
            self.error = err

    def _advance(self, ev) -> bool:
        """One look at event `ev`; True once it is over (killed and relaunched)."""
        k = ev.island
        child = self.islands[k]
        if ev.killed_t is None:
            if child.poll() is not None:
                return True   # the island ended before its step: nothing to kill
            step = last_step(self.log_of(k))
            if step < ev.step:
                return False
            self.sup.retire(child)
            kill_hard(child)
            ev.killed_t, ev.killed_step = time.time(), step
            return False
        if time.time() < ev.killed_t + ev.seconds:
            return False
        ev.restarted_t = time.time()
        self.islands[k] = self.relaunch(k, 1)
        return True
