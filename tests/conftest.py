"""Shared pytest configuration: the repository root is importable and no YETO_* setting leaks into tests."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

for _k in [k for k in os.environ if k.startswith("YETO_")]:
    del os.environ[_k]
