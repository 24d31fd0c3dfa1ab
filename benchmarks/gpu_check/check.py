"""GPU check of yeto-patch on real megatron-core (run through benchmarks/gpu_check/check.sh; --device cpu only to debug it).

Phase "tau0": a local syncer (2 islands, 2 fragments) and two single-rank islands (benchmarks/gpu_check/island.py, bf16,
DistributedOptimizer, NCCL on cuda:0) attached only through PYTHONPATH + YETO_* (int4 pushes, H small, tau 0),
plus a plain run of island A's job with no YETO_* variable (same seeds, same data) as the memory/time reference.
Phase "tauN": the same two islands with tau > 0 (blended installs).

Checks (each printed; any failure makes the exit status 1):
- every process exits 0 within its timeout; the plain run imported nothing of yeto-patch;
- loss fell on every island; the engine reported finished() at the last step;
- both islands' FP32 masters are bit-identical to each other and to the syncer's final model (checkpoint), and
  their bf16 params are the final model cast to bf16;
- boundary records: the expected number of int4 pushes, all installed, replace (tau 0) / blend (tau > 0), lag;
- CUDA only (torch.cuda allocator statistics, per process): inside optimizer.step() on steps with yeto-patch work
  (pushes, installs, final cut) the number and bytes of GPU allocations and the change of memory_allocated equal
  those of steps without, and the peak is not higher; the attached island A allocates exactly as the plain run at
  every step (step 1 with yeto's start: INIT read and base install included);
- time per step with and without yeto-patch work, and the plain run's (reported, not checked).
Writes summary.json, summary.txt, and the processes' logs / results to --out.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from tests.shim.procs import as_bf16, syncer_model  # noqa: E402  (the tests' readers of the same files)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None, help="scratch folder (default: a fresh one under /tmp)")
    ap.add_argument("--steps", type=int, default=None, help="default: 40 on cuda, 15 on cpu")
    ap.add_argument("--H", type=int, default=5)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--tau", type=int, default=2, help="tau of the second phase")
    ap.add_argument("--phases", default="tau0,tauN")
    ap.add_argument("--model", default=None, help="island.py model flags (default per device)")
    ap.add_argument("--phase-timeout", type=float, default=None, help="seconds per phase (default 110 cuda, 500 cpu)")
    ap.add_argument("--sync-timeout", type=float, default=None, help="YETO_DILOCO_TIMEOUT (default 60 cuda, 240 cpu)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain reference run")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    a.steps = a.steps or (40 if cuda else 15)
    a.model = a.model if a.model is not None else (
        "--layers 2 --hidden 256 --heads 4 --seq 128 --mbs 4 --micro 2" if cuda else
        "--layers 2 --hidden 64 --heads 4 --seq 16 --mbs 2 --micro 2")
    a.phase_timeout = a.phase_timeout or (110 if cuda else 500)
    a.sync_timeout = a.sync_timeout or (60 if cuda else 240)
    return a


# ----------------------------------------------------------------------------------------------- processes
def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    # repository root first (its sitecustomize.py is the bootstrap), then whatever the caller had (megatron)
    pp = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env.update(PYTHONPATH=os.pathsep.join(pp), PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Proc:
    def __init__(self, name, argv, env, log_path, timeout_s):
        self.name, self.log_path, self.timeout_s = name, log_path, timeout_s
        self.log = open(log_path, "wb")
        self.t0 = time.time()
        # `timeout` bounds every process on its own, whatever happens to this script
        argv = ["timeout", "-k", "5", str(int(timeout_s)), *argv]
        self.log.write(("$ " + " ".join(argv) + "\n").encode())
        self.log.flush()
        self.p = subprocess.Popen(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        self.wall = None

    def poll(self):
        rc = self.p.poll()
        if rc is not None and self.wall is None:
            self.wall = time.time() - self.t0
        return rc

    def text(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)   # leftovers of its session (the process group we created)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.poll()
        self.log.close()


def wait_all(procs, deadline):
    """rcs once all exited, or as soon as one failed (+3 s for the others to report), or at the deadline."""
    while time.time() < deadline:
        rcs = [p.poll() for p in procs]
        if all(rc is not None for rc in rcs):
            return rcs
        if any(rc not in (None, 0) for rc in rcs):
            time.sleep(3)
            return [p.poll() for p in procs]
        time.sleep(0.2)
    return [p.poll() for p in procs]


def start_syncer(a, work, key):
    args = [sys.executable, "-m", "yeto_patch.syncer", "--listen", "127.0.0.1:0", "--islands", "2", "--quorum", "2",
            "--fragments", str(a.fragments), "--key-file", key, "--checkpoint", os.path.join(work, "syncer.ckpt"),
            "--tape", os.path.join(work, "tape.jsonl"), "--round-timeout", str(a.sync_timeout),
            "--io-timeout", "30", "--final-ack-timeout", "30", "--merge-threads", "2"]
    p = Proc("syncer", args, clean_env(), os.path.join(work, "syncer.log"), a.phase_timeout + 30)
    deadline = time.time() + 60
    while time.time() < deadline:
        for line in p.text().splitlines():
            if line.startswith("yeto-syncer listening on "):
                return p, int(line.rsplit(":", 1)[1])
        if p.poll() is not None:
            break
        time.sleep(0.1)
    p.stop()
    raise RuntimeError(f"the syncer did not report its port:\n{p.text()[-3000:]}")


def start_island(a, work, name, data_seed, port=None, key=None, tau=0, barrier=None):
    out = os.path.join(work, name)
    os.makedirs(out, exist_ok=True)
    argv = [sys.executable, os.path.join(HERE, "island.py"), "--device", a.device, "--steps", str(a.steps),
            "--data-seed", str(data_seed), "--out", out, *a.model.split(),
            "--dist-timeout", str(int(a.sync_timeout) + 30)]
    if barrier:
        argv += ["--start-barrier", barrier, "--barrier-count", "2", "--barrier-timeout", str(int(a.phase_timeout))]
    env = dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=free_port())
    if port is not None:
        env.update(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID=name,
                   YETO_DILOCO_SYNC_EVERY=a.H, YETO_DILOCO_PUSH_DTYPE="int4", YETO_DILOCO_OVERLAP_STEPS=tau,
                   YETO_DILOCO_MERGE_ALPHA=0.5, YETO_DILOCO_TOTAL_STEPS=a.steps, YETO_DILOCO_CHUNK_BYTES="256K",
                   YETO_DILOCO_TIMEOUT=int(a.sync_timeout), YETO_DILOCO_METRICS=os.path.join(out, "metrics.jsonl"))
    return Proc(name, argv, clean_env(**env), os.path.join(work, f"{name}.log"), a.phase_timeout)


# ----------------------------------------------------------------------------------------------- readers
def load_json(path):
    with open(path) as f:
        return json.load(f)


def load_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def island_model(out, kind):
    with np.load(os.path.join(out, "model.npz")) as z:
        return {k[len(kind) + 1:]: z[k] for k in z.files if k.startswith(kind + "/")}


def same_bits(x, y):
    return x.shape == y.shape and x.dtype == y.dtype and np.ascontiguousarray(x).tobytes() == \
        np.ascontiguousarray(y).tobytes()


def due(step, H, P):
    from yeto_patch.island.boundary.schedule import due_fragments
    return due_fragments(step, H, P)


def sync_steps(recs, steps):
    """1-based steps on which yeto-patch did work: start (1), pushes, installs, the final cut."""
    s = {1, steps}
    for r in recs:
        if r.get("event") == "boundary":
            s.add(int(r["step"]))
            if r.get("pull_lag") is not None:
                s.add(int(r["step"]) + int(r["pull_lag"]))
        elif r.get("event") in ("install", "final"):
            s.add(int(r["step"]))
    return s


def med(xs):
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------------------------- checks
class Checks:
    def __init__(self):
        self.items = []

    def __call__(self, name, ok, detail=""):
        ok = bool(ok)
        self.items.append(dict(check=name, ok=ok, detail=str(detail)))
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + str(detail) if detail != '' else ''}", flush=True)
        return ok


def run_phase(a, work, key, phase, tau, C, summary):
    print(f"== phase {phase}: tau={tau}, H={a.H}, {a.fragments} fragments, {a.steps} steps, int4 pushes", flush=True)
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    syncer, port = start_syncer(a, work, key)
    barrier = os.path.join(work, "barrier")
    procs = [syncer,
             start_island(a, work, "A", 1, port, key, tau, barrier),
             start_island(a, work, "B", 2, port, key, tau, barrier)]
    with_plain = phase == "tau0" and not a.no_plain
    if with_plain:
        procs.append(start_island(a, work, "plain", 1))
    try:
        rcs = wait_all(procs, time.time() + a.phase_timeout)
    finally:
        for p in procs:
            p.stop()
    ph = dict(tau=tau, wall_s=round(time.time() - t0, 1),
              processes={p.name: dict(rc=p.p.returncode, wall_s=None if p.wall is None else round(p.wall, 1))
                         for p in procs})
    summary["phases"][phase] = ph
    ok = C(f"{phase}: every process exited 0", all(rc == 0 for rc in rcs),
           {p.name: p.p.returncode for p in procs})
    if not ok:
        for p in procs:
            if p.p.returncode != 0:
                print(f"----- {p.name} (rc {p.p.returncode}, log {p.log_path}) tail -----\n{p.text()[-4000:]}",
                      flush=True)
        return
    res = {n: load_json(os.path.join(work, n, "result.json")) for n in ["A", "B"] + (["plain"] if with_plain else [])}
    recs = {n: load_jsonl(os.path.join(work, n, "metrics.jsonl")) for n in ("A", "B")}
    ph["islands"] = {}

    # -- loss
    for n, r in res.items():
        L = r["losses"]
        first, last = statistics.fmean(L[:5]), statistics.fmean(L[-5:])
        C(f"{phase}/{n}: loss fell", r["eval_after"] < r["eval_before"] - 0.3 and last < first,
          f"eval {r['eval_before']:.4f} -> {r['eval_after']:.4f}, train (first 5 / last 5) {first:.4f} -> {last:.4f}")
    for n in ("A", "B"):
        C(f"{phase}/{n}: yeto-patch attached and finished at the last step",
          res[n]["engine_finished"] is True and res[n]["finished"].count(True) == 1,
          f"finished flags true at steps {[i + 1 for i, x in enumerate(res[n]['finished']) if x]}")
    if with_plain:
        C(f"{phase}/plain: plain run stayed free of yeto-patch", res["plain"]["yeto_loaded"] == [],
          res["plain"]["yeto_loaded"][:5])

    # -- models
    final, versions = syncer_model(os.path.join(work, "syncer.ckpt"))
    C(f"{phase}: every fragment merged every round", all(v >= a.steps // a.H for v in versions.values()),
      f"syncer fragment versions {versions}")
    masters = {n: island_model(os.path.join(work, n), "master") for n in ("A", "B")}
    params = {n: island_model(os.path.join(work, n), "param") for n in ("A", "B")}
    for n in ("A", "B"):
        names_ok = sorted(masters[n]) == sorted(final)
        bad_m = [k for k in final if k in masters[n] and not same_bits(masters[n][k], final[k])]
        bad_p = [k for k in final if k in params[n] and not same_bits(params[n][k], as_bf16(final[k]))]
        C(f"{phase}/{n}: FP32 masters bit-identical to the syncer's final model",
          names_ok and not bad_m, f"{len(final)} tensors, {sum(v.size for v in final.values())} values; names "
                                  f"{'match' if names_ok else sorted(set(masters[n]) ^ set(final))[:4]}; "
                                  f"differing {bad_m[:4]}")
        C(f"{phase}/{n}: bf16 params = final model cast to bf16", names_ok and not bad_p, f"differing {bad_p[:4]}")
    C(f"{phase}: islands A and B bit-identical", sorted(masters["A"]) == sorted(masters["B"]) and all(
        same_bits(masters["A"][k], masters["B"][k]) for k in masters["A"]))

    # -- boundary records
    P = a.fragments
    expect_regular = sum(len(due(s, a.H, P)) for s in range(1, a.steps))
    for n in ("A", "B"):
        bounds = [r for r in recs[n] if r["event"] == "boundary"]
        regular = [r for r in bounds if not r["final"]]
        finals = [r for r in bounds if r["final"]]
        lag = [r.get("pull_lag") for r in regular]
        modes = sorted({r.get("mode") for r in regular})
        ok = (len(regular) == expect_regular and len(finals) == P
              and all(r["codec"] == "int4" and r["installed"] and r["bytes"] > 0 for r in bounds)
              and all(r["mode"] == "replace" for r in finals)
              and all(r["mode"] == ("blend" if tau else "replace") for r in regular)
              and all(lag_ is not None and 0 <= lag_ <= tau for lag_ in lag))
        C(f"{phase}/{n}: boundary records", ok,
          f"{len(regular)} regular pushes (expected {expect_regular}) + {len(finals)} final, modes {modes}, "
          f"pull lags {sorted(set(lag))}, {sum(r['bytes'] for r in bounds)} bytes pushed")
        ms = {k: round(statistics.fmean([r.get(k) or 0.0 for r in regular]), 2) if regular else None
              for k in ("gather_ms", "encode_ms", "install_ms", "wait_ms", "send_ms")}
        ph["islands"][n] = dict(boundary_ms_mean=ms, pushes=len(regular), final_pushes=len(finals),
                                bytes_pushed=sum(r["bytes"] for r in bounds))

    # -- time per step
    for n, r in res.items():
        ss = sync_steps(recs.get(n, []), a.steps) if n != "plain" else set()
        st = r["step_s"]
        with_b = [st[i] for i in range(1, a.steps) if (i + 1) in ss]
        without = [st[i] for i in range(1, a.steps) if (i + 1) not in ss]
        t = dict(step1_s=round(st[0], 4), median_without_sync_s=med(without), median_with_sync_s=med(with_b),
                 max_with_sync_s=max(with_b) if with_b else None, sync_steps=sorted(ss), train_s=r["train_s"],
                 setup_s=round(r["setup_s"], 2))
        ph["islands"].setdefault(n, {}).update(time=t, eval_before=r["eval_before"], eval_after=r["eval_after"],
                                               device=r["device_name"], torch=r["torch"],
                                               megatron_core=r["megatron_core"], params=r["params"])
        print(f"  time {phase}/{n}: step 1 {st[0] * 1e3:.1f} ms; median without yeto work "
              f"{(t['median_without_sync_s'] or 0) * 1e3:.2f} ms, with {(t['median_with_sync_s'] or 0) * 1e3:.2f} "
              f"ms (max {(t['max_with_sync_s'] or 0) * 1e3:.2f} ms) over {len(with_b)} steps with yeto work",
              flush=True)

    # -- CUDA memory
    if a.device != "cuda":
        print("  (CPU run: CUDA memory checks skipped)", flush=True)
        return
    out = memory_checks(a.steps, phase, res, {n: sync_steps(recs[n], a.steps) for n in ("A", "B")}, with_plain, C)
    if "plain_vs_A_diffs" in out:
        ph["plain_vs_A_memory_diffs"] = out.pop("plain_vs_A_diffs")
    for n, m in out.items():
        ph["islands"].setdefault(n, {})["memory"] = m


def memory_checks(steps, phase, res, sync, with_plain, C):
    """CUDA allocator figures of island.py (per step: [start, before optimizer.step, end] of memory_allocated and
    of the cumulative allocation count / bytes; peaks of fwd/bwd and of optimizer.step). `sync`: {island: 1-based
    steps with yeto-patch work}. Step 1 (optimizer state creation, yeto's start) is compared only with the plain
    run, which does the same GPU work without yeto-patch."""
    out = {}
    for n in ("A", "B"):
        m, ss = res[n]["memory"], sync[n]
        alloc, cnt, byt = m["alloc"], m["n_alloc"], m["bytes_alloc"]
        opt = {i + 1: dict(count=cnt[i][2] - cnt[i][1], bytes=byt[i][2] - byt[i][1], kept=alloc[i][2] - alloc[i][1],
                           peak=m["peak_opt"][i]) for i in range(steps)}
        with_y = [s for s in range(2, steps + 1) if s in ss]
        without = [s for s in range(2, steps + 1) if s not in ss]
        ref = {k: sorted({opt[s][k] for s in without}) for k in ("count", "bytes", "kept", "peak")}
        bad = [(s, {k: opt[s][k] for k in ("count", "bytes", "kept") if opt[s][k] not in ref[k]})
               for s in with_y]
        bad = [b for b in bad if b[1]]
        C(f"{phase}/{n}: optimizer.step() with yeto work allocates on the GPU exactly what a step without does",
          with_y and without and not bad,
          f"steps without yeto work: {ref['count']} allocations, {ref['bytes']} bytes, memory_allocated change "
          f"{ref['kept']} B; {len(with_y)} steps with yeto work{': differing ' + str(bad[:4]) if bad else ' equal'}")
        sy = max(opt[s]["peak"] for s in with_y) if with_y else None
        no = max(opt[s]["peak"] for s in without) if without else None
        C(f"{phase}/{n}: peak memory_allocated in optimizer.step() with yeto work <= without",
          sy is not None and no is not None and sy <= no,
          f"max_memory_allocated with yeto work {sy} B, without {no} B, step 1 (start) {opt[1]['peak']} B; "
          f"fwd/bwd peak {max(m['peak_fwd_bwd'])} B")
        ends = [alloc[i][2] for i in range(steps)]
        out[n] = dict(alloc_after_step1=ends[0], alloc_after_later_steps=sorted(set(ends[1:]))[:6],
                      opt_step_allocations_without_yeto=ref["count"], opt_step_alloc_bytes_without_yeto=ref["bytes"],
                      peak_opt_with_yeto=sy, peak_opt_without_yeto=no, peak_opt_step1=opt[1]["peak"],
                      peak_fwd_bwd_max=max(m["peak_fwd_bwd"]), reserved_end_max=max(m["reserved_end"]))
        print(f"  memory {phase}/{n}: allocated after step 1 {ends[0]} B, after later steps "
              f"{sorted(set(ends[1:]))[:4]} B", flush=True)
    if with_plain:
        A, Pl = res["A"]["memory"], res["plain"]["memory"]
        diffs = {}
        for k in ("alloc", "n_alloc", "bytes_alloc"):
            # per-phase figures: [fwd/bwd, optimizer.step] increments (counts and bytes are cumulative)
            f = (lambda v: [v[1], v[2]]) if k == "alloc" else (lambda v: [v[1] - v[0], v[2] - v[1]])
            diffs[k] = [(i + 1, f(A[k][i]), f(Pl[k][i])) for i in range(steps) if f(A[k][i]) != f(Pl[k][i])]
        for k in ("peak_fwd_bwd", "peak_opt"):
            diffs[k] = [(i + 1, A[k][i], Pl[k][i]) for i in range(steps) if A[k][i] != Pl[k][i]]
        C(f"{phase}: attached island A allocates on the GPU exactly as the plain run, step by step",
          not any(diffs.values()),
          {k: v[:3] for k, v in diffs.items() if v} or
          f"all {steps} steps equal (step 1 optimizer.step: {A['n_alloc'][0][2] - A['n_alloc'][0][1]} allocations, "
          f"peak {A['peak_opt'][0]} B, in both)")
        out["plain_vs_A_diffs"] = {k: v[:10] for k, v in diffs.items()}
    return out


def main():
    a = parse()
    os.makedirs(a.out, exist_ok=True)
    work_root = a.work or os.path.join("/tmp", f"yeto-gpu-check-{os.getpid()}")
    if os.path.exists(work_root):
        shutil.rmtree(work_root)
    os.makedirs(work_root)
    key = os.path.join(work_root, "yeto.key")
    with open(key, "w") as f:
        f.write("0123456789abcdef0123456789abcdef")
    os.chmod(key, 0o600)
    C = Checks()
    summary = dict(device=a.device, steps=a.steps, H=a.H, fragments=a.fragments, tau=a.tau, model=a.model,
                   phases={})
    t0 = time.time()
    for phase in [p for p in a.phases.split(",") if p]:
        tau = 0 if phase == "tau0" else a.tau
        try:
            run_phase(a, os.path.join(work_root, phase), key, phase, tau, C, summary)
        except Exception as e:  # noqa: BLE001 - a check that crashed is a failed check
            import traceback
            traceback.print_exc()
            C(f"{phase}: check script error", False, f"{type(e).__name__}: {e}")
        # keep logs, results and records (small), not the models
        dst = os.path.join(a.out, phase)
        os.makedirs(dst, exist_ok=True)
        for dp, _dn, fns in os.walk(os.path.join(work_root, phase)):
            for fn in fns:
                if fn.endswith((".log", ".json", ".jsonl")):
                    rel = os.path.relpath(os.path.join(dp, fn), os.path.join(work_root, phase))
                    os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
                    shutil.copy(os.path.join(dp, fn), os.path.join(dst, rel))
    summary["wall_s"] = round(time.time() - t0, 1)
    summary["checks"] = C.items
    summary["passed"] = all(c["ok"] for c in C.items) and bool(C.items)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [f"yeto-patch GPU check ({a.device}): {'PASSED' if summary['passed'] else 'FAILED'} in "
             f"{summary['wall_s']} s; {a.steps} steps, H={a.H}, {a.fragments} fragments, int4, tau 0 and {a.tau}"]
    lines += [f"[{'PASS' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}" for c in C.items]
    for ph, d in summary["phases"].items():
        for n, isl in d.get("islands", {}).items():
            t = isl.get("time", {})
            lines.append(f"{ph}/{n}: time/step without yeto work {fmt_ms(t.get('median_without_sync_s'))}, "
                         f"with {fmt_ms(t.get('median_with_sync_s'))} (max {fmt_ms(t.get('max_with_sync_s'))}); "
                         f"boundary ms {isl.get('boundary_ms_mean')}; memory {isl.get('memory')}")
    text = "\n".join(lines)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print("\n===== summary =====\n" + text, flush=True)
    shutil.rmtree(work_root, ignore_errors=True)
    sys.exit(0 if summary["passed"] else 1)


def fmt_ms(s):
    return "n/a" if s is None else f"{s * 1e3:.2f} ms"


if __name__ == "__main__":
    main()
