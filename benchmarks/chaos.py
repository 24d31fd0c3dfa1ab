#!/usr/bin/env python
"""Islands that crash, stall and run slower, against the syncer's defaults and the fixed roster: goodput,
utilisation, rounds per minute, global downtime, healthy islands lost, refused pushes, pushes that ended neither
merged nor refused.

A fleet of simulated islands (benchmarks/chaos_island.py: the product's island link, waits, fragment states, plans,
schedule and restart state; only the compute is a sleep) at speeds 1.0, 1.0, 1.0, 0.7, 0.5, 0.35 runs against a
real syncer process for a fixed wall time, each island through a relay of its own. A seeded chaos schedule
kills islands (SIGKILL; restarted from their last checkpoint after 1-5 of their boundary intervals), cuts their
links for seconds (the relay drops the connection and refuses new ones) and pauses them (SIGSTOP / SIGCONT).
Time limits are scaled down like the fleet (YETO_DILOCO_TIMEOUT=20s, --lease 2 --io-timeout 4 --round-timeout
20). Each configuration runs the same schedule:

- ``defaults``: the syncer's defaults (elastic rounds, adaptive grace window, --max-base-lag 4, token weights);
- ``fixed roster``: ``--quorum`` = the number of islands (every island waited for, down or not);
- ``no chaos``: the defaults without failures.

Goodput counts tokens per fragment: every fragment's push carries the steps since that fragment's previous push,
so a step's tokens are merged once per fragment; goodput is the merged tokens over the fragments' pushes divided by
the fragments x the tokens computed.

Per configuration: goodput (tokens whose pushes were merged into the global model / tokens computed by the islands
while up; and the same with each push counted at its merge weight relative to an on-time push), utilisation
(share of island-up time spent computing, not waiting), merges and rounds per minute, global downtime (the longest
interval with no merge while islands were up) against the slowest island's boundary interval, healthy islands
that stopped with an error (and islands still waiting for the final model at the end: "unfinished"), pushes
refused and why. Last line:
``chaos: goodput G, utilisation U, healthy islands lost L, global downtime D s (defaults)``.

    python benchmarks/chaos.py                       # 180 s per configuration, high chaos (about 10 minutes)
    python benchmarks/chaos.py --quick               # the CI setting (tests/syncer/test_chaos.py)
    python benchmarks/chaos.py --configs defaults --seconds 60 --seed 3 --sync-every auto:20

The quality run (real megatron-core islands, one killed and restarted from its checkpoint) is
benchmarks/chaos_quality.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISLAND = os.path.join(ROOT, "benchmarks", "chaos_island.py")
sys.path.insert(0, ROOT)
# the syncer is restarted on its port: one below the ephemeral range, which islands redialling it cannot take
from tests.ports import free_port  # noqa: E402
SPEEDS = (1.0, 1.0, 1.0, 0.7, 0.5, 0.35)
LEVELS = {"high": dict(kills=8, outages=16, pauses=19), "low": dict(kills=3, outages=6, pauses=6),
          "none": dict(kills=0, outages=0, pauses=0)}   # events per 180 s
CONFIGS = {"defaults": ([], True), "fixed roster": (["--quorum", "{n}"], True), "no chaos": ([], False)}
SCALED = dict(timeout="20s", lease="2", io_timeout="4", round_timeout="20")
REFUSED = re.compile(r"refused push of fragment (\S+) \(base v(\S+)\) from island (\S+) \[([a-z-]+)\]")
CLOSED = re.compile(r"push of fragment (\S+) \(base v(\S+)\) from island (\S+) came after the fragment closed")
FINAL_CUT = re.compile(r"^(\S+ \S+) \S+ INFO final cut:", re.M)


# ------------------------------------------------------------------------------------------------ the network
class Relay:
    """Forwards one island's connections to the syncer; ``outage(s)`` drops them and refuses new ones for s."""

    def __init__(self, target: int):
        self.target = target
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.down_until = 0.0
        self.conns: list = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            if time.monotonic() < self.down_until:
                a.close()
                continue
            try:
                b = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                a.close()
                continue
            b.settimeout(None)
            with self.lock:
                self.conns += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def outage(self, seconds: float):
        self.down_until = time.monotonic() + seconds
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.srv.close()
        self.outage(0)


