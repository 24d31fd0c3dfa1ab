"""How the training thread's time at a DiLoCo boundary grows with the model, against a memcpy of the rank's own shard.

    python benchmarks/boundary_scaling.py            # 3 sizes, ~5M / ~23M / ~109M parameters (20x; ~4 min,
                                                     # ~12 GB; 8x1536, ~239M, is killed for memory on 24 GB)
    python benchmarks/boundary_scaling.py --quick    # the two smallest (4.4x apart), about a minute
    python benchmarks/boundary_scaling.py --sizes 2x128,2x256 --rounds 1   # a smoke run (LxH: layers x hidden)

Each size is a 4-rank island (TP2 x DP2, bf16 GPTModel, DistributedOptimizer, real megatron-core) in 4 spawned
gloo processes (tests/mcore/pool.py), attached to a syncer running in this process (islands=2) through the
ordinary hooks (YETO_* settings, the product's engine). A second, scripted island (a wire-level SyncerClient in a
thread of this process) answers every round with a zero delta, so rounds complete as they would with two islands.
Per size, on the same model and in the same processes:
1. plain steps (no yeto-patch), 2. the attached job (start, `--rounds` x H steps of boundaries, final cut),
3. plain steps again (the plain rate is the mean of 1 and 3, which brackets drift on a shared machine),
4. a plain memcpy (torch copy_) of each fragment's own-shard bytes on every rank.

Figures, per boundary (the final cut and the start are left out):
- blocked ms: the time the training thread spent inside the engine's optimizer-step hooks (before the step, at
  the install point inside it, after it) from the push step to the step that installed its answer, minus that
  many quiet steps' hook time (the slowest rank per step);
- own-shard bytes: the FP32 master elements of the fragment in the rank's DistributedOptimizer shard (the part
  a zero-stall boundary copies); memcpy ms: a copy of those bytes on that rank (slowest rank), and the ratio;
- the stage times the engine writes to its JSONL (gather, encode, send, wait, install: whatever *_ms fields the
  boundary records carry, so a new engine's stages show up too), medians;
- peak extra RSS per rank over the attached job (against the end of the plain warm-up);
- throughput ratio: attached steps/s over plain steps/s (steps 2..T-1 of the attached job: no start, no final cut).
The last line is
`boundary_scaling: blocked-time slope X.XX x memcpy over N sizes, throughput ratio Y.YYY`, with
slope = (blocked(largest) - blocked(smallest)) / (memcpy(largest) - memcpy(smallest)) of the median blocked time
and the mean memcpy time per size, and the mean throughput ratio over the sizes.

`--device cuda`: the ranks build the model on the accelerator (megatron-core's own CUDA path, gloo still carries
the collectives: NCCL is not required, all 4 ranks share device 0) and the memcpy is device-to-host into pinned
memory, as a zero-stall snapshot would be. Untested so far (written on a machine without a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SIZES = "4x256,6x512,8x1024"      # layers x hidden; vocab 8192, ffn 4h: ~5M, ~23M, ~109M parameters (20x)
VOCAB = 8192
ISLAND_ID = "bench-island"


# ============================================================================== on every rank of the island
class _RssPeak:
    """Peak extra RSS of this process over a span: the kernel's high-water mark (VmHWM), reset at the start through
    /proc/self/clear_refs, so nothing polls beside the steps (a polling thread would itself slow them); where that
    reset is not allowed, a thread samples RSS every 50 ms."""

    def __init__(self):
        import psutil
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self.t = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
            self.t = threading.Thread(target=self._run, daemon=True)
            self.t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.05)

    def stop(self) -> int:
        if self.hwm:
            with open("/proc/self/status") as f:
                kb = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
            return max(kb * 1024, self.proc.memory_info().rss) - self.base
        self._stop.set()
        self.t.join(5)
        return max(self.peak, self.proc.memory_info().rss) - self.base


class _TimedEngine:
    """Wraps the product's engine: stamps every call of its optimizer-step hooks (the training thread's boundary
    work: before the step, at the install point inside it, after it) with the system-wide monotonic clock, so
    the benchmark process can line the ranks up; on rank 0 writes `signal` (the wire manifest) once the engine
    has started, so the scripted island joins after this island (which INITs the run)."""

    def __init__(self, inner, rank, signal, manifest):
        self._inner, self._rank, self._signal, self._manifest = inner, rank, signal, manifest
        self.times = {}          # step (after the update) -> [[enter_s, exit_s] per hook call, in call order]
        self.start_ms = 0.0
        self._calls = []

    def __getattr__(self, name):  # finished, started, close, set_resume, ... come from the engine
        return getattr(self._inner, name)

    def _timed(self, fn, *args, **kwargs):
        t = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._calls.append([t, time.monotonic()])

    def before_optimizer_step(self, optimizer=None):
        started = getattr(self._inner, "started", True)
        self._calls = []
        self._timed(self._inner.before_optimizer_step, optimizer)
        if not started:
            t0, t1 = self._calls.pop()
            self.start_ms = (t1 - t0) * 1000
            if self._rank == 0 and self._signal:
                tmp = self._signal + ".tmp"
                with open(tmp, "w") as f:
                    json.dump([[n, list(s), d] for n, s, d in self._manifest], f)
                os.replace(tmp, self._signal)

    def before_param_copy(self, optimizer):
        """Inside the optimizer step (the engine's install point, before Megatron casts masters to params)."""
        self._timed(self._inner.before_param_copy, optimizer)

    def on_optimizer_step(self, update_successful=True, tokens=None):
        try:
            self._timed(self._inner.on_optimizer_step, update_successful=update_successful, tokens=tokens)
        finally:
            step = int(getattr(self._inner, "step", len(self.times) + 1))
            self.times[step] = self._calls
            self._calls = []


def _own_shard_bytes(ctx, comm, fragments):
    """Per fragment: bytes of FP32 masters in this rank's optimizer shard; and the manifest and layout used."""
    from yeto_patch.island import build_manifest
    from yeto_patch.island.masters.refs import find_masters
    from yeto_patch.syncer.model.layout import partition
    man = build_manifest(ctx["model"], comm=comm)
    wire = man.wire_manifest()
    layout = partition(wire, fragments)
    frag_of = {e: f for f, idx in enumerate(layout) for e in idx}
    masters = find_masters(ctx["optimizer"])
    own = [0] * fragments
    for lp in man.local:
        m = masters.get(id(lp.param))
        if m is not None:
            own[frag_of[lp.entry]] += (m.end - m.start) * 4
    return own, wire, layout


def _memcpy_ms(nbytes, device, repeat=5):
    import torch
    n = max(1, nbytes // 4)
    if device == "cuda":
        src = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
        dst = torch.empty(n, dtype=torch.float32, pin_memory=True)
    else:
        src = torch.rand(n, dtype=torch.float32)
        dst = torch.empty(n, dtype=torch.float32)
    out = []
    for i in range(repeat + 1):
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            out.append((time.perf_counter() - t) * 1000)
    return statistics.median(out)


def _data_on_device(ctx):
    """--device cuda: the harness's tensors (positions, loss mask, loss report) on the device, and its batches
    made on the host (a CPU generator) then moved there."""
    import torch
    torch.set_default_device("cuda")
    data = ctx["data"]
    make = data.step_batches

    def on_device(step):
        with torch.device("cpu"):
            batches = make(step)
        return [{k: v.cuda() for k, v in b.items()} for b in batches]
    data.step_batches = on_device


def _timed_steps(ctx, n):
    from tests.mcore import harness
    out = []
    for _ in range(n):
        t = time.perf_counter()
        harness.train_steps(ctx, 1)
        out.append(time.perf_counter() - t)
    return out


def _attached(ctx, env, wrap, steps):
    """Run `steps` optimizer steps with the hooks installed and the engine wrapped; undo everything after."""
    from yeto_patch import config, hooks
    from yeto_patch.hooks import _runtime
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    config.reset()
    holder = []

    def factory(settings, **facts):
        eng = wrap(_runtime._default_factory(settings, **facts))
        holder.append(eng)
        return eng
    _runtime.set_engine_factory(factory)
    hooks.install()
    try:
        step_s = _timed_steps(ctx, steps)
    finally:
        hooks.uninstall()
        _runtime.set_engine_factory(None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        config.reset()
    return step_s, holder[0]


def rank_worker(cfg_kwargs: dict, job: dict) -> dict:
    """One size on every rank: plain steps, the attached job, plain steps, memcpy of the own shards."""
    import torch
    import torch.distributed as dist
    from tests.mcore import harness
    from yeto_patch.island import IslandComm
    rank = dist.get_rank()
    if job["device"] == "cuda":
        torch.cuda.set_device(0)
    ctx = harness.build(harness.RunCfg(**cfg_kwargs))
    if job["device"] == "cuda":
        _data_on_device(ctx)
    n_params = sum(p.numel() for c in ctx["model"] for p in c.parameters())
    comm = IslandComm(timeout_s=job["timeout"])
    own, wire, layout = _own_shard_bytes(ctx, comm, job["fragments"])
    _timed_steps(ctx, job["warm"])
    half = job["plain"] // 2
    plain = _timed_steps(ctx, half)
    comm.barrier()
    mon = _RssPeak()
    step_s, eng = _attached(ctx, job["env"], lambda e: _TimedEngine(e, rank, job["signal"], wire), job["steps"])
    rss = mon.stop()
    finished = bool(eng.finished)
    plain += _timed_steps(ctx, job["plain"] - half)
    comm.barrier()
    memcpy = [_memcpy_ms(b, job["device"]) for b in own]
    return dict(rank=rank, plain_s=plain, attached_s=step_s, hooks=eng.times, start_ms=eng.start_ms,
                own_bytes=own, memcpy_ms=memcpy, rss_extra=rss, finished=finished, layout=layout,
                local_params=n_params)


# ============================================================================== the scripted second island
class ScriptedIsland(threading.Thread):
    """A second island on the wire: joins once the real island started, answers each fragment's round with a
    zero int4 delta against the newest base (pushes[f] times, the last one final), then its final cut."""

    def __init__(self, addr, signal, pushes, last_step, sync_every, timeout):
        super().__init__(name="scripted-island", daemon=True)
        self.addr, self.signal, self.pushes, self.last_step = addr, signal, pushes, last_step
        self.H, self.timeout = sync_every, timeout
        self.error = None
        self.layout = None

    def run(self):
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e

    def _body(self, numel):
        import numpy as np
        from yeto_patch.island.boundary.push_encoder import PushEncoder
        enc = PushEncoder("int4", 256, numel, piece_elems=1 << 20)
        z = np.zeros(1 << 20, dtype=np.float32)
        left = numel
        while left > 0:
            n = min(left, z.size)
            enc.feed(z[:n])
            left -= n
        return enc.finish()

    def _run(self):
        from yeto_patch.wire.client import SyncerClient
        deadline = time.monotonic() + 4 * self.timeout     # pool start-up, model build and plain steps first
        while not os.path.exists(self.signal):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the island did not start within {4 * self.timeout:.0f}s")
            time.sleep(0.1)
        deadline = time.monotonic() + self.timeout
        with open(self.signal) as f:
            manifest = [(n, tuple(s), d) for n, s, d in json.load(f)]
        c = SyncerClient(self.addr, None, "scripted-island", manifest, insecure=True, timeout=self.timeout,
                         connect_retries=3)
        w = c.connect()
        self.layout = [list(x) for x in w.layout]
        bodies = {f: self._body(w.numels[f]) for f in range(w.fragments)}
        cur = {f: b.version for f, b in c.wait_ready(self.timeout).items()}
        done = {f: 0 for f in range(w.fragments)}
        step = 0

        def push(f):
            nonlocal step
            step += 1
            done[f] += 1
            c.push(f, base_version=cur[f], local_step=min(step, self.last_step), steps=self.H, tokens=0,
                   codec="int4", block=256, body=bodies[f], final=done[f] == self.pushes[f])
        for f in range(w.fragments):
            push(f)
        while any(done[f] < self.pushes[f] for f in done):
            if time.monotonic() > deadline + 3 * self.timeout:
                raise TimeoutError(f"scripted island: rounds did not complete (pushes {done} of {self.pushes})")
            c.wait_event(0.5)
            for b in c.poll():
                f = b.fragment
                if b.version > cur[f]:
                    cur[f] = b.version
                    if done[f] < self.pushes[f]:
                        push(f)
        c.finish(last_step=self.last_step, timeout=self.timeout)
        c.close()


# ============================================================================== the benchmark process
def _parse_sizes(text):
    out = []
    for part in text.split(","):
        layers, _, hidden = part.strip().lower().partition("x")
        out.append((int(layers), int(hidden)))
    return out


def _boundaries(records, total):
    return [r for r in records if r.get("event") == "boundary" and not r.get("final") and r.get("installed")
            and int(r["step"]) + int(r.get("pull_lag", 0)) < total]


def _step_costs(per_rank):
    """Per step, in ms: (critical, slowest). critical: for each hook call, from the moment the LAST rank entered
    it to the moment the last rank left it, summed over the step's calls: what the hooks add to the island's step
    (every rank meets the others at Megatron's next collective anyway, so a rank that arrived early and waits in
    a hook for a slower one loses nothing to the hook). slowest: the largest per-rank sum of time inside the
    hooks, waiting for slower ranks included (on an oversubscribed machine that is mostly scheduling skew)."""
    out = {}
    for s in per_rank[0]["hooks"]:
        calls = [r["hooks"].get(s, []) for r in per_rank]
        n = min(len(c) for c in calls)
        crit = sum(max(c[k][1] for c in calls) - max(c[k][0] for c in calls) for k in range(n)) * 1000
        slow = max(sum(b - a for a, b in c) for c in calls) * 1000
        out[int(s)] = (max(crit, 0.0), slow)
    return out


def _analyse(per_rank, records, total, fragments):
    cost = _step_costs(per_rank)
    bnds = _boundaries(records, total)
    busy = set()
    for b in bnds:
        busy.update(range(int(b["step"]), int(b["step"]) + int(b.get("pull_lag", 0)) + 1))
    quiet = [v for s, v in cost.items() if s not in busy and 1 < s < total]
    q = [statistics.median(x[i] for x in quiet) if quiet else 0.0 for i in (0, 1)]
    rows = []
    for b in bnds:
        s0, lag, f = int(b["step"]), int(b.get("pull_lag", 0)), int(b["fragment"])
        span = range(s0, s0 + lag + 1)
        blocked, slowest = (sum(cost.get(s, (0.0, 0.0))[i] for s in span) - (lag + 1) * q[i] for i in (0, 1))
        own = max(r["own_bytes"][f] for r in per_rank)
        mc = max(r["memcpy_ms"][f] for r in per_rank)
        stages = {k[:-3]: float(v) for k, v in b.items() if k.endswith("_ms") and isinstance(v, (int, float))}
        rows.append(dict(step=s0, fragment=f, lag=lag, blocked=blocked, slowest=slowest, own=own, memcpy=mc,
                         stages=stages))
    r0 = per_rank[0]
    plain = statistics.mean(r0["plain_s"])
    att = statistics.mean(r0["attached_s"][1:-1])
    return dict(rows=rows, quiet_ms=q[0], plain_s=plain, attached_s=att, ratio=plain / att,
                rss=[r["rss_extra"] for r in per_rank], start_ms=max(r["start_ms"] for r in per_rank),
                final_ms=cost.get(total, (0.0, 0.0))[1],
                params=sum(r["local_params"] for r in per_rank) / 2)   # TP2 x DP2: each TP half held twice


def _print_size(label, a, fragments):
    rows = a["rows"]
    print(f"\n### {label}: {a['params'] / 1e6:.1f} M parameters, {len(rows)} boundaries "
          f"(start {a['start_ms'] / 1000:.1f} s, final cut {a['final_ms'] / 1000:.1f} s, quiet step hooks "
          f"{a['quiet_ms']:.2f} ms)\n")
    stage_keys = sorted({k for r in rows for k in r["stages"]})
    print("| step | fragment | lag | blocked (ms) | slowest rank (ms) | own shard (MB) | memcpy (ms) | "
          "blocked / memcpy | " + " | ".join(f"{k} (ms)" for k in stage_keys) + " |")
    print("|---" * (8 + len(stage_keys)) + "|")
    for r in rows:
        st = " | ".join(f"{r['stages'].get(k, 0.0):.1f}" for k in stage_keys)
        print(f"| {r['step']} | {r['fragment']} | {r['lag']} | {r['blocked']:.1f} | {r['slowest']:.1f} | "
              f"{r['own'] / 1e6:.2f} | {r['memcpy']:.2f} | {r['blocked'] / max(r['memcpy'], 1e-6):.1f} | {st} |")
    bl = [r["blocked"] for r in rows]
    print(f"\nblocked per boundary: median {statistics.median(bl):.1f} ms, max {max(bl):.1f} ms (slowest rank, "
          f"waits for slower ranks included: median {statistics.median(r['slowest'] for r in rows):.1f} ms); "
          f"own-shard memcpy mean {statistics.mean(r['memcpy'] for r in rows):.2f} ms; peak extra RSS per rank "
          + " / ".join(f"{x / 2**20:.0f}" for x in a["rss"]) + " MiB; "
          f"step {a['plain_s'] * 1000:.0f} ms plain, {a['attached_s'] * 1000:.0f} ms attached -> throughput ratio "
          f"{a['ratio']:.3f}")


def run_size(pool, layers, hidden, a, workdir, idx):
    from yeto_patch.island.boundary.schedule import due_fragments
    from yeto_patch.syncer.rounds.settings import RoundSettings
    from yeto_patch.syncer.net.server import ServerConfig, SyncerServer
    total = a.rounds * a.sync_every + 3
    pushes = {f: 1 for f in range(a.fragments)}            # + the final push
    for s in range(1, total):
        for f in due_fragments(s, a.sync_every, a.fragments):
            pushes[f] += 1
    d = os.path.join(workdir, f"size{idx}")
    os.makedirs(d, exist_ok=True)
    signal, metrics = os.path.join(d, "started.json"), os.path.join(d, "boundaries.jsonl")
    cfg = ServerConfig(listen="127.0.0.1:0", islands=2, fragments=a.fragments, key=None, insecure=True,
                       rounds=RoundSettings(islands=2, quorum=2, grace_s=0.2, timeout_s=a.timeout,
                                            lease_s=a.timeout),
                       merge_threads=1, initializer=ISLAND_ID)   # (the scripted island joins after the real one started)
    server = SyncerServer(cfg)
    host, port = server.start()
    addr = f"{host}:{port}"
    env = dict(YETO_DILOCO_SYNCER=addr, YETO_DILOCO_INSECURE=1, YETO_DILOCO_ISLAND_ID=ISLAND_ID,
               YETO_DILOCO_SYNC_EVERY=a.sync_every, YETO_DILOCO_OVERLAP_STEPS=a.tau,
               YETO_DILOCO_PUSH_DTYPE=a.push, YETO_DILOCO_TOTAL_STEPS=total, YETO_DILOCO_TIMEOUT=a.timeout,
               YETO_DILOCO_METRICS=metrics, YETO_DILOCO_LOG_LEVEL="WARNING")
    job = dict(device=a.device, timeout=a.timeout, fragments=a.fragments, warm=a.warm, plain=a.plain,
               steps=total, env=env, signal=signal)
    cfg_kwargs = dict(tp=2, bf16=True, dist_opt=True, layers=layers, hidden=hidden, ffn=4 * hidden, heads=8,
                      vocab=VOCAB, vocab_divisible_by=128, seq=a.seq, mbs=1, micro=1)
    other = ScriptedIsland(addr, signal, pushes, total, a.sync_every, a.timeout)
    other.start()
    try:
        per_rank = pool.run("boundary_scaling:rank_worker", cfg_kwargs, job, timeout=a.timeout * 4)
        other.join(a.timeout)
    finally:
        server.stop()
        if other.error is not None:
            print(f"scripted island: {type(other.error).__name__}: {other.error}", file=sys.stderr, flush=True)
    if other.error is not None:
        raise SystemExit(f"size {layers}x{hidden}: the scripted island failed: {other.error!r}")
    if not all(r["finished"] for r in per_rank):
        raise SystemExit(f"size {layers}x{hidden}: the island did not reach its final cut")
    if other.layout is not None and other.layout != per_rank[0]["layout"]:
        raise SystemExit("the syncer's fragment layout differs from the one the own-shard bytes were counted on")
    with open(metrics) as f:
        records = [json.loads(x) for x in f if x.strip()]
    with open(os.path.join(d, "hooks.json"), "w") as f:   # every rank's hook stamps and step times, for a closer look
        json.dump([{k: r[k] for k in ("hooks", "plain_s", "attached_s")} for r in per_rank], f)
    return _analyse(per_rank, records, total, a.fragments)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the two smallest sizes")
    ap.add_argument("--sizes", default=SIZES, help="comma-separated LAYERSxHIDDEN, smallest first")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=16, help="H")
    ap.add_argument("--tau", type=int, default=6, help="overlap steps: the background's time for a round (the push "
                    "is handed over a step after its boundary, its base staged a step after it arrived); below "
                    "H / fragments, so that no install shares its step with the next fragment's push (each "
                    "boundary's span then holds its own snapshot and install only)")
    ap.add_argument("--rounds", type=int, default=2, help="boundaries per fragment (H steps each)")
    ap.add_argument("--push", default="int4")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--warm", type=int, default=2, help="plain warm-up steps (not timed)")
    ap.add_argument("--plain", type=int, default=6, help="timed plain steps (half before, half after)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="keep the JSONL per size here (default: a temporary directory)")
    a = ap.parse_args(argv)
    sizes = _parse_sizes(a.sizes)
    if a.quick:
        sizes = sizes[:2]
    if len(sizes) < 2:
        ap.error("need at least two sizes for a slope")
    if not 0 < a.tau < a.sync_every:
        ap.error("--tau must be in [1, H)")
    if a.device == "cuda":
        os.environ["MCORE_CPU_SKIP"] = "mode,cuda_api,rng"   # the pool's workers inherit it: real CUDA calls
    workdir = a.out or tempfile.mkdtemp(prefix="yeto-scaling-")
    from tests.mcore.pool import WorkerPool
    t0 = time.time()
    print(f"# boundary_scaling: 4-rank {a.device.upper()} island TP2 x DP2, bf16 GPTModel (vocab {VOCAB}, ffn 4h, "
          f"seq {a.seq}, 1 micro-batch per DP rank), DistributedOptimizer; H={a.sync_every}, {a.fragments} "
          f"fragments, tau={a.tau}, push {a.push}, {a.rounds} boundaries per fragment; local syncer + a scripted "
          f"second island", flush=True)
    results = []
    with WorkerPool(4, start_timeout=900, task_timeout=a.timeout * 4, pg_timeout_s=a.timeout) as pool:
        for i, (layers, hidden) in enumerate(sizes):
            label = f"L={layers} h={hidden}"
            res = run_size(pool, layers, hidden, a, workdir, i)
            results.append((label, res))
            _print_size(label, res, a.fragments)
            sys.stdout.flush()
    print("\n| size | parameters (M) | blocked median (ms) | blocked max (ms) | slowest rank median (ms) | "
          "own shard (MB) | memcpy (ms) | ratio | peak extra RSS max (MiB) | throughput ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summ = []
    for label, r in results:
        bl = [x["blocked"] for x in r["rows"]]
        mc = statistics.mean(x["memcpy"] for x in r["rows"])
        own = statistics.mean(x["own"] for x in r["rows"])
        med, slow = statistics.median(bl), statistics.median(x["slowest"] for x in r["rows"])
        summ.append((med, mc, r["ratio"], slow))
        print(f"| {label} | {r['params'] / 1e6:.1f} | {med:.1f} | {max(bl):.1f} | {slow:.1f} | {own / 1e6:.2f} | "
              f"{mc:.2f} | {med / max(mc, 1e-6):.1f} | {max(r['rss']) / 2**20:.0f} | {r['ratio']:.3f} |")
    (b0, m0, _, w0), (b1, m1, _, w1) = summ[0], summ[-1]
    slope = (b1 - b0) / (m1 - m0) if m1 != m0 else float("nan")
    ratio = statistics.mean(x[2] for x in summ)
    print(f"\n(total {time.time() - t0:.0f} s; JSONL in {workdir}); the slowest rank's slope, waits for slower "
          f"ranks included: {(w1 - w0) / (m1 - m0) if m1 != m0 else float('nan'):.2f} x memcpy")
    print(f"boundary_scaling: blocked-time slope {slope:.2f} x memcpy over {len(summ)} sizes, "
          f"throughput ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
