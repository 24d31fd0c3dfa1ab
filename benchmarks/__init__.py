"""Benchmark scripts (run them as ``python benchmarks/NAME.py``); a package so that tests can import the shared
code of one (``benchmarks.fuzzlib``) normally."""
