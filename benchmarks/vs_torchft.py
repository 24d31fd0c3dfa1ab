#!/usr/bin/env python
"""yeto-patch against torchft's DiLoCo: the same model, data, H, fragments, optimizers and tokens, in one run.

Needs the py312-peers environment (Python 3.12, torch 2.13.0, megatron-core 0.19.2, torchft 0.2.0 with its
torchft_lighthouse binary), which the default test install does not build:

    V=$(bash scripts/venv.sh py312-peers)
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py                 # 2 replicas, ~10 min on an idle 2-core CPU
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py --islands 4
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py --smoke         # both sides start and finish 2 syncs
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py --hidden 64 --hidden2 0 --link-mbit 4 --no-reference
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py --hidden 256 --hidden2 0 --no-baseline --faults-seed 2 \
        --lighthouse-min-replicas 1

Both sides train benchmarks/convergence.py's model and data (megatron-core GPTModel on byte-level text from
Python's standard library, each replica/island on its own shard) in fp32 on CPU with gloo, at their own documented
defaults for everything this script does not hold equal:
- yeto-patch: exactly as benchmarks/convergence.py runs it (yeto_patch.demo: the real syncer, the islands as
  torchrun'd examples/train_gpt.py jobs with yeto-patch attached by PYTHONPATH + YETO_* variables, each island
  behind the demo's metered TCP relay), at the demo's defaults: int4 pushes with error feedback, overlap tau 5,
  alpha 0.5, bases sent as int4.
- torchft: benchmarks/torchft_replica.py, one process per replica group, its documented set-up (the lighthouse as
  its README starts it, --quorum_tick_ms 100 --join_timeout_ms 10000, with --min_replicas M where the README has 1,
  as the syncer has --islands M: all replicas in every sync on both sides; Manager, gloo, DiLoCo as in
  its DiLoCo example, every DiLoCo argument not held equal at its default: fp32 allreduce, no fragment delay,
  alpha 0).
Held equal: H (--sync-every), fragments (the syncer's partition, also torchft's fragment modules), the inner
optimizer (AdamW, megatron's LR schedule, clip), the outer optimizer (Nesterov SGD, --outer-lr, momentum 0.9, per
fragment), the tokens (--steps x --batch sequences per replica), fp32 weights.

Measured, each as a ratio within this one run:
1. quality: held-out loss at equal tokens of yeto-patch's global model and of torchft's replica 0 (what a torchft
   job would save; the mean over replicas is printed too), each over the same synchronous data-parallel baseline
   (the demo's, all shards, M x the batch, cached per setting);
2. bytes per sync on the link: yeto-patch: the demo's metered relay between islands and syncer (both ways);
   torchft: the kernel's per-socket counters (ss -ti: bytes_sent less bytes_retrans, and bytes_received, of every
   TCP socket of the replicas and the lighthouse, sampled every 0.2 s), every byte that crossed between two different processes
   counted once (gloo allreduce, TCPStore, Manager and lighthouse gRPC, heartbeats). A sync = one fragment's outer
   step (torchft: Manager.current_step(); yeto-patch: the syncer's merges);
3. time the training thread is blocked at syncs, at two model sizes (--hidden and --hidden2): per step (per
   replica/island, the sum over steps 2..T-1 of (step time - the median step time), over T-2: the start and the
   last step, where yeto-patch runs its final cut and torchft its last sync, are left out on both sides) and per
   sync (the optimizer step, where both sides do their sync work, above its median at the steps a sync touches:
   torchft's sync step; yeto-patch's push step and its install step tau later), mean and median over the syncs;
   the median's slope from the small to the large model against a memcpy of one fragment (as
   benchmarks/boundary_scaling.py);
4. under failures (--faults-seed S or --event, needs root): the same seeded schedule on both sides, at the
   participants' own steps: a participant killed and started again (torchft: the replica exits hard after the
   step and is started again; it heals from a live peer, no checkpoint. yeto-patch: the demo SIGKILLs every
   process of the island once it logged the step and launches it again with --load: it comes back from its own
   latest checkpoint, written every --yeto-save-interval steps with yeto-patch's sync state beside it, and the
   syncer, with no other island needed) and its access link cut (benchmarks/netlab.py: every participant in a
   network namespace of its own). Goodput (fragment-steps that went into a committed / merged sync over those
   computed, steps computed twice included), the longest stop of the participants no event hit, the restarted
   one's time from its start to training again (torchft: its first step after healing; yeto-patch: its first
   step done after the relaunch) and what each restart needed;
5. a slow link (--link-mbit R, needs root): every replica / island behind an access link shaped by tc tbf at R
   Mbit/s both ways (no added delay: this kernel has no sch_netem); the bytes on the access links (interface
   counters), training time, blocked time.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks import convergence  # noqa: E402
from yeto_patch.demo.kills import last_step  # noqa: E402  (the step a per-step JSONL log reached)

REPLICA = os.path.join(ROOT, "benchmarks", "torchft_replica.py")
#: the lighthouse as torchft's README starts it, but for --min_replicas: the README's 1 lets the first replica up
#: train alone until the others join (its elastic start); here it is the number of replicas, as the syncer is
#: started with --islands M and the demo's start gate, so that both sides train every step with all replicas
LIGHTHOUSE_FLAGS = ["--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]


def torchft_missing():
    """Why torchft cannot run here (None if it can): the py312-peers environment is needed."""
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        return f"torchft is not installed in {sys.executable} ({err}); run with $(bash scripts/venv.sh py312-peers)"
    if not os.path.exists(lighthouse_binary()):
        return f"torchft_lighthouse not found next to {sys.executable}"
    return None


def lighthouse_binary():
    return os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")


def versions():
    import importlib.metadata as md
    return {p: md.version(p) for p in ("torch", "torchft", "megatron-core", "yeto-patch")}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- bytes on the link: the kernel's per-socket counters ---------------------------------------------------------

_SOCK = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s+users:\(\(\"[^\"]*\",pid=(\d+)")
_BYTES = re.compile(r"\bbytes_(sent|retrans|received):(\d+)")   # (sent less retrans: each byte once)


class SocketMeter:
    """Samples `ss -tinpH` every `every_s`: per TCP connection (local, peer) its owner pid and the largest
    bytes_sent (less bytes_retrans: a loaded loopback retransmits, and a byte resent is not a new byte) /
    bytes_received seen. Counts what the kernel sent, not what anybody computed."""

    def __init__(self, every_s=0.2):
        self.every_s = every_s
        self.socks = {}
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True, name="vs-torchft-ss")

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=10)
        self.sample()

    def _loop(self):
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self):
        try:
            text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        self.samples += 1
        cur = None
        for line in text.splitlines():
            m = _SOCK.match(line)
            if m:
                cur = (m.group(1), m.group(2), int(m.group(3)))
                continue
            if cur is None or not line[:1].isspace():
                cur = None
                continue
            vals = {k: int(v) for k, v in _BYTES.findall(line)}
            key = (cur[0], cur[1])
            old = self.socks.get(key)
            if old is None or old["pid"] != cur[2]:
                old = self.socks[key] = dict(pid=cur[2], sent=0, received=0)
            old["sent"] = max(old["sent"], vals.get("sent", 0) - vals.get("retrans", 0))
            old["received"] = max(old["received"], vals.get("received", 0))
            cur = None

    def between(self, pids, peers_only=False):
        """Bytes that crossed between different processes, each byte once: every socket of `pids` whose peer is
        another process counts what it sent, plus what it received from a process not in `pids` (the
        lighthouse). peers_only: only what went between two processes of `pids` (the replicas' gloo, TCPStore
        and Manager traffic, without the lighthouse's)."""
        pids = set(pids)
        total = 0
        for (local, peer), r in self.socks.items():
            if r["pid"] not in pids:
                continue
            back = self.socks.get((peer, local))
            peer_pid = back["pid"] if back else None
            if peer_pid == r["pid"]:
                continue  # a process talking to itself (its own TCPStore)
            if peers_only and peer_pid not in pids:
                continue
            total += r["sent"]
            if peer_pid not in pids:
                total += r["received"]
        return total


# --- blocked time -------------------------------------------------------------------------------------------------

def blocked_per_step(step_s):
    """Seconds per step above the median step, over steps 2..T-1 (see the module docstring)."""
    inner = step_s[1:-1]
    if len(inner) < 3:
        return None
    med = statistics.median(inner)
    return sum(s - med for s in inner) / len(inner)


def scheduled_syncs(steps, sync_every, fragments):
    """The steps at which a fragment syncs (both sides: every H / F steps, fragments taking turns)."""
    every = max(1, sync_every // fragments)
    return list(range(every, steps + 1, every))


def blocked_per_sync(opt_s, syncs):
    """Seconds the training thread spends at one sync: the optimizer step (where both sides do their sync work:
    yeto-patch's hooks around it, torchft's DiLoCo post-hook) above its median, summed over the steps that sync
    touches. `syncs`: per sync, those steps (1-based): torchft its one step (quorum, allreduce, outer step);
    yeto-patch the push step (gather, encode) and its install step (the wait at the tau bound, the install).
    Syncs in steps 2..T-1 only (start-up and the final cut left out). Returns (mean, median) over the syncs."""
    inner = opt_s[1:-1]
    if len(inner) < 3:
        return None, None
    med = statistics.median(inner)
    per = [sum(opt_s[s - 1] - med for s in set(steps) if s <= len(opt_s)) for steps in syncs
           if 2 <= min(steps) <= len(opt_s) - 1]
    if not per:
        return None, None
    return sum(per) / len(per), statistics.median(per)


def memcpy_s(nbytes, repeat=51):
    """A plain memcpy (torch copy_) of `nbytes` of float32 on the host, median of `repeat` (as
    benchmarks/boundary_scaling.py measures its reference), on one thread as the replicas and islands train
    (OMP_NUM_THREADS=1: a second intra-op thread on a loaded 2-core host made a 0.27 MB copy take ms)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.rand(max(1, nbytes // 4), dtype=torch.float32)
        dst = torch.empty_like(src)
        out = []
        for i in range(repeat + 1):
            t = time.perf_counter()
            dst.copy_(src)
            if i:
                out.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(out)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# --- the two sides ------------------------------------------------------------------------------------------------

def demo_flags(a, hidden, steps, baseline=True):
    """The demo's flags for this comparison: convergence.py's, at the demo's DiLoCo defaults, fp32."""
    c = dict(M=a.islands, H=a.sync_every, dtype=a.yeto_push_dtype, ef=a.yeto_error_feedback,
             tau=min(a.yeto_tau, a.sync_every // 2))
    ns = argparse.Namespace(**vars(a))
    ns.hidden, ns.steps, ns.eval_interval = hidden, steps, steps
    ns.baseline_layout, ns.layouts, ns.sync_warmup = a.baseline_layout, "single", 0
    ns.base_wire = a.yeto_base_wire
    ns.syncer_arg = [f"--quorum={a.yeto_quorum}"] if a.yeto_quorum else []   # (default: elastic rounds)
    f = convergence.demo_flags(c, ns) + ["--fp32"]
    return f + ([] if baseline else ["--no-baseline"])


def island_ids(n):
    """The demo's island ids (yeto_patch.demo.run: letter + layout name; every island here is 'single')."""
    return [f"{chr(ord('A') + i)}-single" for i in range(n)]


def lab_bytes(lab, before):
    """Bytes on every participant's access link since `before` (both ways; a byte between two participants
    crosses two access links and counts on both, as it would on two sites' WAN links)."""
    if lab is None:
        return None
    now = [lab.counters(k) for k in range(lab.n)]
    return sum(n["up"] + n["down"] - b["up"] - b["down"] for n, b in zip(now, before))


def run_yeto(a, hidden, steps, out, baseline, lab=None, events=()):
    from benchmarks import netlab
    from benchmarks import vs_torchft_faults as faults
    from yeto_patch.demo import cli as demo_cli
    from yeto_patch.demo.run import DemoError, run as demo_run
    # a kill: the demo SIGKILLs every process of the island once it logged the step and launches it again the
    # event's seconds later with --load: it comes back from its own latest checkpoint (written every
    # --yeto-save-interval steps, yeto-patch's sync state beside it) and the syncer; no other island is needed
    kills = [e for e in events if e.kind == "kill"]
    flags = demo_flags(a, hidden, steps, baseline)
    if kills:
        flags += ["--save-interval", str(a.yeto_save_interval)]
        flags += [f"--kill={e.who}:{e.step}:{e.seconds:g}" for e in kills]
    outages = [e for e in events if e.kind == "outage"]
    ids = island_ids(a.islands)
    if lab is not None:
        flags += ["--python", netlab.island_python(os.path.join(out + "-bin"), lab,
                                                   {iid: k for k, iid in enumerate(ids)})]
    o = demo_cli.parse(flags + ["--out", out, "--timeout", str(a.timeout)])
    buf = io.StringIO()
    t0 = time.time()
    before = [lab.counters(k) for k in range(lab.n)] if lab else None
    watch = faults.Watcher(outages, lambda k: last_step(os.path.join(out, f"island-{ids[k]}.jsonl")), lab)
    try:
        with contextlib.redirect_stdout(buf), watch:
            res = demo_run(o)
    except DemoError as err:
        raise SystemExit(f"yeto-patch side failed: {str(err).splitlines()[0]} (see {out})")
    finally:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "demo-output.txt"), "w") as f:
            f.write(buf.getvalue())
    access = lab_bytes(lab, before)
    killed = {e["island"]: e for e in res.get("kills") or ()}
    for ev in kills:   # (the demo's record of when it killed and relaunched the island)
        k = killed.get(ev.who) or {}
        ev.fired_t, ev.done_t = k.get("killed_t"), k.get("restarted_t")
    steps_by_island, per_sync, times, back = [], [], [], {}
    for k, iid in enumerate(ids):
        path = os.path.join(out, f"island-{iid}.jsonl")
        recs, t_life, resumed, started = [], 0.0, [], []
        for r in read_jsonl(path):   # (a relaunched island appends to its log: one "start" per process)
            if r.get("event") == "start":
                t_life = r["time"] - r["setup_s"]   # train_gpt's elapsed_s counts from its process's start
                started.append(r["time"])           # (set up: model and optimizer built, before any load)
            elif r.get("event") == "resume" and r.get("checkpoint"):
                resumed.append(r["step"])
            elif r.get("event") == "train":
                recs.append(dict(r, t=t_life + r["elapsed_s"], life=t_life))
        times.append([r["t"] for r in recs])
        steps_by_island.append([r["step_s"] for r in recs])
        if k in killed:   # the restarted one: from its relaunch to its first step done after it
            kr = killed[k]
            again = [r["t"] for r in recs if kr["restarted_t"] and r["life"] >= kr["restarted_t"]]
            back[k] = dict(killed_t=kr["killed_t"], restarted_t=kr["restarted_t"], killed_step=kr["killed_step"],
                           resumed_step=resumed[0] if resumed else None,
                           startup_s=(started[-1] - kr["restarted_t"]) if len(started) > 1 and kr["restarted_t"]
                           else None,
                           training_again_s=(again[0] - kr["restarted_t"]) if again else None)
            continue   # (its steps done twice would shift the step-time figures: survivors only, as torchft's)
        bpath = os.path.join(out, f"island-{iid}.boundaries.jsonl")
        # each scheduled push: its step, the install point tau steps later, and the step its answer was
        # installed at (the island's boundary records; a push answered by a later base has no record)
        installs = {r["step"]: r["step"] + (r.get("pull_lag") or 0)
                    for r in (read_jsonl(bpath) if os.path.exists(bpath) else ())
                    if r.get("event") == "boundary" and not r.get("final")}
        tau = min(a.yeto_tau, a.sync_every // 2)
        syncs = [(s, s + tau, installs.get(s, s)) for s in scheduled_syncs(len(recs), a.sync_every, a.fragments)]
        if recs and "opt_s" in recs[0]:
            per_sync.append(blocked_per_sync([r["opt_s"] for r in recs], syncs))
    link = res.get("link") or {}
    tape = []
    with contextlib.suppress(OSError):
        tape = read_jsonl(os.path.join(out, "syncer-tape.jsonl"))
    full = sum(1 for r in tape if r.get("ok") and len(r.get("responders", ())) == a.islands)
    alive = faults.survivors(events, a.islands)
    stops = [faults.longest_stop(times[k]) for k in alive]
    during = [faults.stop_during(times[k], events) for k in alive]
    return dict(loss=res.get("global_heldout_loss"), ddp=res.get("baseline_heldout_loss"),
                bytes=res.get("bytes_between"), bytes_up=link.get("up"), bytes_down=link.get("down"),
                access_bytes=access, full_syncs=full, syncs=res.get("merges"), params=res.get("params"),
                blocked=mean([blocked_per_step(s) for k, s in enumerate(steps_by_island) if k not in back]),
                blocked_sync=mean([x[0] for x in per_sync]),
                blocked_sync_median=mean([x[1] for x in per_sync]),
                median_step=mean([statistics.median(s) for k, s in enumerate(steps_by_island) if s and k not in back]),
                train_s=max((t[-1] - t[0] for t in times if t), default=None),
                longest_stop=max((x[0] for x in stops if x[0] is not None), default=None),
                stop_during={k: max(d.get(k, 0.0) for d in during) for k in ("outage", "kill")
                             if any(k in d for d in during)},
                final_wait=max((faults.final_wait(times[k]) or 0.0 for k in alive), default=None),
                goodput=faults.goodput_yeto(tape, sum(len(s) for s in steps_by_island), a.fragments),
                restarts=back, save_interval=a.yeto_save_interval if kills else None,
                events=[e.as_dict() for e in events],
                steps_done=[len(s) for s in steps_by_island], wall_s=time.time() - t0, flags=flags)


def lighthouse_port(proc, log_path, timeout_s=60):
    """The port the lighthouse bound (started on port 0), read from its log line 'Lighthouse listening on'."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with open(log_path, errors="replace") as f:
            m = re.search(r"Lighthouse listening on: \S+:(\d+)", f.read())
        if m:
            return int(m.group(1))
        if proc.poll() is not None:
            raise SystemExit(f"torchft side: the lighthouse exited ({proc.returncode}); see {log_path}")
        time.sleep(0.1)
    raise SystemExit(f"torchft side: the lighthouse did not report its port within {timeout_s}s; see {log_path}")


class _Replicas:
    """torchft's replica groups of one run: started (in their network namespaces with a lab), restarted after a
    kill event, waited for."""

    def __init__(self, a, out, flags, env, lport, lab, events):
        self.a, self.out, self.flags, self.env, self.lport, self.lab = a, out, flags, env, lport, lab
        self.kills = {e.who: e for e in events if e.kind == "kill"}
        self.procs, self.logs = [None] * a.islands, []
        self.release = os.path.join(out, "release")
        self.restarts = {}   # replica -> dict(killed_t, restarted_t)

    def start(self, k, die_at=0):
        host = self.lab.host_ip if self.lab else "127.0.0.1"
        me = self.lab.ip_of(k) if self.lab else "127.0.0.1"
        renv = dict(self.env, MASTER_ADDR=me, MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                    LOCAL_RANK="0", TORCHFT_LIGHTHOUSE=f"http://{host}:{self.lport}",
                    GLOO_SOCKET_IFNAME="eth0" if self.lab else "lo")
        log = open(os.path.join(self.out, f"replica-{k}.log"), "a")
        self.logs.append(log)
        argv = [sys.executable, REPLICA, "--replica", str(k), "--log", os.path.join(self.out, f"replica-{k}.jsonl"),
                "--result", os.path.join(self.out, f"replica-{k}.json"), "--release", self.release, *self.flags]
        if self.lab:
            argv = self.lab.wrap(k, argv + ["--hostname", me])
        if die_at:
            argv += ["--die-at-step", str(die_at)]
        self.procs[k] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=renv, cwd=ROOT)

    def start_all(self):
        for k in range(self.a.islands):
            for p in (f"replica-{k}.jsonl", f"replica-{k}.json", f"replica-{k}.log"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.out, p))
            self.start(k, self.kills[k].step if k in self.kills else 0)

    def wait_results(self, deadline):
        """Until every replica wrote its result; a replica killed by its event is started again after its
        seconds (its exit status 17 is the kill's)."""
        results = [os.path.join(self.out, f"replica-{k}.json") for k in range(self.a.islands)]
        while not all(map(os.path.exists, results)) and time.time() < deadline:
            for k, p in enumerate(self.procs):
                rc = p.poll()
                if rc is None or os.path.exists(results[k]):
                    continue
                ev = self.kills.get(k)
                if rc == 17 and ev is not None and ev.fired_t is None:
                    ev.fired_t = time.time()
                    time.sleep(ev.seconds)  # the others train on meanwhile (their own processes)
                    self.restarts[k] = dict(killed_t=ev.fired_t, restarted_t=time.time())
                    ev.done_t = time.time()
                    self.start(k)
                    continue
                raise SystemExit(f"torchft side: replica {k} exited with {rc} (see {self.out}/replica-{k}.log)")
            time.sleep(0.1)

    def finish(self, deadline):
        open(self.release, "w").close()
        for k, p in enumerate(self.procs):
            try:
                rc = p.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"torchft side: replica {k} did not finish within {self.a.timeout:.0f}s "
                                 f"(see {self.out}/replica-{k}.log)")
            if rc:
                raise SystemExit(f"torchft side: replica {k} exited with {rc} (see {self.out}/replica-{k}.log)")

    def close(self):
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()


def run_torchft(a, hidden, steps, out, lab=None, events=()):
    from benchmarks import vs_torchft_faults as faults
    os.makedirs(out, exist_ok=True)
    flags = [x for x in demo_flags(a, hidden, steps, baseline=False) if x != "--no-baseline"]
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, "release"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "TORCHFT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", RUST_BACKTRACE="1")
    t0 = time.time()
    before = [lab.counters(k) for k in range(lab.n)] if lab else None
    min_replicas = a.lighthouse_min_replicas or a.islands
    reps = None
    with SocketMeter() as meter:
        lh_log = open(os.path.join(out, "lighthouse.log"), "w")
        lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", str(min_replicas), *LIGHTHOUSE_FLAGS,
                                       "--bind", f"{lab.host_ip if lab else '127.0.0.1'}:0"],
                                      stdout=lh_log, stderr=subprocess.STDOUT, env=env)
        try:
            lport = lighthouse_port(lighthouse, os.path.join(out, "lighthouse.log"))
            reps = _Replicas(a, out, flags, env, lport, lab, events)
            reps.start_all()
            deadline = time.time() + a.timeout
            with faults.Watcher(events, lambda k: last_step(os.path.join(out, f"replica-{k}.jsonl")), lab):
                reps.wait_results(deadline)
            meter.sample()  # every replica is done and still holds its sockets: the final counts
            access = lab_bytes(lab, before)
            reps.finish(deadline)
        finally:
            if reps is not None:
                reps.close()
            if lighthouse.poll() is None:
                lighthouse.kill()
                lighthouse.wait()
            lh_log.close()
    res, per_sync, logs = [], [], []
    for k in range(a.islands):
        with open(os.path.join(out, f"replica-{k}.json")) as f:
            res.append(json.load(f))
        recs = read_jsonl(os.path.join(out, f"replica-{k}.jsonl"))
        logs.append(recs)
        if k not in reps.restarts:
            syncs = [(s,) for s in scheduled_syncs(len(res[-1]["opt_s"]), a.sync_every, a.fragments)]
            per_sync.append(blocked_per_sync(res[-1]["opt_s"], syncs))
    pids = [r["pid"] for r in res]
    with open(os.path.join(out, "sockets.json"), "w") as f:  # the evidence behind the byte count
        json.dump(dict(replica_pids=pids, lighthouse_pid=lighthouse.pid,
                       sockets=[dict(local=k[0], peer=k[1], **v) for k, v in meter.socks.items()]), f, indent=1)
    survivors = [k for k in range(a.islands) if k not in reps.restarts]   # for the step-time figures
    alive = faults.survivors(events, a.islands)
    stops = [faults.longest_stop([r["t"] for r in logs[k]]) for k in alive]
    during = [faults.stop_during([r["t"] for r in logs[k]], events) for k in alive]
    back = {}
    for k, r in reps.restarts.items():   # the restarted one: from its restart to its first step after healing
        healed = res[k].get("healed") or []
        after = [x["t"] for x in logs[k] if x["t"] > r["restarted_t"] and (not healed or x["t"] >= healed[0]["t"])]
        back[k] = dict(r, healed=healed, training_again_s=(after[0] - r["restarted_t"]) if after else None)
    return dict(loss=res[0]["heldout_loss"], loss_mean=mean([r["heldout_loss"] for r in res]),
                bytes=None if lab else meter.between(pids), bytes_peers=None if lab else meter.between(pids, True),
                access_bytes=access, syncs=res[0]["outer_steps"],
                full_syncs=res[0].get("full_syncs"), params=res[0]["params"],
                blocked=mean([blocked_per_step(res[k]["step_s"]) for k in survivors]), blocked_sync=mean([x[0] for x in per_sync]),
                blocked_sync_median=mean([x[1] for x in per_sync]),
                median_step=mean([statistics.median(res[k]["step_s"]) for k in survivors]),
                train_s=max(logs[k][-1]["t"] - logs[k][0]["t"] for k in survivors),
                longest_stop=max((x[0] for x in stops if x[0] is not None), default=None),
                stop_during={k: max(d.get(k, 0.0) for d in during) for k in ("outage", "kill")
                             if any(k in d for d in during)},
                final_wait=max((faults.final_wait([r["t"] for r in logs[k]]) or 0.0 for k in alive), default=None),
                goodput=faults.goodput_torchft(logs, a.fragments, a.sync_every), restarts=back,
                events=[e.as_dict() for e in events], min_replicas=min_replicas,
                steps_done=[len(r["step_s"]) for r in res], samples=meter.samples, wall_s=time.time() - t0)