# ------------------------------------------------------------------------------------------------ the schedule
def chaos_schedule(seed: int, seconds: float, level: str, intervals: list) -> list:
    """[(t, kind, island, seconds)] sorted by t: kills (down 1-5 boundary intervals), outages, pauses."""
    rng = random.Random(seed)
    n = len(intervals)
    rate = {k: v * seconds / 180.0 for k, v in LEVELS[level].items()}
    ev = []
    for _ in range(round(rate["kills"])):
        i = rng.randrange(n)
        ev.append((rng.uniform(0.1, 0.75) * seconds, "kill", i, rng.uniform(1, 5) * intervals[i]))
    for _ in range(round(rate["outages"])):
        ev.append((rng.uniform(0.05, 0.85) * seconds, "outage", rng.randrange(n), rng.uniform(1, 5)))
    for _ in range(round(rate["pauses"])):
        ev.append((rng.uniform(0.05, 0.85) * seconds, "pause", rng.randrange(n), rng.uniform(0.5, 4)))
    return sorted(ev)


# ------------------------------------------------------------------------------------------------ one run
class Fleet:
    def __init__(self, a, name, flags, out):
        self.a, self.name, self.out = a, name, out
        self.n = len(a.speeds)
        os.makedirs(out, exist_ok=True)
        self.port = free_port()
        flags = [f.replace("{n}", str(self.n)) for f in flags]
        self.syncer = subprocess.Popen(
            [sys.executable, "-m", "yeto_patch.syncer", "--listen", f"127.0.0.1:{self.port}", "--islands",
             str(self.n), "--fragments", str(a.fragments), "--insecure", "--lease", SCALED["lease"],
             "--io-timeout", SCALED["io_timeout"], "--round-timeout", SCALED["round_timeout"],
             "--tape", os.path.join(out, "tape.jsonl"), "--final-ack-timeout", "10", *flags],
            env=_env(), stdout=open(os.path.join(out, "syncer.log"), "w"), stderr=subprocess.STDOUT, cwd=ROOT)
        self.relays = [Relay(self.port) for _ in range(self.n)]
        self.procs: dict = {}          # island -> Popen (the current process)
        self.runs: list = []           # [island, t_spawn, t_exit or None, killed, paused seconds, rc]
        self.paused_until = {}

    def spawn(self, i: int, restart: bool):
        a = self.a
        env = _env(YETO_DILOCO_SYNCER=f"127.0.0.1:{self.relays[i].port}", YETO_DILOCO_INSECURE="1",
                   YETO_DILOCO_ISLAND_ID=f"i{i}", YETO_DILOCO_SYNC_EVERY=a.sync_every,
                   YETO_DILOCO_PUSH_DTYPE="int4", YETO_DILOCO_TIMEOUT=SCALED["timeout"], YETO_DILOCO_LOG_LEVEL="INFO")
        d = os.path.join(self.out, f"i{i}")
        os.makedirs(d, exist_ok=True)
        cmd = [sys.executable, ISLAND, "--island", f"i{i}", "--speed", str(a.speeds[i]), "--step-s", str(a.step_s),
               "--end-file", self.end_file, "--out", d, "--checkpoint-every", str(a.checkpoint_every),
               "--run", str(len(self.runs))]
        p = subprocess.Popen(cmd + (["--restart"] if restart else []), env=env, cwd=ROOT,
                             stdout=open(os.path.join(d, "island.log"), "a"), stderr=subprocess.STDOUT)
        self.procs[i] = p
        self.runs.append([i, time.time(), None, False, 0.0, None, p])

    def _run_of(self, p):
        return next(r for r in self.runs if r[6] is p)

    def started(self) -> int:
        n = 0
        for i in range(self.n):
            path = os.path.join(self.out, f"i{i}", "stats.jsonl")
            n += os.path.exists(path) and '"start"' in open(path).read()
        return n

    def run(self, events: list) -> None:
        """Start every island, wait (up to 300 s: a loaded machine starts Python slowly) until all joined, then run
        the schedule for --seconds from there; the islands end at that time (their final cut)."""
        a = self.a
        self.end_file = os.path.join(self.out, "end_time")
        self.t_end = float("inf")
        for i in range(self.n):
            self.spawn(i, restart=False)
        deadline = time.time() + 300
        while self.started() < self.n and time.time() < deadline:
            time.sleep(0.2)
        self.t0 = time.time()
        self.t_end = self.t0 + a.seconds
        with open(self.end_file + ".tmp", "w") as f:
            f.write(repr(self.t_end))
        os.replace(self.end_file + ".tmp", self.end_file)
        restarts = []   # (t, island)
        events = list(events)
        while time.time() < self.t_end + a.final_s:
            now = time.time() - self.t0
            while events and events[0][0] <= now:
                self._apply(events.pop(0), restarts, now)
            for t, i in [r for r in restarts if r[0] <= now]:
                restarts.remove((t, i))
                self.spawn(i, restart=True)
            for i, p in list(self.procs.items()):
                if p.poll() is not None:
                    r = self._run_of(p)
                    if r[2] is None:
                        r[2], r[5] = time.time(), p.returncode
            if self.syncer.poll() is not None and all(p.poll() is not None for p in self.procs.values()):
                break
            time.sleep(0.05)
        self.stop()

    def _apply(self, e, restarts, now) -> None:
        t, kind, i, secs = e
        p = self.procs.get(i)
        alive = p is not None and p.poll() is None and not any(r[1] == i for r in restarts)
        if kind == "outage":
            self.relays[i].outage(secs)
        elif not alive:
            return
        elif kind == "kill":
            if now + secs > self.a.seconds - 8:   # (it would come back after the end: keep it up instead)
                return
            r = self._run_of(p)
            p.send_signal(signal.SIGKILL)
            p.wait()
            r[2], r[3], r[5] = time.time(), "chaos", p.returncode
            restarts.append((now + secs, i))
        elif kind == "pause":
            r = self._run_of(p)
            os.kill(p.pid, signal.SIGSTOP)
            threading.Timer(secs, lambda pid=p.pid: _cont(pid)).start()
            r[4] += secs

    def stop(self) -> None:
        """Kill what is still running at the end of the final cut's allowance (an island still waiting then is
        "unfinished", not lost)."""
        for p in list(self.procs.values()) + [self.syncer]:
            if p.poll() is None:
                _cont(p.pid)
                p.kill()
                p.wait()
                for r in self.runs:
                    if r[6] is p and r[2] is None:
                        r[2], r[3], r[5] = time.time(), "end", p.returncode
        for r in self.runs:
            if r[2] is None:
                r[2], r[5] = time.time(), r[6].returncode
        for rl in self.relays:
            rl.close()


