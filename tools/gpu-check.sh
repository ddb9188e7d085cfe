#!/usr/bin/env bash
# The GPU check: on a machine with a GPU (the ones that build and test the
# project have none), build with CUDA, run the GPU tests (which skip
# elsewhere), measure host<->device copies through the tiers against cudaMemcpy
# from pinned memory, and train on the GPU a model whose state is 5.8x the
# device budget (strata-train --gpu; its summary line carries TFLOPS). Figures
# go to OUTDIR/gpu-check.txt. Then every other test, in what is left of the
# budget: 8 minutes.
# The GPU machines have CUDA, CMake, ninja and g++ but none of our Debian
# libraries and no network: when .gpu-debs/ (tools/pack-gpu-deps.sh) is in the
# checkout, its packages are unpacked into build-gpu-deps/ and the build uses
# that prefix alone (tools/unpack-gpu-deps.sh); else the system's copies.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tools/gpu-check.sh [--build-only] [--jobs N] [--target T]... OUTDIR
  Builds with CUDA into build-gpu/, then: the GPU tests, the copy bandwidth,
  strata-train --gpu, every other test (8 minutes in all); the log goes to
  OUTDIR/gpu-check.txt.
  --build-only  unpack, configure and build, then stop (for rehearsals)
  --jobs N      build jobs (default: all processors)
  --target T    build only T (repeatable; with --build-only)
Environment: STRATA_GPU_DEBS (default .gpu-debs), STRATA_GPU_BUILD
(default build-gpu), STRATA_GPU_PREFIX (default build-gpu-deps).
EOF
}

build_only=0
jobs=$(nproc)
targets=()
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --build-only) build_only=1 ;;
    --jobs) jobs=${2:?--jobs needs a number}; shift ;;
    --target) targets+=("${2:?--target needs a name}"); shift ;;
    -*) echo "gpu-check: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { usage >&2; exit 2; }; OUT=$1 ;;
  esac
  shift
