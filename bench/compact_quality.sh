#!/usr/bin/env bash
# Compact against fp32 optimizer state on training quality (issue #15): strata-train at a
# preset (default medium, its own batch and sequence), state on NVMe, once per format and seed.
# The seeds set the data, the initialization and the sampler, and each seed runs both formats,
# so a seed's pair sees the same batches and only the state format differs.
#
#   bench/compact_quality.sh DIR [SEED ...]        (default seeds: 1337 7)
#   Env: BUILD_DIR (./build), PRESET (medium), STEPS (300), WINDOW (20: the final loss is the
#        mean of the last WINDOW steps' losses), EXTRA (more strata-train arguments).
#
# Prints the loss curves (means of WINDOW-step windows) of every run, then per seed the final
# losses and their relative difference. "noise" is the run-to-run spread of fp32 itself: the
# largest relative difference between two fp32 seeds' final losses, and per window the largest
# difference between two fp32 seeds' curves. Last line:
#   compact_quality seeds=N final_rel_diff=D mean_rel_diff=M fp32_seed_spread=S max_curve_gap=G fp32_curve_spread=F
# D: the largest |compact - fp32| / fp32 of a seed's final losses; M: the same of the means
# over seeds; G: the largest gap of a seed's compact and fp32 curves in any window;
# F: the largest gap between fp32 curves of two seeds in any window.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
PRESET="${PRESET:-medium}"
STEPS="${STEPS:-300}"
WINDOW="${WINDOW:-20}"
EXTRA="${EXTRA:-}"
if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [SEED ...]" >&2
  exit 2
fi
DIR="$1"
shift
SEEDS=("$@")
[ ${#SEEDS[@]} -gt 0 ] || SEEDS=(1337 7)
mkdir -p "$DIR"
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$BUILD_DIR" --target strata-train >/dev/null
TRAIN="$BUILD_DIR/tools/strata-train"

for seed in "${SEEDS[@]}"; do
  for fmt in fp32 compact; do
    log="$DIR/$fmt.$seed.log"
    if [ -s "$log" ] && grep -q "^strata-train first_loss" "$log"; then
      echo "compact_quality: reusing $log" >&2
      continue
    fi
    swap="$DIR/swap.$fmt.$seed"
    rm -rf "$swap" && mkdir -p "$swap"
    echo "compact_quality: $fmt seed $seed ($STEPS steps of $PRESET)" >&2
    # The device budget is a few groups' compute copies, so the state lives on NVMe.
    "$TRAIN" --preset "$PRESET" --steps "$STEPS" --seed "$seed" --state-format "$fmt" \
      --device-budget 16MiB --nvme "$swap" --log-losses $EXTRA >"$log" 2>&1 || {
      echo "compact_quality: $fmt seed $seed failed, see $log" >&2
      exit 1
    }
    rm -rf "$swap"
  done
done

python3 - "$DIR" "$STEPS" "$WINDOW" "${SEEDS[@]}" <<'EOF'
import sys
d, steps, window, seeds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]

def losses(fmt, seed):
    out = {}
    for line in open(f"{d}/{fmt}.{seed}.log"):
        f = line.split()
        if len(f) >= 3 and f[0] == "loss" and f[1].isdigit():
            out[int(f[1])] = float(f[2])
    missing = [s for s in range(1, steps + 1) if s not in out]
    if missing:
        sys.exit(f"compact_quality: {fmt} seed {seed}: no loss for steps {missing[:5]}...")
    return [out[s] for s in range(1, steps + 1)]

def windows(xs):
    return [sum(xs[i:i + window]) / len(xs[i:i + window]) for i in range(0, len(xs), window)]

runs = {(f, s): losses(f, s) for f in ("fp32", "compact") for s in seeds}
curves = {k: windows(v) for k, v in runs.items()}
final = {k: sum(v[-window:]) / window for k, v in runs.items()}
print(f"mean loss over each window of {window} steps")
print("steps      " + " ".join(f"{f[:7]:>8}.{s:<6}" for s in seeds for f in ("fp32", "compact")))
for w in range(len(curves[("fp32", seeds[0])])):
    lo, hi = w * window + 1, min((w + 1) * window, steps)
    print(f"{lo:>4}-{hi:<5} " + " ".join(f"{curves[(f, s)][w]:>15.4f}" for s in seeds for f in ("fp32", "compact")))
rel = []
for s in seeds:
    f, c = final[("fp32", s)], final[("compact", s)]
    rel.append(abs(c - f) / f)
    print(f"seed {s}: final fp32 {f:.4f} compact {c:.4f} compact/fp32-1 {(c - f) / f:+.4%}")
mf = sum(final[("fp32", s)] for s in seeds) / len(seeds)
mc = sum(final[("compact", s)] for s in seeds) / len(seeds)
print(f"mean over seeds: fp32 {mf:.4f} compact {mc:.4f} compact/fp32-1 {(mc - mf) / mf:+.4%}")
spread = max((abs(final[("fp32", a)] - final[("fp32", b)]) / min(final[("fp32", a)], final[("fp32", b)])
              for a in seeds for b in seeds if a != b), default=float("nan"))
gap = max(abs(x - y) for s in seeds for x, y in zip(curves[("compact", s)], curves[("fp32", s)]))
cspread = max((abs(x - y) for a in seeds for b in seeds if a < b
               for x, y in zip(curves[("fp32", a)], curves[("fp32", b)])), default=float("nan"))
print(f"compact_quality seeds={len(seeds)} final_rel_diff={max(rel):.4f} mean_rel_diff={abs(mc - mf) / mf:.4f} "
      f"fp32_seed_spread={spread:.4f} max_curve_gap={gap:.4f} fp32_curve_spread={cspread:.4f}")
EOF
