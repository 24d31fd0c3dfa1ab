#!/usr/bin/env python
"""yeto-patch against torchft's DiLoCo: the same model, data, H, fragments, optimizers and tokens, in one run.

Needs the py312-peers environment (Python 3.12, torch 2.13.0, megatron-core 0.19.2, torchft 0.2.0 with its
torchft_lighthouse binary), which the default test install does not build:

    V=$(bash scripts/venv.sh py312-peers)
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py                 # 2 replicas, ~10 min on an idle 2-core CPU
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py --islands 4
    nice -n 10 $V/bin/python benchmarks/vs_torchft.py --smoke         # both sides start and finish 2 syncs

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
   torchft: the kernel's per-socket counters (ss -ti: bytes_sent/bytes_received of every TCP socket of the
   replicas and the lighthouse, sampled every 0.2 s), every byte that crossed between two different processes
   counted once (gloo allreduce, TCPStore, Manager and lighthouse gRPC, heartbeats). A sync = one fragment's outer
   step (torchft: Manager.current_step(); yeto-patch: the syncer's merges);
3. time the training thread is blocked at syncs, per step: per replica/island, the sum over steps 2..T-1 of
   (step time - the median step time), over T-2 (the start and the last step, where yeto-patch runs its final
   cut and torchft its last sync, are left out on both sides), at two model sizes (--hidden and --hidden2).
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
_BYTES = re.compile(r"\bbytes_(sent|received):(\d+)")


class SocketMeter:
    """Samples `ss -tinpH` every `every_s`: per TCP connection (local, peer) its owner pid and the largest
    bytes_sent / bytes_received seen. Counts what the kernel sent, not what anybody computed."""

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
            old["sent"] = max(old["sent"], vals.get("sent", 0))
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


def blocked_per_sync(opt_s, sync_steps):
    """Seconds the optimizer step (where both sides do their sync work: yeto-patch's hooks around it, torchft's
    DiLoCo post-hook) took above its median, summed over steps 2..T-1 and divided by the syncs this replica or
    island made in those steps (`sync_steps`: the steps, 1-based, at which it pushed / ran a fragment's outer
    step)."""
    inner = opt_s[1:-1]
    n = sum(1 for s in sync_steps if 2 <= s <= len(opt_s) - 1)
    if len(inner) < 3 or not n:
        return None
    med = statistics.median(inner)
    return sum(s - med for s in inner) / n


def memcpy_s(nbytes, repeat=21):
    """A plain memcpy (torch copy_) of `nbytes` of float32 on the host, median of `repeat` (as
    benchmarks/boundary_scaling.py measures its reference)."""
    import torch
    src = torch.rand(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    out = []
    for i in range(repeat + 1):
        t = time.perf_counter()
        dst.copy_(src)
        if i:
            out.append(time.perf_counter() - t)
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
    f = convergence.demo_flags(c, ns) + ["--fp32"]
    if a.yeto_quorum:  # the syncer's --quorum K (default: elastic rounds)
        f.append(f"--syncer-arg=--quorum={a.yeto_quorum}")
    return f + ([] if baseline else ["--no-baseline"])


def run_yeto(a, hidden, steps, out, baseline):
    from yeto_patch.demo import cli as demo_cli
    from yeto_patch.demo.run import DemoError, run as demo_run
    flags = demo_flags(a, hidden, steps, baseline)
    o = demo_cli.parse(flags + ["--out", out, "--timeout", str(a.timeout)])
    buf = io.StringIO()
    t0 = time.time()
    try:
        with contextlib.redirect_stdout(buf):
            res = demo_run(o)
    except DemoError as err:
        raise SystemExit(f"yeto-patch side failed: {str(err).splitlines()[0]} (see {out})")
    finally:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "demo-output.txt"), "w") as f:
            f.write(buf.getvalue())
    steps_by_island, per_sync = [], []
    for path in sorted(glob.glob(os.path.join(out, "island-*.jsonl"))):
        if path.endswith(".boundaries.jsonl"):
            continue
        recs = [r for r in read_jsonl(path) if r.get("event") == "train"]
        steps_by_island.append([r["step_s"] for r in recs])
        bpath = path[:-len(".jsonl")] + ".boundaries.jsonl"
        pushes = [r["step"] for r in (read_jsonl(bpath) if os.path.exists(bpath) else ())
                  if r.get("event") == "boundary" and not r.get("final")]
        if recs and "opt_s" in recs[0]:
            per_sync.append(blocked_per_sync([r["opt_s"] for r in recs], pushes))
    link = res.get("link") or {}
    full = 0  # the syncer's merges that had every island's push (its tape: one line per merge)
    with contextlib.suppress(OSError):
        with open(os.path.join(out, "syncer-tape.jsonl")) as f:
            tape = [json.loads(x) for x in f if x.strip()]
        full = sum(1 for r in tape if r.get("ok") and len(r.get("responders", ())) == a.islands)
    return dict(loss=res.get("global_heldout_loss"), ddp=res.get("baseline_heldout_loss"),
                bytes=res.get("bytes_between"), bytes_up=link.get("up"), bytes_down=link.get("down"), full_syncs=full, syncs=res.get("merges"), params=res.get("params"),
                blocked=mean([blocked_per_step(s) for s in steps_by_island]), blocked_sync=mean(per_sync),
                median_step=mean([statistics.median(s) for s in steps_by_island if s]),
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


def run_torchft(a, hidden, steps, out):
    os.makedirs(out, exist_ok=True)
    flags = [x for x in demo_flags(a, hidden, steps, baseline=False) if x != "--no-baseline"]
    release = os.path.join(out, "release")
    with contextlib.suppress(FileNotFoundError):
        os.remove(release)
    logs, procs = [], []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "TORCHFT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
               RUST_BACKTRACE="1")
    t0 = time.time()
    with SocketMeter() as meter:
        lh_log = open(os.path.join(out, "lighthouse.log"), "w")
        lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", str(a.islands), *LIGHTHOUSE_FLAGS,
                                       "--bind", "127.0.0.1:0"], stdout=lh_log, stderr=subprocess.STDOUT, env=env)
        try:
            lport = lighthouse_port(lighthouse, os.path.join(out, "lighthouse.log"))
            for k in range(a.islands):
                renv = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                            LOCAL_RANK="0", TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lport}")
                log = open(os.path.join(out, f"replica-{k}.log"), "w")
                logs.append(log)
                for p in (f"replica-{k}.jsonl", f"replica-{k}.json"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(out, p))
                procs.append(subprocess.Popen(
                    [sys.executable, REPLICA, "--replica", str(k), "--log", os.path.join(out, f"replica-{k}.jsonl"),
                     "--result", os.path.join(out, f"replica-{k}.json"), "--release", release, *flags],
                    stdout=log, stderr=subprocess.STDOUT, env=renv, cwd=ROOT))
            deadline = time.time() + a.timeout
            results = [os.path.join(out, f"replica-{k}.json") for k in range(a.islands)]
            while not all(map(os.path.exists, results)) and all(p.poll() is None for p in procs) \
                    and time.time() < deadline:
                time.sleep(0.1)
            meter.sample()  # every replica is done and still holds its sockets: the final counts
            open(release, "w").close()
            for k, p in enumerate(procs):
                try:
                    rc = p.wait(timeout=max(1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    raise SystemExit(f"torchft side: replica {k} did not finish within {a.timeout:.0f}s "
                                     f"(see {out}/replica-{k}.log)")
                if rc:
                    raise SystemExit(f"torchft side: replica {k} exited with {rc} (see {out}/replica-{k}.log)")
        finally:
            for p in procs + [lighthouse]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            lh_log.close()
            for f in logs:
                f.close()
    res, per_sync = [], []
    for k in range(a.islands):
        with open(os.path.join(out, f"replica-{k}.json")) as f:
            res.append(json.load(f))
        recs = read_jsonl(os.path.join(out, f"replica-{k}.jsonl"))
        syncs = [r["step"] for prev, r in zip([dict(outer=0)] + recs, recs) if r["outer"] > prev["outer"]]
        per_sync.append(blocked_per_sync(res[-1]["opt_s"], syncs))
    pids = [r["pid"] for r in res]
    with open(os.path.join(out, "sockets.json"), "w") as f:  # the evidence behind the byte count
        json.dump(dict(replica_pids=pids, lighthouse_pid=lighthouse.pid,
                       sockets=[dict(local=k[0], peer=k[1], **v) for k, v in meter.socks.items()]), f, indent=1)
    return dict(loss=res[0]["heldout_loss"], loss_mean=mean([r["heldout_loss"] for r in res]),
                bytes=meter.between(pids), bytes_peers=meter.between(pids, peers_only=True), syncs=res[0]["outer_steps"],
                full_syncs=res[0].get("full_syncs"), params=res[0]["params"],
                blocked=mean([blocked_per_step(r["step_s"]) for r in res]), blocked_sync=mean(per_sync),
                median_step=mean([statistics.median(r["step_s"]) for r in res]),
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
    """(blocked per sync at the largest size - at the smallest) / (memcpy of a fragment there - here), as
    benchmarks/boundary_scaling.py computes its slope."""
    b0, b1 = rows[0][side].get("blocked_sync"), rows[-1][side].get("blocked_sync")
    m0, m1 = rows[0].get("memcpy"), rows[-1].get("memcpy")
    if None in (b0, b1, m0, m1) or m1 == m0:
        return None
    return (b1 - b0) / (m1 - m0)


def report(a, rows, cmd):
    y, t = rows[0]["yeto"], rows[0]["torchft"]
    lines = [f"## vs_torchft: {a.islands} replicas/islands, H={a.sync_every}, {a.fragments} fragment(s), "
             f"{a.steps} steps x {a.batch} x {a.seq_length} tokens per replica, GPT {a.layers}x{a.hidden} fp32",
             f"yeto-patch: {a.yeto_push_dtype} pushes{' + error feedback' if a.yeto_error_feedback else ''}, "
             f"tau {min(a.yeto_tau, a.sync_every // 2)}, bases {a.yeto_base_wire}"
             f"{f', syncer --quorum {a.yeto_quorum}' if a.yeto_quorum else ''}; torchft: DiLoCo defaults (fp32 "
             f"allreduce, fragment_sync_delay 0, fragment_update_alpha 0); outer Nesterov lr {a.outer_lr} "
             f"momentum 0.9 both", "", "| measure | yeto-patch | torchft | torchft / yeto-patch |", "|---|---|---|---|"]
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
        yb, tb = (s["bytes"] / s["syncs"] if s["syncs"] else None for s in (y, t))
        lines += [f"| {tag}: syncs with every replica | {y['full_syncs']} of {y['syncs']} | "
                  f"{'n/a' if t['full_syncs'] is None else t['full_syncs']} of {t['syncs']} | |",
                  f"| {tag}: bytes on the link in all | {y['bytes']:,} (up {y['bytes_up']:,}) | {t['bytes']:,} "
                  f"(between replicas {t['bytes_peers']:,}) | {_r(t['bytes'], y['bytes'], '.2f')} |",
                  f"| {tag}: bytes per sync | {_f(yb, ',.0f')} | {_f(tb, ',.0f')} | {_r(tb, yb, '.2f')} |",
                  f"| {tag}: median step ms | {_f(y['median_step'] * 1e3, '.1f')} | "
                  f"{_f(t['median_step'] * 1e3, '.1f')} | {_r(t['median_step'], y['median_step'], '.2f')} |",
                  f"| {tag}: blocked ms per step | {_f(y['blocked'] * 1e3, '.2f')} | {_f(t['blocked'] * 1e3, '.2f')} | "
                  f"{_r(t['blocked'], y['blocked'], '.2f')} |",
                  f"| {tag}: blocked ms per sync (optimizer step above its median; memcpy of a fragment "
                  f"{_f(r['memcpy'] and r['memcpy'] * 1e3, '.3f')} ms) | {_ms(y.get('blocked_sync'))} | "
                  f"{_ms(t.get('blocked_sync'))} | {_r(t.get('blocked_sync'), y.get('blocked_sync'), '.2f')} |"]
    if len(rows) >= 2:
        sy, st = slope(rows, "yeto"), slope(rows, "torchft")
        lines += [f"| blocked time per sync, slope against memcpy, GPT {a.layers}x{rows[0]['hidden']} -> "
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
    g.add_argument("--yeto-base-wire", default="int4", choices=("f32", "bf16", "int8", "int4"))
    g.add_argument("--yeto-quorum", type=int, default=0, help="the syncer's --quorum K (0: its default, elastic "
                   "rounds; M: every round waits for every island, as torchft's quorum does)")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip benchmarks/diloco_reference.py (textbook Streaming DiLoCo, tau 0) at the first size")
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
    sizes = [(a.hidden, a.steps, not a.smoke)]
    if not a.smoke and a.hidden2 > 0:
        sizes.append((a.hidden2, a.steps2 or a.steps, False))
    rows = []
    t0 = time.time()
    for hidden, steps, baseline in sizes:
        print(f"[GPT {a.layers}x{hidden}, {steps} steps] yeto-patch ...", flush=True)
        y = run_yeto(a, hidden, steps, os.path.join(a.out, f"h{hidden}", "yeto"), baseline)
        print(f"    {json.dumps({k: v for k, v in y.items() if k != 'flags'})}", flush=True)
        print(f"[GPT {a.layers}x{hidden}, {steps} steps] torchft ...", flush=True)
        t = run_torchft(a, hidden, steps, os.path.join(a.out, f"h{hidden}", "torchft"))
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
