#!/usr/bin/env bash
# Activation offload (issue 34) against keeping the activations, on the CPU:
# strata-train's small preset with a batch whose block inputs exceed the
# engine's host and device budgets together, trained twice per round in
# alternating order, with --offload-activations nvme (a two-stash host arena,
# the rest on NVMe in DIR, read ahead of backward) and without (the trainer
# keeps every block input). Same seed, same steps: the weights hash must be
# equal (else exit 1). Prints each run's step time (batch x seq tokens over
# the summary's tokens_per_s: the steps after the first, unrounded; neither
# timed run writes a trace), the activation figures, and last
#   activations offload_step_ratio=R
# R = median step time with offload / without (1.0: the disk traffic is
# hidden behind compute). An offloaded run after the timed ones, untimed,
# leaves its trace in DIR/activations-trace.json ("activation write"/"read"
# on the disk track).
# Usage: bench/activations.sh DIR   env: BUILD_DIR, ROUNDS (3), BATCH (192), SEQ (128), STEPS (4)
set -euo pipefail
DIR=${1:?usage: bench/activations.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
ROUNDS=${ROUNDS:-3} BATCH=${BATCH:-192} SEQ=${SEQ:-128} STEPS=${STEPS:-4}
[ -d "$DIR" ] || { echo "activations: $DIR is not a directory" >&2; exit 2; }
TRAIN=$BUILD_DIR/tools/strata-train
[ -x "$TRAIN" ] || cmake --build "$BUILD_DIR" --target strata-train >/dev/null
# Block inputs: 4 layers x BATCH x SEQ x 128 channels x 4 bytes.
acts=$(( 4 * BATCH * SEQ * 128 * 4 ))
HOST=${HOST:-40MiB}
common=(--preset small --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --print-every 1000 --weights-hash
        --host-budget "$HOST" --nvme "$DIR")
echo "activations: $(( acts >> 20 )) MiB of block inputs a step; host budget $HOST, device budget the preset's"
run() {  # name args...
  local name=$1; shift
  "$TRAIN" "${common[@]}" "$@" >"$DIR/$name.out" 2>&1 || { cat "$DIR/$name.out" >&2; exit 1; }
  local tps
  tps=$(sed -n 's/^strata-train first_loss=.* tokens_per_s=\([0-9.]*\).*/\1/p' "$DIR/$name.out")
  [ -n "$tps" ] && [ "$tps" != 0 ] || { echo "activations: no tokens_per_s in $name's summary" >&2; exit 1; }
  echo "$(awk -v t="$tps" -v n="$(( BATCH * SEQ ))" 'BEGIN{printf "%.4f", n/t}')"
}
keep=() off=()
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then
    keep+=("$(run keep)"); off+=("$(run offload --offload-activations nvme)")
  else
    off+=("$(run offload --offload-activations nvme)"); keep+=("$(run keep)")
  fi
  echo "round $r: step without offload ${keep[-1]} s, with ${off[-1]} s"
done
run traced --offload-activations nvme --trace "$DIR/activations-trace.json" >/dev/null
h1=$(grep -o 'weights_hash=[0-9a-f]*' "$DIR/keep.out"); h2=$(grep -o 'weights_hash=[0-9a-f]*' "$DIR/offload.out")
grep -E 'activations  |host    budget|device  budget|nvme    budget' "$DIR/offload.out"
[ "$h1" = "$h2" ] || { echo "activations: offloaded run differs: $h2 vs $h1" >&2; exit 1; }
echo "bitwise=yes ($h1)"
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END{print (NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2}'; }
mk=$(median "${keep[@]}"); mo=$(median "${off[@]}")
echo "activations offload_step_ratio=$(awk -v a="$mo" -v b="$mk" 'BEGIN{printf "%.3f", a/b}')"
