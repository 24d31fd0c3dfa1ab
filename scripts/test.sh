#!/usr/bin/env bash
# Install the supported environments (cached venvs) and run the test suite in each.
#   bash scripts/test.sh            # py312 (megatron-core 0.19.2), py311 (megatron-core 0.16.1), then
#                                   # py312-launchers (py312 + ms-swift + Megatron-Bridge: tests/launchers only)
#   YETO_TEST_ENVS=py312 bash scripts/test.sh -k wire    # one environment, extra pytest arguments
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
envs="${YETO_TEST_ENVS:-py312 py311 py312-launchers}"
status=0
for env in $envs; do
  venv="$(bash scripts/venv.sh "$env")"
  echo "=== tests on $env ($("$venv/bin/python" -c 'import sys,torch,megatron.core as m; print("Python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__)' 2>/dev/null))"
  # What each environment tests: the launcher environment runs only the tests of the real launchers (the rest is
  # the same code on the same py312 packages); the others run everything, and skip tests/launchers themselves.
  case "$env" in
    py312-launchers) paths=(tests/launchers) ;;
    *) paths=(tests) ;;
  esac
  # The repository root goes first on PYTHONPATH so the code under test is this clone's.
  if ! PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" "${paths[@]}"; then
    status=1
  fi
done
exit $status
