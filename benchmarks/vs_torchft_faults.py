"""The failure schedule and the slow link of benchmarks/vs_torchft.py (issue #39, items 4 and 5).

A schedule is a list of events, each at a participant's (replica group's / island's) step, the same on both sides
(`parse_events`, seeded by `seeded_events`):
- ``outage:K:STEP:SECONDS``: participant K's access link (benchmarks/netlab.py) down for SECONDS once K has logged
  STEP;
- ``kill:K:STEP:SECONDS``: participant K exits hard after STEP and is started again SECONDS later (torchft: the
  replica exits after the step and heals from a live peer; yeto-patch: the demo's ``--kill`` SIGKILLs every
  process of the island once it logged STEP and relaunches it with ``--load``: it resumes from its own latest
  checkpoint, with its sync state saved beside it by ``yeto_patch.hooks.checkpoint_saved``, and the syncer).

`Watcher` fires the outages from a thread while a side runs (it reads each participant's step from a function;
each side runs its kills itself). `analyse` turns the per-step logs (step, wall time t) into the figures: the survivors' longest stop (the longest
time between two of their consecutive steps), the restarted one's time from restart to its first step after
healing, and goodput (fragment-steps that went into a committed/merged sync over fragment-steps computed).
"""
from __future__ import annotations

import random
import statistics
import threading
import time

__all__ = ["Event", "parse_events", "seeded_events", "survivors", "Watcher", "longest_stop", "stop_during", "goodput_torchft",
           "goodput_yeto"]


class Event:
    __slots__ = ("kind", "who", "step", "seconds", "fired_t", "done_t")

    def __init__(self, kind, who, step, seconds):
        if kind not in ("outage", "kill"):
            raise ValueError(f"unknown event kind {kind!r} (outage or kill)")
        if who < 0 or step < 1 or not 0 < seconds <= 600:
            raise ValueError(f"bad event {kind}:{who}:{step}:{seconds}")
        self.kind, self.who, self.step, self.seconds = kind, int(who), int(step), float(seconds)
        self.fired_t = self.done_t = None

    def __str__(self):
        return f"{self.kind}:{self.who}:{self.step}:{self.seconds:g}"

    def as_dict(self):
        return dict(kind=self.kind, who=self.who, step=self.step, seconds=self.seconds, fired_t=self.fired_t,
                    done_t=self.done_t)


def parse_events(texts, participants):
    out = []
    for text in texts:
        try:
            kind, who, step, secs = text.split(":")
            ev = Event(kind, int(who), int(step), float(secs))
        except ValueError as err:
            raise SystemExit(f"--event {text!r}: {err} (KIND:PARTICIPANT:STEP:SECONDS)")
        if ev.who >= participants:
            raise SystemExit(f"--event {text!r}: participant {ev.who} of {participants}")
        out.append(ev)
    return out


