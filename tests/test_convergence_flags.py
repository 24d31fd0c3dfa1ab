"""benchmarks/convergence.py hands each configuration to the demo as flags the demo's parser takes: swept values
that start with "--" (a syncer flag) and --syncer-arg reach the syncer intact."""
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_swept_and_syncer_flags_reach_the_demo_parser():
    import convergence
    from yeto_patch.demo import cli as demo_cli
    a = SimpleNamespace(layouts="single", steps=100, fragments=1, hidden=64, layers=2, seq_length=64, batch=8,
                        micro_batch=4, lr=3e-3, warmup=20, eval_interval=50, eval_seqs=16, baseline_layout="dp2",
                        base_wire="int4", outer_lr=0.7, sync_warmup=0, cache_dir=None,
                        syncer_arg=["--quorum=2", "--weights=steps"])
    c = dict(M=2, H=10, dtype="int1", ef=True, tau=5,
             extra={"outer_momentum": "0", "island_env": "YETO_DILOCO_BLOCK=1024", "syncer_arg": "--exact"})
    o = demo_cli.parse(convergence.demo_flags(c, a))
    assert (o.push_dtype, o.outer_momentum, o.sync_every) == ("int1", 0.0, 10)
    assert o.island_env == ["YETO_DILOCO_BLOCK=1024"]
    assert o.syncer_arg == ["--exact", "--quorum=2", "--weights=steps"]