def run_reference(a, hidden, steps, out):
    """benchmarks/diloco_reference.py (textbook Streaming DiLoCo in one process, fp32, exact averages) at the
    settings both sides share and torchft's defaults (tau 0): the algorithm's own loss at these tokens."""
    os.makedirs(out, exist_ok=True)
    flags = [x for x in demo_flags(a, hidden, steps, baseline=False) if x != "--no-baseline"]
    i = flags.index("--overlap-steps")
    flags[i + 1] = "0"
    path = os.path.join(out, "reference.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    with open(os.path.join(out, "reference-output.txt"), "w") as log:
        rc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "diloco_reference.py"), *flags,
                             "--runs", "diloco", "--json", path], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=env, timeout=a.timeout).returncode
    if rc:
        raise SystemExit(f"diloco_reference failed ({rc}); see {out}/reference-output.txt")
    with open(path) as f:
        return json.load(f)["diloco"]


# --- report -------------------------------------------------------------------------------------------------------

def _r(x, y, fmt=".3f"):
    return "n/a" if x is None or not y else format(x / y, fmt)


def _f(x, fmt=".4f"):
    return "n/a" if x is None else format(x, fmt)


def _ms(x):
    return _f(None if x is None else x * 1e3, '.2f')


def slope(rows, side):
    """(median blocked time per sync at the largest size - at the smallest) / (memcpy of a fragment there -
    here), as benchmarks/boundary_scaling.py computes its slope."""
    b0, b1 = rows[0][side].get("blocked_sync_median"), rows[-1][side].get("blocked_sync_median")
    m0, m1 = rows[0].get("memcpy"), rows[-1].get("memcpy")
    if None in (b0, b1, m0, m1) or m1 == m0:
        return None
    return (b1 - b0) / (m1 - m0)


