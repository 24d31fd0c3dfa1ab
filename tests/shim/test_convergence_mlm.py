"""benchmarks/convergence_mlm.py in its smoke setting: Megatron-LM's pretrain() on indexed byte-level text (the
benchmark's data files, Megatron's GPTDataset, NullTokenizer with vocabulary 257), one island alone and the two
islands (TP2 + PP2) at the defaults, 20 iterations; the table and the summary line are printed, the losses are
Megatron's own final evaluations on the held-out file and fell from the start (ln 257 = 5.55)."""
import importlib.util
import re
import subprocess
import sys

import pytest

from tests.shim import procs as P

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron-core < 0.17 ships no megatron.training")


@pytest.mark.timeout(900)
def test_convergence_mlm_smoke(tmp_path):
    cmd = [sys.executable, "benchmarks/convergence_mlm.py", "--only", "lone-tp2,defaults", "--iters", "20",
           "--sync-every", "5", "--eval-seqs", "16", "--out", str(tmp_path), "--timeout", "600"]
    r = subprocess.run(cmd, cwd=P.ROOT, env=P.base_env(), capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = dict(re.findall(r"^\| (lone-tp2|defaults) \| ([0-9.]+) \|", r.stdout, re.M))
    assert set(rows) == {"lone-tp2", "defaults"}, r.stdout[-3000:]
    assert all(2.0 < float(v) < 5.0 for v in rows.values()), rows
    islands = re.search(r"defaults +held-out loss [0-9.]+ \(islands ([0-9.]+) / ([0-9.]+)\)", r.stdout)
    assert islands and abs(float(islands[1]) - float(islands[2])) < 2e-3, r.stdout[-3000:]   # one final model
    assert "convergence_mlm: defaults n/a DDP" in r.stdout            # no DDP row in this run
