#!/usr/bin/env bash
# The GPU check: on a machine with a GPU (the ones that build and test the
# project have none), build with CUDA, run every test (the GPU ones no longer
# skip) and measure host<->device copies through the tiers against
# cudaMemcpy from pinned memory. Figures go to OUTDIR. Budget: 8 minutes.
# Usage: tools/gpu-check.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: tools/gpu-check.sh OUTDIR}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build-gpu
start=$(date +%s)
{
  echo "== gpu-check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  "$ROOT/tools/install-deps.sh" || echo "install-deps failed (offline?); continuing with what is here"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DSTRATA_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null &&
    cmake --build "$BUILD" -j"$(nproc)" 2>&1 | tail -3
  echo "== tests"
  (cd "$BUILD" && timeout 300 ctest --output-on-failure -j4 2>&1 | tail -25)
  echo "== copy bandwidth (1 GiB, median of 5)"
  timeout 60 "$BUILD/bench/tiers/strata-copy-bw" 1024
  echo "== done in $(( $(date +%s) - start )) s"
} 2>&1 | tee "$OUT/gpu-check.txt"
