#!/usr/bin/env bash
# An optimizer step over 256M parameters with W, M, V, G homed on NVMe in DIR,
# a 1 GiB host budget, gradients ready (bf16), against the disk bound from
# fio's rates on DIR measured in the same run (huge-page buffers, 1 MiB,
# depth 32, as in bench/io_vs_fio.sh).
#
# The disk schedule is strata.step_io (env STEP_IO, default alternate):
#   alternate:  the disk reads or writes, never both at once, so the bound is
#               sum = read_bytes / fio_read + write_bytes / fio_write;
#   concurrent: reads run beside writes, so the bound is
#               max = max(read_bytes / fio_read, write_bytes / fio_write).
# Also printed: mixed = (read_bytes + write_bytes) / fio's rate on the same
# read:write mix at once.
# Each round also steps an engine with strata.state_format "compact" on the
# same disk (in alternating order with the fp32 one), right after fio.
# Last line: `offload_step disk_bound_ratio=R compact_speedup=S`: R is the fp32
# step's median time / the schedule's bound (sum or max, named on the line
# before), S the median over rounds of fp32 step time / compact step time.
# Usage: bench/offload_step.sh DIR   (env: BUILD_DIR, PARAMS, GROUPS_, STEPS, STEP_IO, RINGS)
set -euo pipefail
DIR=${1:?usage: bench/offload_step.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
PARAMS=${PARAMS:-268435456}
NGROUPS=${GROUPS_:-32}
STEPS=${STEPS:-5}  # paired rounds
[ -d "$DIR" ] || { echo "offload_step: $DIR is not a directory" >&2; exit 2; }
command -v fio >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio; }
if [ ! -x "$BUILD_DIR/bench/engine/strata-offload-step" ] || [ ! -f "$BUILD_DIR/bench/io/thp_shim.so" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target strata-offload-step strata_thp_shim >/dev/null
fi
FIOFILE=$DIR/offload_step.fio.bin
OUT=$(mktemp)
ROUNDS_OUT=$(mktemp)
cleanup() {
  [ -n "${STEP_PID:-}" ] && kill "$STEP_PID" 2>/dev/null || true
  rm -f "$FIOFILE" "$OUT" "$ROUNDS_OUT"
}
trap cleanup EXIT
fio_rate() {  # $1 = read|write|rw [$2 = rwmixread] -> "read_MBps write_MBps"
  LD_PRELOAD="$BUILD_DIR/bench/io/thp_shim.so" fio --name=ostep --filename="$FIOFILE" --size=4G --bs=1M \
    --iodepth=32 --ioengine=io_uring --direct=1 --iomem=mmap --rw="$1" ${2:+--rwmixread=$2} \
    --output-format=json | /usr/bin/python3 -c "
import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['read']['bw_bytes']/1e6, j['write']['bw_bytes']/1e6)"
}
# The file laid out as Strata lays out its swap files: reserved whole with
# fallocate, then written (fio's own layout writes it piece by piece, and
# such a file moves at another speed than the engine's).
rm -f "$FIOFILE"
fallocate -l 4G "$FIOFILE"
fio --name=layout --filename="$FIOFILE" --size=4G --bs=1M --iodepth=32 --ioengine=io_uring --direct=1 --rw=write >/dev/null
# Paired rounds: this disk's rates drift by tens of percent from minute to
# minute, so each step is timed right after fio's read and write runs and the
# ratio is taken per round (median of rounds; one warm-up step first).
coproc STEPPER { PACED=1 FORMATS=fp32,compact exec "$BUILD_DIR/bench/engine/strata-offload-step" "$DIR" "$PARAMS" "$NGROUPS" $((STEPS + 1)) 1GiB; }
STEP_PID=$STEPPER_PID
next_step() {  # lets the stepper run one step; its round line goes to $ROUND
  # (no $(...): a subshell does not get the coprocess's descriptors)
  local line
  while IFS= read -r line <&"${STEPPER[0]}"; do
    echo "$line" >>"$OUT"
    [ "$line" = ready ] && break
  done
  echo go >&"${STEPPER[1]}"
  ROUND=""
  while IFS= read -r line <&"${STEPPER[0]}"; do
    echo "$line" >>"$OUT"
    case $line in
      "offload_step_round format=fp32 "*) ROUND=$line ;;
      "offload_step_round format=compact "*)
        ROUND="$ROUND $(echo "${line#offload_step_round format=compact }" | sed 's/\([a-z_]*\)=/compact_\1=/g')"
        return 0 ;;
    esac
  done
  echo "offload_step: the stepper stopped early:" >&2; cat "$OUT" >&2; exit 1
}
next_step  # warm-up
for _ in $(seq "$STEPS"); do
  RW="$(fio_rate read | cut -d' ' -f1) $(fio_rate write | cut -d' ' -f2)"
  next_step
  echo "$ROUND fio_read=${RW% *} fio_write=${RW#* }" | tee -a "$ROUNDS_OUT"
done
IN_FD=${STEPPER[0]}
exec {STEPPER[1]}>&-  # EOF: the stepper prints its summary and exits
cat <&"$IN_FD" >>"$OUT" 2>/dev/null || true
wait "$STEP_PID" || true
grep -E "^(step |host peak)" "$OUT" || true
MIX=$(fio_rate rw 57)
/usr/bin/python3 - "$ROUNDS_OUT" "$MIX" "${STEP_IO:-alternate}" <<'PY'
import statistics as st, sys
rounds = [dict(f.split("=") for f in l.split()[1:] if "=" in f) for l in open(sys.argv[1]) if l.strip()]
mr, mw = (float(x) * 1e6 for x in sys.argv[2].split())
schedule = sys.argv[3]
sums, maxs, mixes, steps, speedups = [], [], [], [], []
for k in rounds:
    step, rb, wb = float(k["step_s"]), float(k["read_bytes"]), float(k["write_bytes"])
    rr, wr = float(k["fio_read"]) * 1e6, float(k["fio_write"]) * 1e6
    sum_b, max_b = rb / rr + wb / wr, max(rb / rr, wb / wr)
    print(f"round: step {step:.3f} s ({rb/2**30:.2f} GiB in, {wb/2**30:.2f} GiB out), fio read {rr/1e6:.0f} MB/s "
          f"write {wr/1e6:.0f} MB/s; bounds sum {sum_b:.3f} s max {max_b:.3f} s; ratios sum {step/sum_b:.2f} max {step/max_b:.2f}")
    sums.append(step / sum_b); maxs.append(step / max_b); steps.append(step)
    cstep, crb, cwb = float(k["compact_step_s"]), float(k["compact_read_bytes"]), float(k["compact_write_bytes"])
    speedups.append(step / cstep)
    print(f"       compact step {cstep:.3f} s ({crb/2**30:.2f} GiB in, {cwb/2**30:.2f} GiB out); fp32/compact {step/cstep:.2f}")
    mixes.append(step / ((rb + wb) / (mr + mw)))
print(f"fio mixed 57:43 read+write {(mr+mw)/1e6:.0f} MB/s (after the rounds): median ratio to it {st.median(mixes):.2f}")
print(f"median of {len(rounds)} rounds: step {st.median(steps):.3f} s; ratio to sum bound {st.median(sums):.2f}, "
      f"to max bound {st.median(maxs):.2f}")
name, ratio = ("max", st.median(maxs)) if schedule == "concurrent" else ("sum", st.median(sums))
print(f"step_io={schedule}: the bound is {name} (median of per-round step / bound)")
print(f"offload_step disk_bound_ratio={ratio:.2f} compact_speedup={st.median(speedups):.2f}")
PY
