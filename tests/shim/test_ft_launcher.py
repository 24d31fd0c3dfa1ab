"""An island under NVIDIA's fault-tolerance launcher: ``ft_launcher`` (nvidia-resiliency-ext 0.7.0) runs Megatron-LM's
own loop on CPU (tests/shim/scripts/pretrain_gpt_cpu.py, TP2, gloo) with ``--enable-ft-package``, a real syncer
behind a relay that goes dark (a syncer outage) for DARK_S seconds, more than twice the FT ``step`` section's
timeout STEP_S.

- with yeto-patch's hook of Megatron-LM's FT integration (yeto_patch/hooks/mlm_ft.py): the island waits inside
  ``step`` sections, for the syncer at its start (``--ft-num-warmup-iters 0``: the first iteration is a ``step``
  too) and for the answer to its push at the tau bound during an outage, survives both and finishes, in one
  cycle (no restart);
- the control, the same hook removed (``--no-ft-keepalive``): the rank monitor reports the ``step`` section open
  past its timeout at the outage's wait and ``ft_launcher`` restarts the workers in-job; the restarted island
  rejoins the run (a new incarnation at the syncer) and finishes once the syncer is back.

Needs the py312-ft venv (``bash scripts/venv.sh py312-ft``; scripts/nvrx-wheel.sh says why the wheel is renamed).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time

import pytest

from tests.shim import mlm_islands as M
from tests.shim import procs as P

STEP_S = 4.0     # the FT `step` section's timeout
DARK_S = 10.0    # each outage of the syncer (> 2 x STEP_S)
ITERS = 16


def _ft_venv():
    r = subprocess.run(["bash", os.path.join(P.ROOT, "scripts", "venv.sh"), "py312-ft", "--if-built"],
                       capture_output=True, text=True)
    path = r.stdout.strip()
    return path if r.returncode == 0 and os.path.exists(os.path.join(path, "bin", "ft_launcher")) else None


FT_VENV = _ft_venv()
pytestmark = pytest.mark.skipif(
    FT_VENV is None, reason="nvidia-resiliency-ext 0.7.0 (ft_launcher) is not installed: `bash scripts/venv.sh "
    "py312-ft` builds its venv (scripts/nvrx-wheel.sh fetches the manylinux_2_39 wheel under a 2_31 name)")


class DarkRelay:
    """A TCP relay to the syncer that can go dark: then it drops every connection and closes each new one at once
    (the island sees its syncer gone), until ``light()``."""

    def __init__(self, target_port: int, dark: bool = False):
        self.target = ("127.0.0.1", target_port)
        self.lock = threading.Lock()
        self.dark = dark
        self.first_attempt = None    # monotonic time of the first connection attempt
        self.refused = 0
        self.conns = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            with self.lock:
                if self.first_attempt is None:
                    self.first_attempt = time.monotonic()
                if self.dark:
                    self.refused += 1
                    a.close()
                    continue
            try:
                b = socket.create_connection(self.target, timeout=10)
            except OSError:
                a.close()
                continue
            with self.lock:
                self.conns += [a, b]
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a), daemon=True).start()

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

    def go_dark(self):
        with self.lock:
            self.dark = True
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def light(self):
        with self.lock:
            self.dark = False

    def close(self):
        self.srv.close()
        self.go_dark()


def _until(cond, timeout, procs, what):
    t_end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > t_end or any(p.poll() is not None for p in procs):
            raise AssertionError(f"never saw {what}\n" + P.logs(procs))
        time.sleep(0.2)


def _run(tmp_path, relay_dark_at_start: bool, keepalive: bool):
    """One ft_launcher island and its syncer behind a DarkRelay. Returns (ft_launcher rc, island log, syncer log,
    the outages as (start, end) monotonic times)."""
    port = P.free_port()
    syncer = P.start_syncer(tmp_path, port, islands=1, fragments=1)
    relay = DarkRelay(port, dark=relay_dark_at_start)
    out = tmp_path / "island"
    out.mkdir()
    cmd = [os.path.join(FT_VENV, "bin", "ft_launcher"), "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{P.free_port()}",
           "--max-restarts", "0" if keepalive else "1",
           "--ft-rank-section-timeouts", f"setup:600,step:{STEP_S:g},checkpointing:600",
           "--ft-rank-out-of-section-timeout", "600", "--ft-workload-check-interval", "1",
           M.SCRIPT, *M.LAYOUTS["tp2"], *M.mlm_args(100, ITERS),
           "--enable-ft-package", "--ft-num-warmup-iters", "0",
           "--save", str(out / "ckpt"), "--save-interval", "1000", "--ckpt-format", "torch",   # (a 10 s torch_dist save)
           *([] if keepalive else ["--no-ft-keepalive"])]
    env = P.base_env(YETO_DILOCO_SYNCER=f"127.0.0.1:{relay.port}", YETO_DILOCO_INSECURE=1,
                     YETO_DILOCO_ISLAND_ID="ft-a", YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_OVERLAP_STEPS=1,
                     YETO_DILOCO_TIMEOUT=120)
    island = P.Proc("ft-island", cmd, env, str(tmp_path / "ft-island.log"), cwd=str(out))
    procs = [island, syncer]
    outages = []
    try:
        if relay_dark_at_start:   # the start's wait: the syncer is away when the island first dials
            _until(lambda: relay.first_attempt is not None, 180, procs, "the island's first connection attempt")
            t0 = relay.first_attempt
            while time.monotonic() < t0 + DARK_S and island.poll() is None:
                time.sleep(0.1)
            relay.light()
            outages.append((t0, time.monotonic()))
        # an outage while the island trains: it waits at its tau bound (tau = 1) for the answer to its push
        _until(lambda: "merged fragment 0 -> v2" in syncer.text(), 180, procs, "the syncer's second merge")
        relay.go_dark()
        t0 = time.monotonic()
        if keepalive:
            while time.monotonic() < t0 + DARK_S and island.poll() is None:
                time.sleep(0.1)
        else:   # until the rank monitor took the waiting island for a hung one (the workers restart)
            _until(lambda: "has been open for" in island.text(), 120, procs, "the rank monitor's timeout")
        relay.light()
        outages.append((t0, time.monotonic()))
        rcs = P.wait_all(procs, timeout=240)
    finally:
        relay.close()
        for p in procs:
            p.kill()
    return rcs, island.text(), syncer.text(), outages


def _incarnations(syncer_log):
    return set(re.findall(r"island ft-a joined \(incarnation (\d+)\)", syncer_log))


def test_island_survives_waits_longer_than_the_step_timeout(tmp_path):
    rcs, log, slog, outages = _run(tmp_path, relay_dark_at_start=True, keepalive=True)
    assert rcs == [0, 0], (rcs, log[-6000:], slog[-3000:])
    assert "NVIDIA FT is on" in log and f"step={STEP_S:.2f}" in log, log[-6000:]
    assert "has been open for" not in log and "will restart worker group" not in log, log[-6000:]
    assert len(_incarnations(slog)) == 1, slog        # one cycle: never restarted
    assert all(b - a >= DARK_S for a, b in outages) and len(outages) == 2, outages
    assert "reconnected to the syncer" in log, log[-6000:]   # the outage reached the island
    # both waits were inside iterations (every iteration is a `step` section: no warm-up), each > 2 x the timeout:
    # the first (the start's) and one after the second merge (Megatron's figure for iteration 2 still averages in
    # the first, so it does not count)
    took = {int(i): float(ms) for i, ms in re.findall(
        r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)", log)}
    assert took.get(1, 0) > 2000 * STEP_S and any(ms > 2000 * STEP_S for i, ms in took.items() if i >= 3), took
    assert "final cut acknowledged by ['ft-a']" in slog, slog[-3000:]


def test_without_the_hook_the_waiting_island_is_restarted_and_rejoins(tmp_path):
    rcs, log, slog, outages = _run(tmp_path, relay_dark_at_start=False, keepalive=False)
    assert re.search(r"Section 'step' has been open for [\d.]+ seconds\. Timeout is 4\.00 seconds", log), log[-6000:]
    assert "NVIDIA FT is on" not in log and "will restart worker group" in log, log[-6000:]
    assert rcs == [0, 0], (rcs, log[-6000:], slog[-3000:])
    assert len(_incarnations(slog)) == 2, slog        # the in-job restart rejoined the run as a new incarnation
    assert "final cut acknowledged by ['ft-a']" in slog, slog[-3000:]