done
[ -n "$OUT" ] || { usage >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${STRATA_GPU_BUILD:-$ROOT/build-gpu}
DEBS=${STRATA_GPU_DEBS:-$ROOT/.gpu-debs}
PREFIX=${STRATA_GPU_PREFIX:-$ROOT/build-gpu-deps}
start=$(date +%s)
rm -f "$OUT/gpu-tests.rc" "$OUT/python-gpu-tests.rc"  # (this run's verdict, never an earlier run's)

# Unpacks the packed Debian packages (if any) and builds; nonzero on failure.
build() {
  local cmake_args=(-G Ninja -DSTRATA_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo)
  if [ -d "$DEBS" ]; then
    echo "== dependencies: $(grep -vc '^#' "$DEBS/MANIFEST" 2>/dev/null || echo '?') packed Debian packages from $DEBS into $PREFIX"
    "$ROOT/tools/unpack-gpu-deps.sh" "$DEBS" "$PREFIX" || return 1
    cmake_args+=(-C "$PREFIX/strata-deps.cmake")
  else
    echo "== dependencies: the system's (no $DEBS; tools/pack-gpu-deps.sh makes it)"
    "$ROOT/tools/install-deps.sh" || echo "install-deps failed (offline?); continuing with what is here"
  fi
  # No system NCCL (the GPU machines have none): the one in the PyTorch
  # wheel of the machine's python3 (nvidia/nccl/{include,lib}), if any.
  if ! ls /usr/include/nccl.h /usr/local/cuda/include/nccl.h >/dev/null 2>&1; then
    local nccl
    nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null ||
           ls -d /opt/*/.venv/lib/python3*/site-packages/nvidia/nccl 2>/dev/null | head -1 || true)
    local lib
    lib=$(ls "$nccl"/lib/libnccl.so* 2>/dev/null | head -1)
    if [ -n "$nccl" ] && [ -f "$nccl/include/nccl.h" ] && [ -n "$lib" ]; then
      echo "== NCCL from the PyTorch wheel: $nccl"
      cmake_args+=(-DNCCL_INCLUDE_DIR="$nccl/include" -DNCCL_LIBRARY="$lib")
    else
      echo "== no NCCL (neither the system's nor a PyTorch wheel's): building without it"
    fi
  fi
  echo "== configure and build ($jobs jobs)"
  cmake -S "$ROOT" -B "$BUILD" "${cmake_args[@]}" >"$OUT/configure.log" 2>&1 || {
    tail -30 "$OUT/configure.log"; echo "configure failed (whole log: $OUT/configure.log)"; return 1; }
  grep -E '^-- Strata ' "$OUT/configure.log" || true
  local t=()
  [ ${#targets[@]} -eq 0 ] || t=(--target "${targets[@]}")
  cmake --build "$BUILD" -j"$jobs" "${t[@]}" >"$OUT/build.log" 2>&1 || {
    grep -E -A5 'error|FAILED' "$OUT/build.log" | head -40; echo "build failed (whole log: $OUT/build.log)"; return 1; }
  tail -1 "$OUT/build.log"
  echo "== built in $(( $(date +%s) - start )) s"
}

{
  echo "== gpu-check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  if ! build; then
    echo "== stopped: no build"
    exit 1
  fi
  if [ "$build_only" -eq 1 ]; then
    echo "== done (--build-only) in $(( $(date +%s) - start )) s"
    exit 0
  fi
  # The GPU's own tests first, then the figures, then every other test with
  # what is left of the budget (they also run in CI, without a GPU).
  GPU_TESTS='cuda|nccl|gpu'
  # The Python GPU tests run under the machine's python3 when it holds torch
  # 2 (the GPU machines' image does; there is no venv there).
  if [ -z "${STRATA_TORCH2_PYTHON:-}" ] && python3 -c 'import torch, pytest, sys; sys.exit(0 if torch.__version__.startswith("2") else 1)' 2>/dev/null; then
    STRATA_TORCH2_PYTHON=$(command -v python3)
    export STRATA_TORCH2_PYTHON
  fi
  echo "== GPU tests ($GPU_TESTS; python: ${STRATA_TORCH2_PYTHON:-none})"
  # (the tail keeps the log short; ctest's own status is kept for the verdict at the end)
  (cd "$BUILD" && timeout 200 ctest --output-on-failure -j4 -R "$GPU_TESTS" -E 'rehearsal|python_gpu_test' 2>&1 |
    tail -25; echo "${PIPESTATUS[0]}" >"$OUT/gpu-tests.rc") || true
  echo "== Python GPU tests (strata.torch on CUDA against torch; a line of figures each)"
  (cd "$BUILD" && timeout 240 ctest -V -R python_gpu_test_torch2 2>&1 |
    grep -E 'gpu_case|run_gpu|skipped|passed|failed|FAILED|Error|^E ' | sed 's/^[0-9]*: //' | tail -40
    echo "${PIPESTATUS[0]}" >"$OUT/python-gpu-tests.rc") || true
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${gpus:-0}" -ge 2 ]; then
    echo "== two GPUs: NCCL through the engine at 2 ranks (== one CPU engine, bitwise)"
    timeout 120 "$BUILD/tools/strata-launch" --nproc 2 -- "$BUILD/tests/engine/engine_nccl_gpu_test" 2>&1 | tail -8 ||
      echo "engine_nccl_gpu_test at 2 ranks: exit status $?"
  else
    echo "== two GPUs: skipped (${gpus:-0} GPU here)"
  fi
  # The device machine's CPU likely has AVX-512: the compact kernels' AVX-512
  # twin, never yet run, is compared bitwise with the scalar path here.
  echo "== compact kernels' AVX-512 path (STRATA_TEST_UNVERIFIED_AVX512=1)"
  STRATA_TEST_UNVERIFIED_AVX512=1 timeout 60 "$BUILD/tests/kernels/kernels_compact_paths_test" 2>&1 | tail -6 ||
    echo "kernels_compact_paths_test: exit status $?"
  echo "== copy bandwidth (1 GiB, median of 5)"
  timeout 60 "$BUILD/bench/tiers/strata-copy-bw" 1024 || echo "strata-copy-bw: exit status $?"
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
    rc=0
    timeout "$limit" "$BUILD/tools/strata-train" --gpu --preset gpt2 --batch 16 --seq 1024 --steps 8 \
      --print-every 1 --device-budget 256MiB --host-budget 1GiB --nvme "$OUT/train-swap" >"$OUT/strata-train.out" 2>&1 ||
      rc=$?
    tail -n 22 "$OUT/strata-train.out"
    [ "$rc" -ne 124 ] || echo "strata-train: stopped by timeout after ${limit} s (no summary)"
    [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || echo "strata-train: exit status $rc"
    rm -rf "$OUT/train-swap"
  fi
  # Offloaded against resident, same model, batch and steps (issue 33): the
  # NVMe run above against gpt2 resident, and gpt2-medium with its state in
  # host memory (a 1.5 GiB device budget: 1/3.4 of the state) against
  # gpt2-medium resident. tokens/s ratios, and the overlapped step's
  # speculated / replayed / unspeculated steps of the offloaded runs.
  tok() { sed -n 's/.*tokens_per_s=\([0-9.]*\).*/\1/p' "$1" | tail -1; }
  spec() { sed -n 's/.*overlapped step *\([0-9]*\) steps speculated ([0-9]* committed, \([0-9]*\) replayed.*, \([0-9]*\) not speculated.*/\1\/\2\/\3/p' "$1" | tail -1; }
  train_run() {  # out-file args...
    local out=$1; shift
    local left=$(( 470 - ($(date +%s) - start) ))
    if [ "$left" -lt 40 ]; then echo "$out: skipped (${left} s left)"; return; fi
    timeout $(( left < 90 ? left : 90 )) "$BUILD/tools/strata-train" --gpu --print-every 100 "$@" >"$OUT/$out" 2>&1 ||
      echo "$out: exit status $?"
    tail -n 1 "$OUT/$out"
  }
  echo "== offloaded against resident (strata-train --gpu, 16 x 1024 tokens)"
  train_run resident-gpt2.out --preset gpt2 --batch 16 --seq 1024 --steps 8 --resident
  train_run resident-medium.out --preset gpt2-medium --batch 16 --seq 1024 --steps 6 --resident
  train_run host-medium.out --preset gpt2-medium --batch 16 --seq 1024 --steps 6 --device-budget 1536MiB \
    --host-budget 24GiB
  n=$(tok "$OUT/strata-train.out" 2>/dev/null); rn=$(tok "$OUT/resident-gpt2.out" 2>/dev/null)
  h=$(tok "$OUT/host-medium.out" 2>/dev/null); rh=$(tok "$OUT/resident-medium.out" 2>/dev/null)
  ratio() { [ -n "$1" ] && [ -n "$2" ] && awk -v a="$1" -v b="$2" 'BEGIN{printf "%.3f", a/b}' || echo "n/a"; }
  echo "offload_ratio host=$(ratio "$h" "$rh") nvme=$(ratio "$n" "$rn") (tokens/s offloaded / resident: gpt2-medium host $h / $rh, gpt2 nvme $n / $rn)"
  echo "overlapped_steps speculated/replayed/unspeculated host=$(spec "$OUT/host-medium.out" 2>/dev/null) nvme=$(spec "$OUT/strata-train.out" 2>/dev/null)"
  # Two figures, each a pair of runs on equal terms (same model, batch,
  # steps, budgets) differing in one key, through --config:
  #  - the device pool: the gpt2 preset offloaded (state on NVMe, 256 MiB
  #    device budget: copies evicted and allocated again every step) with
  #    strata.device_pool on and off;
  #  - the optimizer on the GPU: the gpt2 preset resident (W, M, V homed on
  #    the device) with strata.gpu_optimizer auto and off (CPU, through host).
  # Each prints tokens/s; the ratio is the step-time ratio inverted.
  pair() {  # name key on-value off-value extra-args...
    local name=$1 key=$2 on=$3 off=$4; shift 4
    local left=$(( 470 - ($(date +%s) - start) ))
    if [ "$left" -lt 100 ]; then echo "$name: skipped (${left} s left)"; return; fi
    local r1 r2
    for side in on off; do
      local v=$on
      [ "$side" = on ] || v=$off
      printf '{"strata": {"%s": %s}}\n' "$key" "$v" >"$OUT/pair.json"
      rm -rf "$OUT/pair-swap"; mkdir -p "$OUT/pair-swap"
      timeout 45 "$BUILD/tools/strata-train" --gpu --preset gpt2 --batch 4 --seq 512 --steps 6 --print-every 100 \
        --config "$OUT/pair.json" "$@" >"$OUT/pair-$key-$side.out" 2>&1 || echo "$name ($key=$v): exit status $?"
      tail -n 1 "$OUT/pair-$key-$side.out"
    done
    rm -rf "$OUT/pair-swap"
    r1=$(sed -n 's/.*tokens_per_s=\([0-9.]*\).*/\1/p' "$OUT/pair-$key-on.out")
    r2=$(sed -n 's/.*tokens_per_s=\([0-9.]*\).*/\1/p' "$OUT/pair-$key-off.out")
    if [ -n "$r1" ] && [ -n "$r2" ]; then
      echo "$name tokens_per_s $key=$on $r1 $key=$off $r2 ratio=$(awk -v a="$r1" -v b="$r2" 'BEGIN{printf "%.3f", a/b}')"
    else
      echo "$name: no figure (see $OUT/pair-$key-*.out)"
    fi
  }
  echo "== the device pool: strata.device_pool true against false (offloaded, 256 MiB device budget)"
  pair device_pool device_pool true false --device-budget 256MiB --host-budget 2GiB --nvme "$OUT/pair-swap"
  echo "== the optimizer on the GPU: strata.gpu_optimizer auto against off (resident state)"
  pair gpu_optimizer gpu_optimizer '"auto"' '"off"' --resident
  left=$(( 470 - ($(date +%s) - start) ))
  echo "== other tests (${left} s left)"
  if [ "$left" -lt 30 ]; then
    echo "skipped: they run in CI too"
  else
    (cd "$BUILD" && timeout "$left" ctest --output-on-failure -j8 -E "$GPU_TESTS" -LE exhaustive 2>&1 | tail -15) || true
  fi
  echo "== done in $(( $(date +%s) - start )) s"
} 2>&1 | tee "$OUT/gpu-check.txt"
block=${PIPESTATUS[0]}
# No build (or --build-only): the block's own status; nothing ran to judge.
[ "$block" -eq 0 ] || exit "$block"
[ "$build_only" -eq 0 ] || exit 0
# The verdict: the GPU tests' ctest status (and the Python GPU tests'), not
# tee's: everything above goes on past failures to collect what it can.
rc=$(cat "$OUT/gpu-tests.rc" 2>/dev/null || echo 1)
prc=$(cat "$OUT/python-gpu-tests.rc" 2>/dev/null || echo 1)
echo "gpu-check: GPU tests: ctest exit status $rc; Python GPU tests: $prc" | tee -a "$OUT/gpu-check.txt"
[ "$rc" -eq 0 ] && [ "$prc" -eq 0 ]
