#!/usr/bin/env bash
# The README's main command: DiLoCo through yeto-patch on this machine, a syncer and two megatron-core islands.
#   bash scripts/demo.sh                 # default settings (about 10 minutes on 2 CPU cores)
#   bash scripts/demo.sh --short         # 1-2 minutes
#   bash scripts/demo.sh --steps 1000 --hidden 256 --islands 4 --layouts tp2,pp2,dp2,single ...
# Options: bash scripts/demo.sh --help. Output (table, plot, JSONL, logs): ./demo-out/
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
V="$(bash "$here/scripts/venv.sh" "${YETO_DEMO_ENV:-py312}")"
cd "$here"
# The loss plot's PNG needs matplotlib, an optional extra: install it when the registry is reachable, else the
# demo writes the SVG plot only.
if ! "$V/bin/python" -c "import matplotlib" >/dev/null 2>&1; then
  "$V/bin/python" -m pip install -q "matplotlib==3.10.3" >/dev/null 2>&1 \
    || echo "demo.sh: matplotlib not installed; the plot is written as SVG only" >&2
fi
exec "$V/bin/python" -m yeto_patch.demo "$@"
