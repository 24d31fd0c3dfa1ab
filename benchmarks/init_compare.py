"""Diagnostic: after the start of a two-island run on Megatron-LM's own loop, does the island that did NOT send INIT
hold exactly the INIT tensors?

One syncer (fixed roster of 2); island "a" (layout --a, the lowest id: it initializes the run) and island "b"
(layout --b), b started first unless --a-first. Both run tests/shim/scripts/pretrain_gpt_cpu.py
(megatron.training.pretrain, mock data, bf16, distributed optimizer, learned absolute positions, tied
embeddings) and dump every rank's FP32 masters and model weights at the first forward step (after the
island's start, before any update), the last pipeline stage's tied output-layer copy included. a's dump is the
INIT (its masters are what it sent); b's dump is compared with it tensor by tensor: max |difference| and the
norm of the difference, for masters and weights (against the INIT cast to bf16), vocabulary rows split into
real rows and padding rows.

    python benchmarks/init_compare.py --a tp2 --b pp2
    python benchmarks/init_compare.py --a pp2 --b tp2 [--vocab-size 257] [--keep DIR]

Exit status 0 when every tensor b holds (real rows, both tied copies) equals a's INIT bit for bit.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.shim import mlm_islands as M  # noqa: E402
from tests.shim import procs as P  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", choices=sorted(M.LAYOUTS), default="tp2", help="layout of the initializing island")
    ap.add_argument("--b", choices=sorted(M.LAYOUTS), default="pp2", help="layout of the other island")
    ap.add_argument("--a-first", action="store_true", help="start island a first (default: b first)")
    ap.add_argument("--vocab-size", type=int, default=257)
    ap.add_argument("--keep", help="keep the run directory here")
    a = ap.parse_args(argv)
    tmp = a.keep or tempfile.mkdtemp(prefix="init_compare.")
    os.makedirs(tmp, exist_ok=True)
    pair = [("a", a.a), ("b", a.b)]
    rcs, procs = M.run_pair(tmp, *(pair if a.a_first else pair[::-1]), vocab=a.vocab_size)
    if rcs != [0, 0, 0]:
        print(P.logs(procs))
        print(f"runs failed: {rcs} (logs in {tmp})")
        return 2
    init_from = M.initializer(procs[2].text())
    other = "b" if init_from == "a" else "a"
    print(f"the run was initialized from island {init_from}'s INIT ({dict(pair)[init_from]}); "
          f"island {other} ({dict(pair)[other]}) connected {'first' if (other == 'a') == a.a_first else 'second'}")
    init = M.dump(tmp, init_from)
    bad = []
    for kind in ("master", "param"):
        ref = init if kind == "master" else {k: P.as_bf16(v) for k, v in init.items()}  # weights are bf16
        rows = M.compare(ref, M.dump(tmp, other, kind=kind), a.vocab_size)
        print(f"\nisland {other}'s {kind}s after its start vs the INIT:\n{M.table(rows)}")
        bad += M.differing(rows)
    rows = M.compare({k: P.as_bf16(v) for k, v in init.items()}, M.dump(tmp, init_from, kind="param"),
                     a.vocab_size)
    print(f"\nisland {init_from}'s own weights vs its INIT:\n{M.table(rows)}")
    bad += M.differing(rows)
    print(f"\n{len(bad)} tensors differ from the INIT (padding rows not counted): {bad}; run directory {tmp}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
