"""benchmarks/boundary_scaling.py, a short setting (two tiny sizes, one round): the script runs the real island end
to end with the scripted second island, prints every size's table with the engine's stages (the install inside
the optimizer step among them) and its closing line. Its figures are for the full run, not checked here."""
import os
import re
import subprocess
import sys

import pytest

from tests.shim import procs as P


@pytest.mark.timeout(600)
def test_boundary_scaling_smoke(tmp_path):
    cmd = [sys.executable, os.path.join(P.ROOT, "benchmarks", "boundary_scaling.py"), "--sizes", "2x128,2x256",
           "--rounds", "1", "--sync-every", "8", "--tau", "3", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=P.ROOT, env=P.base_env(), capture_output=True, text=True, timeout=540)
    out = r.stdout
    assert r.returncode == 0, (out + r.stderr)[-4000:]
    assert out.count("### L=2 h=") == 2 and "| L=2 h=128 |" in out and "| L=2 h=256 |" in out, out
    assert "in_step (ms)" in out and "snapshot_wait (ms)" in out, out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"boundary_scaling: blocked-time slope -?[0-9.]+ x memcpy over 2 sizes, "
                        r"throughput ratio [0-9.]+", last), last
    assert all(os.path.exists(tmp_path / f"size{i}" / "hooks.json") for i in (0, 1))
