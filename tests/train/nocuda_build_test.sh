#!/usr/bin/env bash
# The build a fresh Debian 12 machine gets (the README's quick start: no CUDA
# toolkit there) is built nowhere else: every CI machine has nvcc, so its
# build has CUDA. This builds the library and strata-train with
# -DSTRATA_CUDA=OFF (warnings as errors, as dev.sh builds) into BUILD/nocuda
# and checks that it trains bitwise as this build does (the numerics never
# depend on the build), with its state offloaded to NVMe, and that it says
# it has no GPU. Incremental after the first run (about 3.5 min of 2 cores).
# Usage: nocuda_build_test.sh SOURCE_DIR BUILD_DIR STRATA_TRAIN
set -euo pipefail
SRC=${1:?source dir} BUILD=${2:?build dir} TRAIN=${3:?strata-train}
OUT=$BUILD/nocuda
WORK=$(mktemp -d /var/tmp/strata-nocuda-test-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
cmake -S "$SRC" -B "$OUT" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_WERROR=ON -DSTRATA_CUDA=OFF \
  -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF >"$WORK/configure.log" 2>&1 ||
  { tail -20 "$WORK/configure.log" >&2; fail "configuring without CUDA"; }
grep -q 'CUDA=OFF NCCL=OFF' "$WORK/configure.log" || { grep 'Strata ' "$WORK/configure.log" >&2; fail "the build without CUDA has CUDA"; }
cmake --build "$OUT" --target strata strata-train >"$WORK/build.log" 2>&1 ||
  { grep -E 'error|Error' "$WORK/build.log" | head -20 >&2; fail "building without CUDA"; }
echo "ok: built without CUDA: $(grep -o 'Strata .*werror=ON' "$WORK/configure.log")"
args=(--preset tiny --steps 6 --weights-hash --log-losses --print-every 100 --device-budget 256KiB --host-budget 8MiB)
"$OUT/tools/strata-train" "${args[@]}" --nvme "$WORK" >"$WORK/nocuda.out" 2>&1 || { cat "$WORK/nocuda.out" >&2; fail "training without CUDA"; }
"$TRAIN" "${args[@]}" --nvme "$WORK" >"$WORK/main.out" 2>&1 || { cat "$WORK/main.out" >&2; fail "training with this build"; }
pick() { grep -E '^(loss|strata-train weights_hash)' "$1"; }
[ "$(pick "$WORK/nocuda.out" | wc -l)" = 7 ] || { cat "$WORK/nocuda.out" >&2; fail "no losses or hash without CUDA"; }
diff <(pick "$WORK/main.out") <(pick "$WORK/nocuda.out") >&2 || fail "the build without CUDA trains other bits"
echo "ok: 6 steps offloaded to NVMe, bitwise the same losses and $(pick "$WORK/main.out" | tail -1 | sed 's/strata-train //')"
rc=0
"$OUT/tools/strata-train" --preset tiny --steps 1 --gpu >"$WORK/gpu.out" 2>&1 || rc=$?
[ "$rc" = 1 ] && grep -q 'built without CUDA' "$WORK/gpu.out" || { cat "$WORK/gpu.out" >&2; fail "--gpu without CUDA (rc $rc)"; }
echo "ok: $(tail -1 "$WORK/gpu.out")"
