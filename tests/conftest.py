"""Shared pytest configuration: the repository root is importable and no YETO_* setting leaks into tests."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

for _k in [k for k in os.environ if k.startswith("YETO_")]:
    del os.environ[_k]


# The longest test files, longest first (seconds of their longest tests in the suite's two-worker runs on the
# 2-core machine, 2026-12; the launchers' serially). With two pytest-xdist workers taking whole files
# (scripts/test.sh), the files handed out last decide how long one worker sits idle while the other finishes:
# handing out the long files first leaves the short ones for the end. A stale list only costs time; files not
# named here follow in their usual order.
LONG_FILES_FIRST = (
    "launchers/test_mixed_islands.py",          # 209
    "launchers/test_swift_sft.py",              # 154
    "launchers/test_bridge_pretrain.py",        # 102
    "shim/test_island_restart.py",              # 303
    "shim/test_elastic.py",                     # 184
    "shim/test_refusals.py",                    # 182
    "shim/test_megatron_lm_islands.py",         # 182
    "shim/test_megatron_lm_loop.py",            # 180
    "shim/test_background_push.py",             # 159
    "mcore/test_harness.py",                    # 118 (py311: 50)
    "shim/test_start_order.py",                 # 115
    "shim/test_faults.py",                      # 111
    "shim/test_convergence_mlm.py",             # 105
    "shim/test_end_to_end.py",                  # 47 (py311: 100)
    "demo/test_demo.py",                        # 90
    "demo/test_warmup.py",                      # 86
    "shim/test_sharded_syncer.py",              # 82
    "shim/test_moe_islands.py",                 # 77
    "island/masters/test_names_mcore.py",       # 26 (py311: 73)
    "shim/test_optimizer_boundary.py",          # 55
    "syncer/test_soak.py",                      # 45
    "syncer/test_chaos.py",                     # 43
    "syncer/test_fuzz.py",                      # 37
    "shim/test_boundary_scaling_smoke.py",      # 34
)


def pytest_collection_modifyitems(session, config, items):
    """Runs LONG_FILES_FIRST's files first, in its order; every file's tests stay together and in their order.
    A serial run only changes order: no test depends on another file having run."""
    rank = {name: n for n, name in enumerate(LONG_FILES_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}

    def file_rank(item):
        rel = os.path.relpath(str(item.path), os.path.join(ROOT, "tests")).replace(os.sep, "/")
        return rank.get(rel, len(rank))
    items.sort(key=lambda item: (file_rank(item), order[id(item)]))
