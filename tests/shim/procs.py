"""Test helpers: start a real syncer and islands (torchrun of an ordinary training script) as subprocesses with
only PYTHONPATH and YETO_* variables, wait for them with a deadline, and read the results."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from tests.ports import free_port  # noqa: F401  (the islands', syncers' and benchmarks' ports)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ISLAND_SCRIPT = os.path.join(ROOT, "tests", "shim", "scripts", "island_train.py")


def key_file(tmp_path, name="yeto.key", value="0123456789abcdef0123456789abcdef"):
    p = tmp_path / name
    p.write_text(value)
    os.chmod(p, 0o600)
    return str(p)


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=ROOT, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


TAG = "YETO_TEST_PROC_TAG"   # marks every process a Proc started, however deep (no YETO_* setting reads it)


class Proc:
    def __init__(self, name, args, env, log_path, cwd=ROOT):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "w")
        self.tag = f"{os.getpid()}-{id(self)}-{time.monotonic_ns()}"
        self.p = subprocess.Popen(args, env={**env, TAG: self.tag}, stdout=self.log, stderr=subprocess.STDOUT,
                                  cwd=cwd, start_new_session=True)

    def poll(self):
        return self.p.poll()

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self):
        """Stop the process and everything it started (torchrun puts its workers in sessions of their own)."""
        import psutil
        try:
            kids = psutil.Process(self.p.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)      # torchrun forwards it to its workers
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for k in kids + [self.p] + self._orphans():
            try:
                k.kill()
            except (psutil.Error, ProcessLookupError, OSError):
                pass
        self.p.wait(10)
        if not self.log.closed:
            self.log.close()


    def _orphans(self) -> list:
        """Processes this Proc started whose parent died first (e.g. a checkpoint writer of a SIGKILLed rank):
        re-parented to init, so not among the children; found by the tag they inherited."""
        import psutil
        found = []
        for q in psutil.process_iter():
            try:
                if q.pid != os.getpid() and q.environ().get(TAG) == self.tag:
                    found.append(q)
            except (psutil.Error, OSError):
                pass
        return found


def start_syncer(tmp_path, port, islands=2, fragments=2, key=None, extra=(), quorum=None, name="syncer",
                 files="syncer", elastic=False):
    """A syncer whose rounds wait for every island (quorum = islands: the fixed roster) unless told otherwise, as
    a test needs; `elastic`: no --quorum (the syncer's defaults). Its checkpoint is <files>.ckpt and its tape
    tape.jsonl (<files>.tape.jsonl when `files` is not "syncer")."""
    tape = "tape.jsonl" if files == "syncer" else f"{files}.tape.jsonl"
    roster = [] if elastic else ["--quorum", str(quorum or islands)]
    args = [sys.executable, "-m", "yeto_patch.syncer", "--listen", f"127.0.0.1:{port}", "--islands", str(islands),
            *roster, "--fragments", str(fragments),
            "--checkpoint", str(tmp_path / f"{files}.ckpt"), "--tape", str(tmp_path / tape), *extra]
    args += ["--key-file", key] if key else ["--insecure"]
    return Proc(name, args, base_env(), str(tmp_path / f"{name}.log"))


def start_island(tmp_path, name, port, layout_args, steps, env_extra, nproc=2, script=ISLAND_SCRIPT, attach=True):
    """torchrun of an ordinary training script; each rank's stdout/stderr also go to <out>/ranks/.../<rank>/.
    attach=False: the same job with no YETO_* variable at all (a plain run)."""
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--log-dir", str(out / "ranks"),
            "--redirects", "3", "--tee", "3", script, *layout_args, "--steps", str(steps), "--out", str(out)]
    syncer = port if isinstance(port, str) else f"127.0.0.1:{port}"   # (a string: the address list of shards)
    env = base_env(YETO_DILOCO_SYNCER=syncer, YETO_DILOCO_ISLAND_ID=name,
                   YETO_DILOCO_METRICS=str(out / "metrics.jsonl"), YETO_DILOCO_TOTAL_STEPS=steps,
                   **env_extra) if attach else base_env()
    return Proc(name, args, env, str(tmp_path / f"{name}.log"))


def wait_all(procs, timeout):
    """Wait until every process exits; kill everything at the deadline or when one fails. Returns rcs."""
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            rcs = [p.poll() for p in procs]
            if all(rc is not None for rc in rcs):
                return rcs
            if any(rc not in (None, 0) for rc in rcs):
                time.sleep(3)   # let the others report their side
                return [p.poll() for p in procs]
            time.sleep(0.2)
        return [p.poll() for p in procs]
    finally:
        for p in procs:
            p.kill()


def logs(procs) -> str:
    return "\n".join(f"===== {p.name} =====\n{p.text()[-6000:]}" for p in procs)


def rank_stderr(out_dir) -> dict:
    """{local rank: its stderr} from torchrun's per-rank log files."""
    out = {}
    for path in glob.glob(os.path.join(out_dir, "ranks", "*", "attempt_*", "*", "stderr.log")):
        rank = int(os.path.basename(os.path.dirname(path)))
        with open(path, errors="replace") as f:
            out[rank] = f.read()
    return out


def npz_parts(pattern, kind="master") -> dict:
    """{name: array} of one kind ("master" or "param") from the per-rank npz files matching `pattern`."""
    model = {}
    for path in sorted(glob.glob(pattern)):
        with np.load(path) as z:
            for k in z.files:
                if k.startswith(kind + "/"):
                    name = k[len(kind) + 1:]
                    assert name not in model, f"{name} dumped twice"
                    model[name] = z[k]
    return model


def island_model(out_dir, kind="master") -> dict:
    return npz_parts(os.path.join(out_dir, "model.rank*.npz"), kind)


def as_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even, as torch casts) -> float32."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).bfloat16().float().numpy()


def island_result(out_dir) -> dict:
    with open(os.path.join(out_dir, "result.json")) as f:
        return json.load(f)


def metrics(out_dir) -> list:
    path = os.path.join(out_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def syncer_model(ckpt_path) -> tuple:
    """({name: float32 array of its full shape}, {fragment: version}) from the syncer's final checkpoint, or from
    every shard's (a list of paths: the model assembled from the fragments each holds)."""
    from yeto_patch.syncer.model.checkpoint import read_checkpoint
    out, versions = {}, {}
    for path in ([ckpt_path] if isinstance(ckpt_path, str) else ckpt_path):
        meta, arrays = read_checkpoint(path)
        manifest = meta["manifest"]
        for fm, arr in zip(meta["fragments"], arrays):
            base, off = arr["base"], 0
            for i in meta["layout"][fm["index"]]:
                name, shape, _ = manifest[i]
                n = int(np.prod(shape))
                out[name] = base[off:off + n].reshape(shape)
                off += n
            versions[fm["index"]] = fm["version"]
    return out, versions
