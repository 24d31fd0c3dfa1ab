#!/usr/bin/env bash
# Create (or reuse) a virtual environment for one supported environment and print its path.
#   scripts/venv.sh py312|py311|py312-launchers|py312-peers|py312-ft [--if-built]
# The venv lives outside the clone, in ${YETO_VENV_CACHE:-$HOME/.cache/yeto-patch/venvs}/<env>-<hash>,
# keyed by the hash of the requirement files, so a second run (or another clone) reuses it.
# py312-launchers is py312 plus ms-swift and Megatron-Bridge (the latter from <env>-nodeps.txt, --no-deps).
# py312-peers is py312 plus torchft (benchmarks/vs_torchft.py and its smoke test), layered on py312's venv.
# py312-ft is nvidia-resiliency-ext 0.7.0 (NVIDIA's ft_launcher) on top of the py312 venv, which a .pth file puts
# on its path (no second torch); the wheel comes from scripts/nvrx-wheel.sh (tests/shim/test_ft_launcher.py).
# --if-built: print the path only if that environment is already built (exit 1 otherwise); build nothing.
set -euo pipefail
env_name="${1:-py312}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$env_name" in
  py312) py_ver=3.12 ;;
  py311) py_ver=3.11 ;;
  py312-launchers) py_ver=3.12 ;;
  py312-peers) py_ver=3.12 ;;
  py312-ft) py_ver=3.12 ;;
  *) echo "usage: $0 py312|py311|py312-launchers|py312-peers|py312-ft" >&2; exit 2 ;;
esac
req="$here/requirements/$env_name.txt"
nodeps="$here/requirements/$env_name-nodeps.txt"
# Every requirement file the environment reads goes into the key (py312/py311: their file and common.txt).
hashed=("$req" "$here/requirements/common.txt")
if [ "$env_name" = py312-launchers ]; then
  hashed+=("$here/requirements/py312.txt" "$here/requirements/constraints-launchers.txt" "$nodeps")
fi
if [ "$env_name" = py312-peers ]; then
  hashed+=("$here/requirements/py312.txt")
fi
if [ "$env_name" = py312-ft ]; then
  hashed+=("$here/requirements/py312.txt" "$here/scripts/nvrx-wheel.sh")
fi
hash="$(cat "${hashed[@]}" | sha256sum | cut -c1-16)"
cache="${YETO_VENV_CACHE:-$HOME/.cache/yeto-patch/venvs}"
venv="$cache/$env_name-$hash"
find_python() {
  for cand in "python$py_ver" "$HOME/.pyenv/versions/$py_ver"*/bin/python"$py_ver" "/usr/bin/python$py_ver"; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import venv' >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  return 1
}
if [ "${2:-}" = --if-built ]; then
  if [ -f "$venv/.complete" ]; then echo "$venv"; exit 0; fi
  echo "venv.sh: $env_name is not built ($venv); scripts/venv.sh $env_name builds it" >&2; exit 1
fi
mkdir -p "$cache"
# One creator at a time per environment (parallel test runs share the cache).
exec 9>"$cache/.lock-$env_name"
flock 9
if [ ! -f "$venv/.complete" ]; then
  py="$(find_python)" || { echo "venv.sh: Python $py_ver not found (install it, e.g. with pyenv)" >&2; exit 1; }
  echo "venv.sh: creating $venv with $py" >&2
  rm -rf "$venv.tmp"; mkdir -p "$cache"
  "$py" -m venv "$venv.tmp"
  # pip records absolute paths in scripts; build in place under the final name
  rm -rf "$venv"; mv "$venv.tmp" "$venv"
  if [ "$env_name" = py312-peers ]; then
    # layered on py312's venv (its packages on sys.path through a .pth file, which pip sees as installed): only
    # torchft and its few dependencies are installed here, in seconds rather than another torch install
    base="$(bash "$here/scripts/venv.sh" py312 --if-built 2>/dev/null || bash "$here/scripts/venv.sh" py312)"
    "$venv/bin/python" -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/_yeto_base_py312.pth", "w").write(sys.argv[1] + "\n")' \
      "$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip >&2 || true
  if [ "$env_name" = py312-ft ]; then   # py312's packages on the path: pip sees them installed
    base="$(bash "$here/scripts/venv.sh" py312)"
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/yeto-py312.pth"
    wheel="$(PYTHON="$venv/bin/python" bash "$here/scripts/nvrx-wheel.sh" "$cache/wheels")"
    "$venv/bin/python" -m pip install -q --no-deps "$wheel" >&2
  fi
  (cd "$here/requirements" && "$venv/bin/python" -m pip install -q -r "$env_name.txt") >&2
  if [ -f "$nodeps" ]; then
    (cd "$here/requirements" && "$venv/bin/python" -m pip install -q --no-deps -r "$nodeps") >&2
  fi
  touch "$venv/.complete"
fi
# The package itself: editable, no dependency resolution, so console scripts point at this clone.
if ! log="$("$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here" 2>&1)"; then
  echo "$log" >&2; echo "venv.sh: installing yeto-patch into $venv failed" >&2; exit 1
fi
echo "$venv"
