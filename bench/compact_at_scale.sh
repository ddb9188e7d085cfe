#!/usr/bin/env bash
# An optimizer step over PARAMS (default 8 billion) parameters with compact
# state (strata.state_format "compact"), bf16 gradients kept in bf16
# (data_types.grad_accum_dtype), and P, W, M, V, G all homed on NVMe in DIR:
# 7.25 bytes a parameter on the disk (58 GB for 8 billion; fp32 would need
# 18, 144 GB). Two steps; the second is timed against fio's read and write
# rates on a 4 GiB file laid out as Strata lays out its swap file, measured
# just before. Refuses to start when DIR's file system lacks the room.
# Last line: `compact_at_scale params=N step_s=T disk_bound_ratio=R`.
# Usage: bench/compact_at_scale.sh DIR   (env: BUILD_DIR, PARAMS, GROUPS_)
set -euo pipefail
DIR=${1:?usage: bench/compact_at_scale.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
PARAMS=${PARAMS:-8000000000}
NGROUPS=${GROUPS_:-512}
[ -d "$DIR" ] || { echo "compact_at_scale: $DIR is not a directory" >&2; exit 2; }
command -v fio >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio; }
if [ ! -x "$BUILD_DIR/bench/engine/strata-offload-step" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target strata-offload-step >/dev/null
fi
need=$(( PARAMS * 29 / 4 + PARAMS / 50 + (4 << 30) ))  # 7.25 B a parameter, 2% copy-on-write room, fio's file
free=$(( $(df -P -B1 "$DIR" | awk 'NR==2 {print $4}') ))
[ "$free" -ge "$need" ] || { echo "compact_at_scale: $DIR has $((free >> 30)) GiB free; $PARAMS parameters need about $((need >> 30)) GiB" >&2; exit 2; }
FIOFILE=$DIR/compact_at_scale.fio.bin
OUT=$(mktemp)
trap 'rm -rf "$FIOFILE" "$OUT" "$DIR/compact_at_scale.swap"' EXIT
rm -f "$FIOFILE"; fallocate -l 4G "$FIOFILE"
fio --name=layout --filename="$FIOFILE" --size=4G --bs=1M --iodepth=32 --ioengine=io_uring --direct=1 --rw=write >/dev/null
rate() {
  fio --name=r --filename="$FIOFILE" --size=4G --bs=1M --iodepth=32 --ioengine=io_uring --direct=1 --rw="$1" \
    --output-format=json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['$1']['bw_bytes'])"
}
R=$(rate read); W=$(rate write)
rm -f "$FIOFILE"  # its room goes to the swap file
mkdir -p "$DIR/compact_at_scale.swap"
FORMATS=compact PARAM_NVME=1 GRAD_ACCUM=bf16 "$BUILD_DIR/bench/engine/strata-offload-step" \
  "$DIR/compact_at_scale.swap" "$PARAMS" "$NGROUPS" 2 10GiB | tee "$OUT"
/usr/bin/python3 - "$OUT" "$R" "$W" <<'PY'
import sys
line = [l for l in open(sys.argv[1]) if l.startswith("offload_step_round")][-1]
k = dict(f.split("=") for f in line.split()[1:])
r, w = float(sys.argv[2]), float(sys.argv[3])
step, rb, wb = float(k["step_s"]), float(k["read_bytes"]), float(k["write_bytes"])
bound = rb / r + wb / w
print(f"second step: {step:.1f} s, read {rb/1e9:.1f} GB, wrote {wb/1e9:.1f} GB; fio read {r/1e6:.0f} MB/s, "
      f"write {w/1e6:.0f} MB/s: bound {bound:.1f} s")
params = int([l for l in open(sys.argv[1]) if l.startswith("offload_step format=")][-1].split("params=")[1].split()[0])
print(f"compact_at_scale params={params} step_s={step:.2f} disk_bound_ratio={step / bound:.2f}")
PY