def _cont(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


# ------------------------------------------------------------------------------------------------ figures
def figures(fleet: Fleet) -> dict:
    """The figures of one run (see the module docstring). An island process is up from its "start" record (joined,
    with every base) to its exit or kill, at most to the final cut, less the seconds it was paused; its compute
    seconds and tokens are its last record's (written every 0.5 s, so a kill loses at most that much)."""
    a, out = fleet.a, fleet.out
    t_end = fleet.t_end
    computed, compute_s, up_s = 0, 0.0, 0.0
    last, first = {}, {}
    for i in range(fleet.n):
        path = os.path.join(out, f"i{i}", "stats.jsonl")
        for line in open(path) if os.path.exists(path) else []:
            r = json.loads(line)
            if r["ev"] == "start":
                first[r["run"]] = r["t"]
            if r["t"] <= t_end + 0.5 or r["ev"] != "tick":
                last[r["run"]] = r
    for k, r in last.items():
        computed += r["tokens"]
        compute_s += r["compute_s"]
    for k, (i, t0, t1, killed, paused, rc, _) in enumerate(fleet.runs):
        if k in first:
            up_s += max(0.0, min(t1 or t_end, t_end) - first[k] - paused)
    tape = []
    if os.path.exists(os.path.join(out, "tape.jsonl")):
        tape = [json.loads(x) for x in open(os.path.join(out, "tape.jsonl")) if x.strip()]
    merges = [t for t in tape if t["ok"]]
    merged = sum(r["tokens"] for t in merges for r in t["responders"])
    weighted = sum(r["tokens"] * (r["weight"] / r["on_time_weight"] if r.get("on_time_weight") else 1.0)
                   for t in merges for r in t["responders"])
    times = sorted(t["time"] for t in merges if fleet.t0 <= t["time"] <= t_end)
    gaps = [b - a_ for a_, b in zip(times, times[1:])]
    if times:
        gaps.append(t_end - times[-1])
    lost = [f"i{r[0]}" for r in fleet.runs if not r[3] and r[5] not in (0, None)]
    unfinished = [f"i{r[0]}" for r in fleet.runs if r[3] == "end"]
    refused = {}
    log = open(os.path.join(out, "syncer.log"), errors="replace").read()
    for _, _, _, code in REFUSED.findall(log):
        refused[code] = refused.get(code, 0) + 1
    lags = [r["lag"] for t in merges for r in t["responders"]]
    everyone = sum(1 for t in merges if set(t.get("expected") or ()) <= {r["island"] for r in t["responders"]})
    interval = max(_interval(a, s) for s in a.speeds)
    unended = unended_pushes(fleet, tape, log)
    work = computed * a.fragments   # (every fragment's pushes carry the island's steps: each counts once per fragment)
    return dict(config=fleet.name, goodput=merged / work if computed else 0.0,
                goodput_weighted=weighted / work if computed else 0.0,
                utilisation=compute_s / up_s if up_s else 0.0, merges_per_min=len(times) / (a.seconds / 60),
                rounds_per_min=len(times) / a.fragments / (a.seconds / 60), downtime_s=max(gaps) if gaps else a.seconds,
                slowest_interval_s=interval, lost=lost, unfinished=unfinished, refused=refused,
                kills=sum(1 for r in fleet.runs if r[3] == "chaos"), syncer_rc=fleet.syncer.returncode,
                pushes=unended[0], unended=unended[1],
                lag_mean=statistics.mean(lags) if lags else 0.0, computed_tokens=computed, merged_tokens=merged,
                everyone=everyone / len(merges) if merges else 0.0)


def unended_pushes(fleet: "Fleet", tape: list, log: str) -> tuple:
    """(pushes made, pushes that ended neither merged nor refused), counted from both sides' records: every push an
    island process made (its stats' "push" records) by a process that ran to its end (a killed process's pushes
    after its last checkpoint die with it; those before it are sent again by its restart), against the syncer's
    merge tape (island, fragment, base version), its refusal lines and its lines for pushes that came after their
    fragment closed (the final model answers those); pushes made after the syncer's final cut began are answered by
    the final model too."""
    merged = {(r["island"], t["fragment"], r["base_version"]) for t in tape for r in t["responders"]}
    refused = {(island, int(f), int(b)) for f, b, island, _ in REFUSED.findall(log) if f.isdigit() and b.isdigit()}
    refused |= {(island, int(f), int(b)) for f, b, island in CLOSED.findall(log) if f.isdigit() and b.isdigit()}
    m = FINAL_CUT.search(log)
    cut = time.mktime(time.strptime(m.group(1).split(",")[0], "%Y-%m-%d %H:%M:%S")) if m else float("inf")
    made, unended = 0, 0
    for i in range(fleet.n):
        path = os.path.join(fleet.out, f"i{i}", "stats.jsonl")
        recs = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
        ended = {r["run"] for r in recs if r["ev"] == "end"}
        for r in recs:
            if r["ev"] != "push" or r["run"] not in ended or r["t"] >= cut:
                continue
            made += 1
            key = (f"i{i}", r["fragment"], r["base"])
            if key not in merged and key not in refused:
                unended += 1
    return made, unended


def _interval(a, speed) -> float:
    """An island's boundary interval (s): H of its fragments x its step time (auto: the fleet's rhythm)."""
    h = int(str(a.sync_every).split(":")[-1]) if str(a.sync_every) != "auto" else 100
    return h * a.step_s / (max(a.speeds) if str(a.sync_every).startswith("auto") else speed)


def table(rows: list) -> str:
    out = ["| configuration | goodput | goodput (weighted) | utilisation | merges/min | rounds/min | global downtime "
           "(s) | slowest interval (s) | kills | healthy islands lost | unfinished | refused pushes | pushes neither "
           "merged nor refused | merges holding every island up |", "|" + "---|" * 14]
    for r in rows:
        ref = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "none"
        out.append(f"| {r['config']} | {r['goodput']:.3f} | {r['goodput_weighted']:.3f} | {r['utilisation']:.3f} | "
                   f"{r['merges_per_min']:.1f} | {r['rounds_per_min']:.1f} | {r['downtime_s']:.1f} | "
                   f"{r['slowest_interval_s']:.1f} | {r['kills']} | {len(r['lost'])} | {len(r['unfinished'])} | "
                   f"{ref} | {r['unended']} of {r['pushes']} | {r['everyone']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--seconds", type=float, default=180.0, help="wall time of each configuration")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--level", choices=tuple(LEVELS), default="high", help="chaos level (events per 180 s: "
                    + "; ".join(f"{k}: {v}" for k, v in LEVELS.items()) + ")")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speeds", type=lambda s: tuple(float(x) for x in s.split(",")), default=SPEEDS)
    ap.add_argument("--step-s", type=float, default=0.1, help="seconds per step of a speed-1 island")
    ap.add_argument("--sync-every", default="auto:20", help="YETO_DILOCO_SYNC_EVERY of every island")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--checkpoint-every", type=int, default=20, help="steps between an island's checkpoints")
    ap.add_argument("--final-s", type=float, default=40.0, help="seconds allowed for the final cut")
    ap.add_argument("--quick", action="store_true", help="the CI setting: 40 s, the defaults only")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "chaos"))
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.quick:
        a.seconds, a.configs = min(a.seconds, 40.0), "defaults"
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configurations {bad}")
    intervals = [_interval(a, s) for s in a.speeds]
    events = chaos_schedule(a.seed, a.seconds, a.level, intervals)
    root = os.path.join(a.out, time.strftime("run-%Y%m%d-%H%M%S"))
    print(f"chaos: {len(a.speeds)} islands at speeds {', '.join(map(str, a.speeds))}, step {a.step_s}s, "
          f"YETO_DILOCO_SYNC_EVERY={a.sync_every}, {a.fragments} fragments, {a.seconds:.0f}s per configuration, "
          f"{a.level} chaos (seed {a.seed}): {sum(e[1] == 'kill' for e in events)} kills, "
          f"{sum(e[1] == 'outage' for e in events)} link outages, {sum(e[1] == 'pause' for e in events)} pauses; "
          f"output {root}", flush=True)
    rows = []
    for name in names:
        flags, chaotic = CONFIGS[name]
        fleet = Fleet(a, name, flags, os.path.join(root, name.replace(" ", "-")))
        fleet.run(events if chaotic else [])
        rows.append(figures(fleet))
        r = rows[-1]
        print(f"  {name:13s} goodput {r['goodput']:.3f} ({r['goodput_weighted']:.3f} weighted), utilisation "
              f"{r['utilisation']:.3f}, {r['merges_per_min']:.1f} merges/min, downtime {r['downtime_s']:.1f}s, "
              f"lost {r['lost'] or 0}, refused {r['refused'] or 'none'}", flush=True)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    d = next((r for r in rows if r["config"] == "defaults"), rows[0])
    print(f"chaos: goodput {d['goodput']:.3f}, utilisation {d['utilisation']:.3f}, healthy islands lost "
          f"{len(d['lost'])}, global downtime {d['downtime_s']:.1f} s ({d['config']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
