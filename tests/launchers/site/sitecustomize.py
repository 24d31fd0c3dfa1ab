"""TEST-ONLY start-up code for running the REAL ms-swift `megatron sft` CLI on CPU (tests/launchers).

Put this directory on PYTHONPATH after the repository root (whose sitecustomize.py runs this one first, then
installs yeto-patch's hooks when YETO_* says so) and set LAUNCHER_CPU=1. Every Python process of the launch (the
`megatron` CLI, torchrun, each rank) then
  1. installs the Transformer-Engine import shim for mcore_bridge (tests/launchers/cpu/swift_stubs.py), and
  2. in torchrun-started ranks (LOCAL_RANK set): applies the project's CUDA->CPU patches for megatron-core
     (tests/mcore/mlm_cpu_patches.py, without its Megatron-LM-only T1/T2/T4) and the swift-level CPU fixes
     (tests/launchers/cpu/swift_cpu_fixes.py), and the test-only hold of LAUNCHER_TEST_HOLD_AT
     (tests/launchers/cpu/swift_hold.py).
Nothing of this reaches ms-swift's command line.
"""
import os
import sys

if os.environ.get("LAUNCHER_CPU") == "1":
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if _root not in sys.path:
        sys.path.append(_root)
    from tests.launchers.cpu import swift_stubs  # noqa: F401  (installs the import shim)
    # (not in the helper processes that checkpoint saving spawns: they only write files)
    if "LOCAL_RANK" in os.environ and "--multiprocessing-fork" not in sys.argv:
        os.environ.setdefault("MLM_CPU_SKIP", "T1,T2,T4")
        from tests.mcore import mlm_cpu_patches
        mlm_cpu_patches.apply()
        from tests.launchers.cpu import swift_cpu_fixes, swift_hold
        swift_cpu_fixes.apply()
        swift_hold.apply()
