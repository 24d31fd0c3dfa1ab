#!/usr/bin/env python
"""Hostile-input fuzzer for the syncer (loopback only): the command line of ``benchmarks/fuzzlib.py``.

    python benchmarks/fuzz_syncer.py [--frames 100000] [--seconds 900] [--seed 0] [--quick] [--json out.json]

What it sends and checks is described in benchmarks/fuzzlib.py; tests/syncer/test_fuzz.py runs it with --quick.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fuzzlib import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
