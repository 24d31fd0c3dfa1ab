#!/usr/bin/env bash
# Install the supported environments (cached venvs) and run the test suite in each.
#   bash scripts/test.sh            # py312 (megatron-core 0.19.2; everything), py311 (megatron-core 0.16.1;
#                                   # what touches megatron-core), then
#                                   # py312-launchers (py312 + ms-swift + Megatron-Bridge: tests/launchers only),
#                                   # py312-peers (py312 + torchft, layered on py312's venv: the torchft smoke test)
#   YETO_TEST_ENVS=py312 bash scripts/test.sh -k wire    # one environment, extra pytest arguments
#   YETO_TEST_WORKERS=1 bash scripts/test.sh             # one pytest process (default: 2, pytest-xdist)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
envs="${YETO_TEST_ENVS:-py312 py311 py312-launchers py312-peers}"
# Two pytest workers (pytest-xdist), each taking whole test files (--dist loadfile: a file's module-scoped
# worker pools and shared runs stay in one process; --no-loadscope-reorder keeps the order tests/conftest.py
# sets, long files first). Many end-to-end tests spend much of their time waiting (a syncer's round timeout, an
# island that is down on purpose, a link's back-off), which leaves a 2-core machine about a third idle when the
# files run one after another; two workers fill that time (py312's tests: 32 -> 24 minutes, py311's: 5:04 ->
# 4:37). The launchers' three runs keep the CPU busy on their own (two workers: 7:46 -> 7:31, each run twice
# as slow, closer to its timeouts), so they run one after another.
workers="${YETO_TEST_WORKERS:-2}"
case "$workers" in ''|*[!0-9]*) echo "YETO_TEST_WORKERS must be a whole number, not '$workers'" >&2; exit 2 ;; esac
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
# Debian's prometheus and chromium for the tests that use them (installed where root and apt-get allow; else
# those tests skip and say why).
bash scripts/system-packages.sh
# NVIDIA's ft_launcher (nvidia-resiliency-ext 0.7.0 layered on py312) for tests/shim/test_ft_launcher.py, which
# py312's stage runs (and skips, saying why, where the venv could not be built)
case " $envs " in
  *" py312 "*) bash scripts/venv.sh py312-ft >/dev/null ||
                 echo "scripts/venv.sh py312-ft failed: tests/shim/test_ft_launcher.py will skip" >&2 ;;
esac
status=0
for env in $envs; do
  venv="$(bash scripts/venv.sh "$env")"
  echo "=== tests on $env ($("$venv/bin/python" -c 'import sys,torch,megatron.core as m; print("Python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__)' 2>/dev/null))"
  # What each environment tests. py312 runs everything (tests/launchers skip themselves there: no launchers).
  # py311 is the older megatron-core (0.16.1): it runs what touches megatron-core's objects (hooks, masters,
  # names, the harness, two end-to-end runs) and imports every module on Python 3.11; the wire, syncer, demo
  # and island boundary/link tests (fakes and sockets, no megatron-core object) are the same pure-Python code
  # and run once, on py312. py312-launchers adds ms-swift and Megatron-Bridge
  # to py312's packages and runs only the tests of those launchers. py312-peers adds torchft to py312's packages
  # (a venv layered on py312's, built in seconds) and runs benchmarks/vs_torchft.py's smoke test (about a minute).
  case "$env" in
    py312-launchers) paths=(tests/launchers) ;;
    py312-peers) paths=(tests/test_vs_torchft.py) ;;
    py311) paths=(tests/test_modules.py tests/hooks tests/mcore tests/island/masters tests/shim/test_end_to_end.py
                  tests/shim/test_optimizer_boundary.py) ;;
    *) paths=(tests) ;;
  esac
  run_parallel=("${parallel[@]}")
  if [ "$env" = py312-launchers ] || [ "$env" = py312-peers ]; then run_parallel=(); fi
  # The repository root goes first on PYTHONPATH so the code under test is this clone's.
  if ! PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=25 "${run_parallel[@]}" "$@" "${paths[@]}"; then
    status=1
  fi
done
exit $status
