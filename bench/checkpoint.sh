#!/usr/bin/env bash
# Checkpoint save of a 2 GiB state (W, M, V of ~179M parameters) homed on
# NVMe in DIR, into DIR/ckpt, against fio's sequential write rate on DIR in
# the same run, fio at its best (as it comes and with huge-page buffers:
# --iomem=mmap plus the bench/io/thp_shim.c preload; 1 MiB, depth 32,
# io_uring, O_DIRECT, as in bench/io_vs_fio.sh).
#
# A training step runs before each save, as in training. Where the state
# lives in one swap folder on the checkpoint's file system, the save is a
# snapshot: the swap file is fsynced and hard-linked into the checkpoint and
# the engine moves on to a fresh swap file (NvmeTier::Snapshot), so nothing
# is copied: its time is printed, but no ratio (fio has no peer for a link).
# The copying save (STRATA_CHECKPOINT_COPY=1: every block read from the swap
# file and written to the checkpoint) is what fio can be held against; it
# is bounded by the disk doing both, so fio's read rate and a 50:50
# read+write run are printed with the bounds they give:
#   write = bytes / fio_write              (writing alone)
#   sum   = bytes / fio_read + bytes / fio_write   (reads and writes in turn)
#   mixed = 2 * bytes / fio's 50:50 rate   (reads and writes at once)
# Last line: `checkpoint copy_vs_fio=R` = sum bound / the copying save's
# median time (1: as fast as fio reading the bytes, then writing them).
# Usage: bench/checkpoint.sh DIR   (env: BUILD_DIR, default ./build; PARAMS, SAVES)
set -euo pipefail
DIR=${1:?usage: bench/checkpoint.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
PARAMS=${PARAMS:-178956970}
SAVES=${SAVES:-3}
[ -d "$DIR" ] || { echo "checkpoint: $DIR is not a directory" >&2; exit 2; }
[ -e "$DIR/ckpt" ] && { echo "checkpoint: $DIR/ckpt exists; the benchmark writes (and removes) it" >&2; exit 2; }
command -v fio >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio; }
BENCH=$BUILD_DIR/bench/engine/strata-checkpoint-bench
SHIM=$BUILD_DIR/bench/io/thp_shim.so
if [ ! -x "$BENCH" ] || [ ! -f "$SHIM" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target strata-checkpoint-bench strata_thp_shim >/dev/null
fi
FIOFILE=$DIR/checkpoint.fio.bin
OUT=$(mktemp)
trap 'rm -rf "$FIOFILE" "$OUT" "$DIR/ckpt"' EXIT

fio_rate() {  # $1 = read|write|rw, $2 = plain|thp -> "read_MBps write_MBps"
  local pre=() mem=() mix=()
  if [ "$2" = thp ]; then pre=(env LD_PRELOAD="$SHIM"); mem=(--iomem=mmap); fi
  if [ "$1" = rw ]; then mix=(--rwmixread=50); fi
  "${pre[@]}" fio --name=ckpt --filename="$FIOFILE" --size=4G --bs=1M --iodepth=32 --ioengine=io_uring \
    --direct=1 --rw="$1" "${mix[@]}" "${mem[@]}" --output-format=json |
    /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['read']['bw_bytes']/1e6, j['write']['bw_bytes']/1e6)"
}
best() {  # $1 = read|write|rw, $2 = field (1 read, 2 write, 0 both) -> the best MB/s of plain and thp
  local a b
  a=$(fio_rate "$1" plain); b=$(fio_rate "$1" thp)
  /usr/bin/python3 -c "
import sys; f=int(sys.argv[3]); v=[[float(x) for x in s.split()] for s in sys.argv[1:3]]
print(max(sum(r) if f == 0 else r[f - 1] for r in v))" "$a" "$b" "$2"
}

# Lay out fio's file once (fio's first write pass would otherwise allocate).
fio --name=layout --filename="$FIOFILE" --size=4G --bs=1M --iodepth=32 --ioengine=io_uring --direct=1 --rw=write >/dev/null
WRITE1=$(best write 2)
READ=$(best read 1)
echo "== the copying save (STRATA_CHECKPOINT_COPY=1)"
STRATA_CHECKPOINT_COPY=1 "$BENCH" "$DIR" "$PARAMS" 32 "$SAVES" 1GiB | tee "$OUT.copy"
echo "== the default save"
"$BENCH" "$DIR" "$PARAMS" 32 "$SAVES" 1GiB | tee "$OUT"
MIX=$(best rw 0)
WRITE2=$(best write 2)
/usr/bin/python3 - "$OUT" "$READ" "$WRITE1" "$WRITE2" "$MIX" "$OUT.copy" <<'PY'
import sys
def figures(path):
    line = [l for l in open(path) if l.startswith("checkpoint_bench ")][-1]
    kv = dict(f.split("=") for f in line.split()[1:])
    return float(kv["save_s"]), float(kv["bytes"])
save, b = figures(sys.argv[1])
csave, _ = figures(sys.argv[6])
rr = float(sys.argv[2]) * 1e6
wr = max(float(sys.argv[3]), float(sys.argv[4])) * 1e6
mix = float(sys.argv[5]) * 1e6
print(f"fio (best of as-it-comes and huge-page buffers): read {rr/1e6:.0f} MB/s, write {wr/1e6:.0f} MB/s "
      f"(before {float(sys.argv[3]):.0f}, after {float(sys.argv[4]):.0f}), 50:50 read+write {mix/1e6:.0f} MB/s together")
wb, sb, mb = b / wr, b / rr + b / wr, 2 * b / mix
print(f"copying save: median {csave:.3f} s for {b/2**30:.2f} GiB = {b/csave/1e6:.0f} MB/s, save_vs_fio {(b/csave)/wr:.2f}; "
      f"bounds: write {wb:.3f} s, sum {sb:.3f} s, mixed {mb:.3f} s; save time / bound: "
      f"write {csave/wb:.2f}, sum {csave/sb:.2f}, mixed {csave/mb:.2f}")
print(f"default save (a snapshot where it applies: nothing copied, no fio peer): median {save:.3f} s for "
      f"{b/2**30:.2f} GiB of state")
print(f"checkpoint copy_vs_fio={sb/csave:.2f}")
PY
