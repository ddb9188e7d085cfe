#!/usr/bin/env bash
# The GPU check: on a machine with a GPU (the ones that build and test the
# project have none), build with CUDA, run the GPU tests (which skip
# elsewhere), measure host<->device copies through the tiers against cudaMemcpy
# from pinned memory, and train on the GPU a model whose state is 5.8x the
# device budget (strata-train --gpu; its summary line carries TFLOPS). Figures
# go to OUTDIR/gpu-check.txt. Then every other test, in what is left of the
# budget: 8 minutes.
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
  # The GPU's own tests first, then the figures, then every other test with
  # what is left of the budget (they also run in CI, without a GPU).
  GPU_TESTS='cuda|nccl|gpu'
  echo "== GPU tests ($GPU_TESTS)"
  (cd "$BUILD" && timeout 200 ctest --output-on-failure -j4 -R "$GPU_TESTS" 2>&1 | tail -25)
  echo "== copy bandwidth (1 GiB, median of 5)"
  timeout 60 "$BUILD/bench/tiers/strata-copy-bw" 1024
  # gpt2 preset (86M parameters): P, W, M, V, G = 1.44 GiB of state, 5.8x a
  # 256 MiB device budget; optimizer state and parameters on NVMe under OUTDIR;
  # 16 x 1024 tokens a step so that the GPU's share is more than launch overhead.
  echo "== strata-train --gpu (gpt2 preset, 16 x 1024 tokens, 256 MiB device budget, state on NVMe in OUTDIR)"
  left=$(( 470 - ($(date +%s) - start) ))
  if [ "$left" -lt 45 ]; then
    echo "skipped: ${left} s of the 8-minute budget left"
  else
    limit=$(( left < 180 ? left : 180 ))
    mkdir -p "$OUT/train-swap"
    timeout "$limit" "$BUILD/tools/strata-train" --gpu --preset gpt2 --batch 16 --seq 1024 --steps 8 \
      --print-every 1 --device-budget 256MiB --host-budget 1GiB --nvme "$OUT/train-swap" >"$OUT/strata-train.out" 2>&1
    rc=$?
    tail -n 22 "$OUT/strata-train.out"
    [ "$rc" -eq 124 ] && echo "strata-train: stopped by timeout after ${limit} s (no summary)"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && echo "strata-train: exit status $rc"
    rm -rf "$OUT/train-swap"
  fi
  left=$(( 470 - ($(date +%s) - start) ))
  echo "== other tests (${left} s left)"
  if [ "$left" -lt 30 ]; then
    echo "skipped: they run in CI too"
  else
    (cd "$BUILD" && timeout "$left" ctest --output-on-failure -j8 -E "$GPU_TESTS" -LE exhaustive 2>&1 | tail -15)
  fi
  echo "== done in $(( $(date +%s) - start )) s"
} 2>&1 | tee "$OUT/gpu-check.txt"
