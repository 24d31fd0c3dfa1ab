#!/usr/bin/env bash
# Fetch NVIDIA's nvidia-resiliency-ext 0.7.0 wheel for a glibc older than 2.39 and print the path of a copy that
# pip installs there (scripts/venv.sh py312-ft uses it).
#   scripts/nvrx-wheel.sh DIR
#
# Why: megatron-core 0.19.2's Megatron-LM FT integration (megatron/training/ft_integration.py) calls
# RankMonitorClient.init_workload_monitoring(num_warmup_iters=...), which nvidia-resiliency-ext 0.4.1 (the newest
# wheel pip offers on glibc 2.36) does not take, so `--enable-ft-package` fails at start with it. 0.7.0 ships only
# a manylinux_2_39 wheel. We download that wheel for its declared platform and save it under a manylinux_2_31
# name, which pip then installs on glibc 2.31..2.38.
#
# What is safe: the wheel is pure Python except ONE compiled module, nvrx_cupti_module (the straggler detector's
# CUPTI kernel timing, a CUDA-only feature), which is the only part that may need glibc 2.39. What the test of
# tests/shim/test_ft_launcher.py uses (ft_launcher, the rank monitor server, RankMonitorClient, the rendezvous) is
# Python and never imports it. Do not use the straggler detector (Megatron-LM's --log-straggler) from this
# install. The download is checked against the registry's sha256 of the 0.7.0 wheel below.
set -euo pipefail
dir="${1:?usage: $0 DIR}"
name=nvidia_resiliency_ext-0.7.0-cp312-cp312
sha=e0c646ccae211de81a4c2b5bb5cff96a5e12af1373fb0eb818a40716eef685ad
py="${PYTHON:-python3}"
mkdir -p "$dir"
out="$dir/${name}-manylinux_2_31_x86_64.whl"
if [ ! -f "$out" ]; then
  "$py" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.12 \
        --implementation cp --abi cp312 -d "$dir" nvidia-resiliency-ext==0.7.0 >&2
  got="$(sha256sum "$dir/${name}-manylinux_2_39_x86_64.whl" | cut -c1-64)"
  if [ "$got" != "$sha" ]; then
    echo "nvrx-wheel.sh: the downloaded wheel's sha256 is $got, not $sha" >&2; exit 1
  fi
  mv "$dir/${name}-manylinux_2_39_x86_64.whl" "$out"
fi
echo "$out"
