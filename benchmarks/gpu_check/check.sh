#!/usr/bin/env bash
# yeto-patch GPU check (see benchmarks/gpu_check/check.py for what it checks). Run from the repository root:
#   bash benchmarks/gpu_check/check.sh            # GPU machine with torch (CUDA); megatron-core must be importable,
#                                                 # else the wheels in $YETO_GPU_WHEELS (default .gpu/whl) are
#                                                 # installed into /tmp/site (for machines without a package index)
#   bash benchmarks/gpu_check/check.sh --cpu      # this CPU machine: py312 venv + test-only CPU patches, gloo (debugging only)
# Extra arguments go to check.py (e.g. --steps 20 --phases tau0). Results: $OUT (default /tmp/yeto-gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/yeto-gpu-check-out}
mkdir -p "$OUT"
DEV=cuda
if [ "${1:-}" = "--cpu" ]; then
  shift
  DEV=cpu
  V=$(bash scripts/venv.sh py312) || exit 2
  PY=$V/bin/python
  export PYTHONPATH=$PWD
  LIMIT=${CHECK_TIMEOUT:-1500}
else
  PY=python3
  if ! PYTHONPATH=/tmp/site $PY -c "import megatron.core" >/dev/null 2>&1; then
    timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${YETO_GPU_WHEELS:-.gpu/whl}"/*.whl || exit 2
  fi
  export PYTHONPATH=/tmp/site:$PWD
  LIMIT=${CHECK_TIMEOUT:-270}
  timeout 20 nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
fi
for v in $(env | grep -o '^YETO_[A-Z_]*'); do unset "$v"; done   # the check sets its own
$PY -c "import torch, megatron.core as m; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'megatron-core', m.__version__)" 2>&1 | tail -1
timeout -k 10 "$LIMIT" $PY benchmarks/gpu_check/check.py --device "$DEV" --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"
rc=${PIPESTATUS[0]}
echo "check.sh: exit status $rc (results in $OUT)"
exit "$rc"