def seeded_events(seed, participants, steps, outage_s=10.0, down_s=5.0):
    """One participant, chosen by `seed`, killed at a seeded step of the run's second fifth (started again
    `down_s` later) and its link cut for `outage_s` at a seeded step of its fourth fifth; the others are the
    survivors whose stops are measured. (Early enough that a restarted torchft replica, which takes a start-up
    and a quorum to heal, is back before the others finish.)"""
    rng = random.Random(seed)
    who = rng.randrange(participants)
    return [Event("kill", who, rng.randrange(steps // 5, 2 * steps // 5), down_s),
            Event("outage", who, rng.randrange(3 * steps // 5, 4 * steps // 5), outage_s)]


def survivors(events, participants):
    """The participants no event hit."""
    hit = {e.who for e in events}
    return [k for k in range(participants) if k not in hit]


class Watcher:
    """Fires the schedule's outages on `lab` once their participant's step (`step_of(k)`) reaches theirs."""

    def __init__(self, events, step_of, lab):
        self.events = [e for e in events if e.kind == "outage"]
        self.step_of, self.lab = step_of, lab
        self._stop = threading.Event()
        self._threads = []
        self._t = threading.Thread(target=self._run, daemon=True, name="vs-torchft-faults")

    def __enter__(self):
        if self.events:
            if self.lab is None:
                raise SystemExit("an outage needs the network namespaces (--link-mbit)")
            self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._t.is_alive():
            self._t.join(timeout=5)
        for t in self._threads:
            t.join(timeout=max(e.seconds for e in self.events) + 5)

    def _run(self):
        pending = list(self.events)
        while pending and not self._stop.wait(0.05):
            for ev in list(pending):
                if (self.step_of(ev.who) or 0) >= ev.step:
                    pending.remove(ev)
                    t = threading.Thread(target=self._outage, args=(ev,), daemon=True)
                    t.start()
                    self._threads.append(t)

    def _outage(self, ev):
        ev.fired_t = time.time()
        self.lab.outage(ev.who, ev.seconds)
        ev.done_t = time.time()


def longest_stop(times):
    """(longest time between two consecutive steps' ends, the median of those times) of one participant over
    steps 2..T-1, as the blocked-time figures: the first step (start-up) and the last (yeto-patch's final cut,
    which waits for every island's last push; torchft has none) are left out."""
    inner = times[1:-1]
    gaps = [b - a for a, b in zip(inner, inner[1:])]
    if not gaps:
        return None, None
    return max(gaps), statistics.median(gaps)


AFTER_S = 30.0   # an event's window: from it until this long after it ended (a restart, a link back up)


def stop_during(times, events):
    """Per event kind, the longest time between two consecutive step ends of one participant (`times`: absolute
    step-end times) that overlaps the event's window (from the event until AFTER_S after it ended), over steps
    2..T-1 as `longest_stop` (the last step's wait, yeto-patch's final cut, is reported apart: `final_wait`)."""
    times = times[1:-1]
    out = {}
    for ev in events:
        if ev.fired_t is None:
            continue
        lo, hi = ev.fired_t, (ev.done_t or ev.fired_t) + AFTER_S
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= lo and a <= hi]
        if gaps:
            out[ev.kind] = max(out.get(ev.kind, 0.0), max(gaps))
    return out


def final_wait(times):
    """The last step's time beyond the median step of one participant: yeto-patch's final cut waits there for
    every island's last push and the final model; torchft's last step is an ordinary one."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    if len(gaps) < 2:
        return None
    return gaps[-1] - statistics.median(gaps)


def goodput_torchft(logs, fragments, sync_every):
    """logs: per replica, its step records (step, outer: committed outer steps so far), every process of it in
    order. Fragment-steps that went into a committed outer step over fragment-steps computed (every step of every
    process). Per replica: each step adds one pending step to every fragment; at a fragment's sync step (every
    H / F steps, fragments in turn) its pending steps count as merged if the Manager's committed count went up
    (else DiLoCo restored the fragment: lost); a step that does not follow the previous one (a restarted process
    starting over, a heal jumping to the peers' step) loses everything pending."""
    every = max(1, sync_every // fragments)
    merged = computed = 0
    for recs in logs:
        pending = [0] * fragments
        prev = None
        for r in recs:
            computed += fragments
            if prev is not None and r["step"] != prev["step"] + 1:
                pending = [0] * fragments
            pending = [p + 1 for p in pending]
            if r["step"] % every == 0:
                f = (r["step"] // every - 1) % fragments
                if prev is not None and r["outer"] > prev["outer"] or prev is None and r["outer"] > 0:
                    merged += pending[f]
                pending[f] = 0
            prev = r
    return merged / computed if computed else None


def goodput_yeto(tape, computed_steps, fragments):
    """tape: the syncer's merges (responders carry the steps their push covers); computed_steps: every island's
    steps. Fragment-steps merged over fragment-steps computed."""
    merged = sum(r.get("steps", 0) for m in tape if m.get("ok") for r in m.get("responders", ()))
    computed = fragments * computed_steps
    return merged / computed if computed else None