def fault_rows(a, tag, y, t):
    """The slow link's and the failure schedule's rows (items 4 and 5)."""
    shaped = f"tbf {a.link_mbit:g} Mbit/s" if a.link_mbit else "not shaped"
    out = [f"| {tag}: bytes on the access links ({shaped}; a byte between two replicas crosses two) | {y['access_bytes']:,} | {t['access_bytes']:,} | {_r(t['access_bytes'], y['access_bytes'], '.2f')} |",
           f"| {tag}: training time, first to last step, s | {_f(y['train_s'], '.1f')} | {_f(t['train_s'], '.1f')} | "
           f"{_r(t['train_s'], y['train_s'], '.2f')} |",
           f"| {tag}: goodput (fragment-steps merged / computed) | {_f(y['goodput'], '.3f')} | "
           f"{_f(t['goodput'], '.3f')} | {_r(t['goodput'], y['goodput'], '.2f')} |",
           f"| {tag}: longest stop of a survivor (no event hit it), s | {_f(y['longest_stop'], '.2f')} | {_f(t['longest_stop'], '.2f')} "
           f"| {_r(t['longest_stop'], y['longest_stop'], '.2f')} |"]
    for kind, what in (("kill", "the kill until 30 s after the restart"), ("outage", "the outage until 30 s after")):
        yv, tv = (y.get("stop_during") or {}).get(kind), (t.get("stop_during") or {}).get(kind)
        if yv is not None or tv is not None:
            out.append(f"| {tag}: longest stop of a survivor, from {what}, s | {_during(y, kind, yv)} | "
                       f"{_during(t, kind, tv)} | {_r(tv, yv, '.2f')} |")
    out.append(f"| {tag}: a survivor's last step beyond its median step, s (yeto-patch: the final cut, which waits "
               f"for every island's last push) | {_f(y.get('final_wait'), '.2f')} | {_f(t.get('final_wait'), '.2f')} | "
               f"{_r(t.get('final_wait'), y.get('final_wait'), '.2f')} |")
    yr, tr = y.get("restarts") or {}, t.get("restarts") or {}
    for k in sorted(set(yr) | set(tr), key=int):
        ry, rt = yr.get(k), tr.get(k)
        r = rt or ry
        yv = "not run" if ry is None else (
            f"{_f(ry['training_again_s'], '.1f')} (of which start-up, to its model built: "
            f"{_f(ry.get('startup_s'), '.1f')}; from its checkpoint of step {ry['resumed_step']}, killed after "
            f"step {ry['killed_step']}: {_lost(ry)} steps trained again)")
        tv = "not run" if rt is None else (
            f"{_f(rt['training_again_s'], '.1f')} (healed from a live peer: {len(rt['healed'])})")
        out.append(f"| {tag}: participant {k} killed, started again {r['restarted_t'] - r['killed_t']:.0f} s later: "
                   f"training again after its start, s | {yv} | {tv} | "
                   f"{_r(rt and rt['training_again_s'], ry and ry['training_again_s'], '.2f')} |")
        out.append(f"| {tag}: what the restart needed | its own checkpoint (every {y.get('save_interval')} steps, "
                   f"with its sync state) and the syncer; no other island alive | a live peer replica (its "
                   f"state sent over the network); no checkpoint | |")
    return out


