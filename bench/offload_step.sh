#!/usr/bin/env bash
# An optimizer step over 256M parameters with W, M, V, G homed on NVMe in DIR,
# a 1 GiB host budget, gradients ready (bf16), against the disk bound from
# fio's rates on DIR measured in the same run (huge-page buffers, 1 MiB,
# depth 32, as in bench/io_vs_fio.sh).
#
# Strata's step pipeline reads shard i+1 while writing shard i-1, so the
# reads and writes run at once. This prints three bounds:
#   sum   = read_bytes / fio_read + write_bytes / fio_write
#   max   = max(read_bytes / fio_read, write_bytes / fio_write)
#   mixed = (read_bytes + write_bytes) / fio's rate on the same read:write mix at once
# and, as its last line, `offload_step disk_bound_ratio=R` = median step time /
# the sum bound. (The max bound assumes reads and writes at once add up to more
# bandwidth than either alone; the mixed fio run shows whether they do here.)
# Usage: bench/offload_step.sh DIR   (env: BUILD_DIR, PARAMS, GROUPS, STEPS)
set -euo pipefail
DIR=${1:?usage: bench/offload_step.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
PARAMS=${PARAMS:-268435456}
NGROUPS=${GROUPS_:-32}
STEPS=${STEPS:-3}
[ -d "$DIR" ] || { echo "offload_step: $DIR is not a directory" >&2; exit 2; }
command -v fio >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio; }
if [ ! -x "$BUILD_DIR/bench/engine/strata-offload-step" ] || [ ! -f "$BUILD_DIR/bench/io/thp_shim.so" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target strata-offload-step strata_thp_shim >/dev/null
fi
FIOFILE=$DIR/offload_step.fio.bin
OUT=$(mktemp)
trap 'rm -f "$FIOFILE" "$OUT"' EXIT
fio_rate() {  # $1 = read|write|rw [$2 = rwmixread] -> "read_MBps write_MBps"
  LD_PRELOAD="$BUILD_DIR/bench/io/thp_shim.so" fio --name=ostep --filename="$FIOFILE" --size=4G --bs=1M \
    --iodepth=32 --ioengine=io_uring --direct=1 --iomem=mmap --rw="$1" ${2:+--rwmixread=$2} \
    --output-format=json | /usr/bin/python3 -c "
import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['read']['bw_bytes']/1e6, j['write']['bw_bytes']/1e6)"
}
fio --name=layout --filename="$FIOFILE" --size=4G --bs=1M --iodepth=32 --ioengine=io_uring --direct=1 --rw=write >/dev/null
READ=$(fio_rate read | cut -d' ' -f1)
WRITE=$(fio_rate write | cut -d' ' -f2)
"$BUILD_DIR/bench/engine/strata-offload-step" "$DIR" "$PARAMS" "$NGROUPS" "$STEPS" 1GiB | tee "$OUT"
MIX=$(fio_rate rw 57)
/usr/bin/python3 - "$OUT" "$READ" "$WRITE" "$MIX" <<'PY'
import sys
line = [l for l in open(sys.argv[1]) if l.startswith("offload_step ")][-1]
kv = dict(f.split("=") for f in line.split()[1:])
step, rb, wb = float(kv["step_s"]), float(kv["read_bytes"]), float(kv["write_bytes"])
rr, wr = float(sys.argv[2]) * 1e6, float(sys.argv[3]) * 1e6
mr, mw = (float(x) * 1e6 for x in sys.argv[4].split())
sum_b, max_b, mix_b = rb / rr + wb / wr, max(rb / rr, wb / wr), (rb + wb) / (mr + mw)
print(f"fio: read {rr/1e6:.0f} MB/s, write {wr/1e6:.0f} MB/s, mixed 57:43 read+write {(mr+mw)/1e6:.0f} MB/s")
print(f"step {step:.3f} s moving {rb/2**30:.2f} GiB in, {wb/2**30:.2f} GiB out")
print(f"bounds: sum {sum_b:.3f} s, max {max_b:.3f} s, mixed {mix_b:.3f} s; "
      f"ratios: sum {step/sum_b:.2f}, max {step/max_b:.2f}, mixed {step/mix_b:.2f}")
print(f"offload_step disk_bound_ratio={step/sum_b:.2f}")
PY