def _during(side, kind, v):
    """A survivor's longest stop in an event's window, or why there is none."""
    if v is not None:
        return _f(v, '.2f')
    fired = [e for e in side.get("events") or () if e["kind"] == kind and e.get("fired_t")]
    return "no survivor step in the window (done before it)" if fired else "not run"


def _lost(r):
    return "n/a" if r.get("resumed_step") is None or r.get("killed_step") is None else \
        r["killed_step"] - r["resumed_step"]


def report(a, rows, cmd):
    y, t = rows[0]["yeto"], rows[0]["torchft"]
    lines = [f"## vs_torchft: {a.islands} replicas/islands, H={a.sync_every}, {a.fragments} fragment(s), "
             f"{a.steps} steps x {a.batch} x {a.seq_length} tokens per replica, GPT {a.layers}x{a.hidden} fp32",
             f"yeto-patch: {a.yeto_push_dtype} pushes{' + error feedback' if a.yeto_error_feedback else ''}, "
             f"tau {min(a.yeto_tau, a.sync_every // 2)}, bases {a.yeto_base_wire}"
             f"{f', syncer --quorum {a.yeto_quorum}' if a.yeto_quorum else ''}; torchft: DiLoCo defaults (fp32 "
             f"allreduce, fragment_sync_delay 0, fragment_update_alpha 0); outer Nesterov lr {a.outer_lr} "
             f"momentum 0.9 both" + (f"; events {', '.join(a.events)}" if a.events else "")
             + (f"; lighthouse --min_replicas {a.lighthouse_min_replicas}" if a.lighthouse_min_replicas else "")
             + (f"; yeto-patch islands checkpoint every {a.yeto_save_interval} steps" if any(
                 e.startswith("kill:") for e in a.events) else ""),
             "", "| measure | yeto-patch | torchft | torchft / yeto-patch |", "|---|---|---|---|"]
    if y.get("ddp"):
        lines += [f"| held-out loss (DDP {y['ddp']:.4f}) | {_f(y['loss'])} | {_f(t['loss'])} "
                  f"(replica mean {_f(t['loss_mean'])}) | {_r(t['loss'], y['loss'], '.4f')} |",
                  f"| loss / DDP | {_r(y['loss'], y['ddp'], '.4f')} | {_r(t['loss'], y['ddp'], '.4f')} | |"]
        if rows[0].get("reference"):
            ref = rows[0]["reference"]
            lines += [f"| loss / textbook Streaming DiLoCo ({ref:.4f}, tau 0, fp32, exact) | {_r(y['loss'], ref, '.4f')} "
                      f"| {_r(t['loss'], ref, '.4f')} | |"]
    for r in rows:
        y, t = r["yeto"], r["torchft"]
        tag = f"GPT {a.layers}x{r['hidden']} ({y['params'] or t['params']:,} params, {r['steps']} steps)"
        lines += [f"| {tag}: syncs with every replica | {y['full_syncs']} of {y['syncs']} | "
                  f"{'n/a' if t['full_syncs'] is None else t['full_syncs']} of {t['syncs']} | |"]
        if t.get("bytes") is not None:
            yb, tb = (s["bytes"] / s["syncs"] if s["syncs"] else None for s in (y, t))
            lines += [f"| {tag}: bytes on the link in all | {y['bytes']:,} (up {y['bytes_up']:,}) | {t['bytes']:,} "
                      f"(between replicas {t['bytes_peers']:,}) | {_r(t['bytes'], y['bytes'], '.2f')} |",
                      f"| {tag}: bytes per sync | {_f(yb, ',.0f')} | {_f(tb, ',.0f')} | {_r(tb, yb, '.2f')} |"]
        if t.get("access_bytes") is not None:
            lines += fault_rows(a, tag, y, t)
        lines += [
                  f"| {tag}: median step ms | {_f(y['median_step'] * 1e3, '.1f')} | "
                  f"{_f(t['median_step'] * 1e3, '.1f')} | {_r(t['median_step'], y['median_step'], '.2f')} |",
                  f"| {tag}: blocked ms per step | {_f(y['blocked'] * 1e3, '.2f')} | {_f(t['blocked'] * 1e3, '.2f')} | "
                  f"{_r(t['blocked'], y['blocked'], '.2f')} |",
                  f"| {tag}: blocked ms per sync, mean (optimizer step above its median) | "
                  f"{_ms(y.get('blocked_sync'))} | {_ms(t.get('blocked_sync'))} | "
                  f"{_r(t.get('blocked_sync'), y.get('blocked_sync'), '.2f')} |",
                  f"| {tag}: blocked ms per sync, median; memcpy of a fragment {_f(r['memcpy'] and r['memcpy'] * 1e3, '.3f')}"
                  f" ms | {_ms(y.get('blocked_sync_median'))} | {_ms(t.get('blocked_sync_median'))} | "
                  f"{_r(t.get('blocked_sync_median'), y.get('blocked_sync_median'), '.2f')} |"]
    if len(rows) >= 2:
        sy, st = slope(rows, "yeto"), slope(rows, "torchft")
        lines += [f"| median blocked time per sync, slope against memcpy, GPT {a.layers}x{rows[0]['hidden']} -> "
                  f"{a.layers}x{rows[-1]['hidden']} | {_f(sy, '.1f')} x | {_f(st, '.1f')} x | {_r(st, sy, '.2f')} |"]
    lines += ["", "versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()), f"command: {cmd}"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--islands", type=int, default=2, help="replica groups (torchft) = islands (yeto-patch)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", "-H", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD lr (momentum 0.9), both sides")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--hidden2", type=int, default=256, help="the second model size (bytes and blocked time); 0: none")
    ap.add_argument("--steps2", type=int, default=0, help="steps at --hidden2 (default: --steps)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-seqs", type=int, default=128)
    ap.add_argument("--baseline-layout", default="dp2")
    ap.add_argument("--cache-dir", default=None, help="the demo's baseline cache")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per side and size")
    g = ap.add_argument_group("yeto-patch's DiLoCo settings (default: the demo's defaults)")
    g.add_argument("--yeto-push-dtype", default="int4", choices=("f32", "bf16", "int8", "int4", "int4-log"))
    g.add_argument("--yeto-error-feedback", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--yeto-tau", type=int, default=5)
    from yeto_patch.demo.cli import base_wire_type   # (the demo's check of a --base-wire value)
    g.add_argument("--yeto-base-wire", default="int4", type=base_wire_type, metavar="DTYPE",
                   help="the syncer's --base-wire")
    g.add_argument("--yeto-quorum", type=int, default=0, help="the syncer's --quorum K (0: its default, elastic "
                   "rounds; M: every round waits for every island, as torchft's quorum does)")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the DDP baseline (and with it the quality rows)")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip benchmarks/diloco_reference.py (textbook Streaming DiLoCo, tau 0) at the first size")
    g = ap.add_argument_group("the slow link and the failure schedule (issue #39, items 4 and 5; needs root)")
    g.add_argument("--link-mbit", type=float, default=0, help="every replica / island in a network namespace of "
                   "its own behind an access link shaped by tc tbf at this rate both ways (benchmarks/netlab.py); "
                   "0: loopback")
    g.add_argument("--event", action="append", default=[], metavar="KIND:K:STEP:SECONDS",
                   help="outage:K:STEP:S (participant K's link down S seconds at its step STEP; both sides) or "
                   "kill:K:STEP:S (participant K killed after STEP, started again S seconds later: torchft's "
                   "replica exits hard and heals from a live peer; yeto-patch's island is SIGKILLed and comes back "
                   "from its own latest checkpoint)")
    g.add_argument("--yeto-save-interval", type=int, default=25, help="with a kill: yeto-patch's islands write a "
                   "checkpoint every N steps (examples/train_gpt.py --save-interval), which the killed one "
                   "comes back from (torchft needs none)")
    g.add_argument("--faults-seed", type=int, default=None, help="a seeded schedule: one kill and one outage "
                   "in the middle half of the run (benchmarks/vs_torchft_faults.seeded_events)")
    g.add_argument("--lighthouse-min-replicas", type=int, default=0, help="the lighthouse's --min_replicas "
                   "(0: --islands, every replica in every sync; 1: torchft README's, survivors go on alone)")
    ap.add_argument("--smoke", action="store_true", help="both sides start and finish 2 syncs on a tiny model "
                    "(H 4, 1 fragment, 8 steps, GPT 1x32, no baseline, one size)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "vs_torchft"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    why = torchft_missing()
    if why:
        print(f"vs_torchft: {why}", file=sys.stderr)
        return 2
    if a.smoke:
        a.steps, a.sync_every, a.fragments, a.hidden, a.layers, a.eval_seqs = 8, 4, 1, 32, 1, 8
        a.seq_length, a.warmup = 32, 2
    a.eval_interval, a.base_wire = a.steps, a.yeto_base_wire  # convergence.demo_flags reads these
    sizes = [(a.hidden, a.steps, not a.smoke and a.baseline)]
    if not a.smoke and a.hidden2 > 0:
        sizes.append((a.hidden2, a.steps2 or a.steps, False))
    from benchmarks import vs_torchft_faults as faults
    events = faults.parse_events(a.event, a.islands)
    if a.faults_seed is not None:
        events += faults.seeded_events(a.faults_seed, a.islands, a.steps)
    a.events = [str(e) for e in events]
    if (events or a.link_mbit) and os.geteuid() != 0:
        print("vs_torchft: --link-mbit and --event need root (network namespaces, tc)", file=sys.stderr)
        return 2
    rows = []
    t0 = time.time()
    for hidden, steps, baseline in sizes:
        lab_ctx = contextlib.nullcontext()
        if a.link_mbit or events:
            from benchmarks.netlab import NetLab
            lab_ctx = NetLab(a.islands, rate_mbit=a.link_mbit or None)
        with lab_ctx as lab:
            print(f"[GPT {a.layers}x{hidden}, {steps} steps] yeto-patch ...", flush=True)
            y = run_yeto(a, hidden, steps, os.path.join(a.out, f"h{hidden}", "yeto"), baseline, lab,
                         [faults.Event(e.kind, e.who, e.step, e.seconds) for e in events])
            print(f"    {json.dumps({k: v for k, v in y.items() if k != 'flags'})}", flush=True)
            print(f"[GPT {a.layers}x{hidden}, {steps} steps] torchft ...", flush=True)
            t = run_torchft(a, hidden, steps, os.path.join(a.out, f"h{hidden}", "torchft"), lab,
                            [faults.Event(e.kind, e.who, e.step, e.seconds) for e in events])
        print(f"    {json.dumps(t)}", flush=True)
        params = y["params"] or t["params"]
        row = dict(hidden=hidden, steps=steps, yeto=y, torchft=t,
                   fragment_bytes=params * 4 // a.fragments if params else None)
        row["memcpy"] = memcpy_s(row["fragment_bytes"]) if params else None
        if baseline and a.reference:
            print(f"[GPT {a.layers}x{hidden}, {steps} steps] textbook Streaming DiLoCo (diloco_reference) ...",
                  flush=True)
            row["reference"] = run_reference(a, hidden, steps, os.path.join(a.out, f"h{hidden}", "reference"))
            print(f"    {row['reference']:.4f}", flush=True)
        rows.append(row)
    cmd = "python benchmarks/vs_torchft.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print()
    print(report(a, rows, cmd))
    print(f"\n{time.time() - t0:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, versions=versions(), command=cmd), f, indent=1, default=str)
    bad = [f"{side} at hidden {r['hidden']}: {s['syncs']} syncs" for r in rows for side, s in
           (("yeto-patch", r["yeto"]), ("torchft", r["torchft"])) if not s["syncs"] or s["syncs"] < 2]
    if bad:
        print("vs_torchft: fewer than 2 syncs: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
