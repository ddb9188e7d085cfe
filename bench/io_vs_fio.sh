#!/usr/bin/env bash
# Strata's io_uring storage against fio on the same file — Strata's own, laid
# out as Strata lays out its swap files (reserved with fallocate, then written
# whole), since a file that fio writes piece by piece reads and writes at
# another speed — same size (4 GiB), block size (1 MiB) and queue depth (32),
# three rounds, the order of the three runs turned each round; the file is
# laid out once, and no run's timed pass follows an untimed write of it.
# fio runs as it comes and with huge-page buffers (--iomem=mmap plus the
# bench/io/thp_shim.c preload); Strata is held to the faster of the two.
# Last line: io_vs_fio read_ratio=R write_ratio=W (medians, strata / best fio).
# Usage: bench/io_vs_fio.sh DIR   (env: BUILD_DIR, default ./build; SIZE, ROUNDS)
set -euo pipefail
DIR=${1:?usage: bench/io_vs_fio.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
SIZE=${SIZE:-4G}
ROUNDS=${ROUNDS:-3}
[ -d "$DIR" ] || { echo "io_vs_fio: $DIR is not a directory" >&2; exit 2; }
command -v fio >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio; }
if [ ! -x "$BUILD_DIR/tools/strata-iobench" ] || [ ! -f "$BUILD_DIR/bench/io/thp_shim.so" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target strata-iobench strata_thp_shim >/dev/null
fi
SHIM=$BUILD_DIR/bench/io/thp_shim.so
FIOFILE=$DIR/strata-iobench.bin  # strata-iobench --keep leaves it, laid out
RESULTS=$(mktemp)
trap 'rm -f "$FIOFILE" "$RESULTS"' EXIT

fio_mbs() {  # $1 = read|write, $2 = plain|thp -> MB/s
  local pre=() mem=()
  if [ "$2" = thp ]; then pre=(env LD_PRELOAD="$SHIM"); mem=(--iomem=mmap); fi
  "${pre[@]}" fio --name=io_vs_fio --filename="$FIOFILE" --size="$SIZE" --bs=1M --iodepth=32 \
    --ioengine=io_uring --direct=1 --rw="$1" "${mem[@]}" --output-format=json |
    /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]['$1']; print(j['bw_bytes']/1e6)"
}
strata_mbs() {  # $1 = read|write -> MB/s
  # --reuse: the file laid out once below is used as it is (no untimed
  # whole-file write before each timed pass, which fio's passes do not get).
  "$BUILD_DIR/tools/strata-iobench" --dir "$DIR" --file-size "${SIZE}iB" --block-size 1MiB \
    --queue-depth 32 --modes "$1" --keep --reuse | sed -n 's/.*(\([0-9.]*\)MB\/s).*/\1/p'
}

# Strata lays its file out (fallocate, one write pass); fio then reads and
# writes that same file, never one of its own.
strata_mbs write >/dev/null
[ -f "$FIOFILE" ] || { echo "io_vs_fio: strata-iobench left no $FIOFILE" >&2; exit 1; }
one() {  # $1 = read|write, $2 = who
  case "$2" in
    fio_plain) echo "$1 fio_plain $(fio_mbs "$1" plain)" ;;
    fio_thp) echo "$1 fio_thp $(fio_mbs "$1" thp)" ;;
    strata) echo "$1 strata $(strata_mbs "$1")" ;;
  esac >>"$RESULTS"
}
who=(fio_plain fio_thp strata)
for r in $(seq "$ROUNDS"); do
  for rw in write read; do
    # The order turns each round: whoever follows a write pass (or goes
    # first) is not always the same one.
    for k in 0 1 2; do one "$rw" "${who[$(( (k + r) % 3 ))]}"; done
  done
  echo "round $r of $ROUNDS done" >&2
done
/usr/bin/python3 - "$RESULTS" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
med = {}
for rw in ("read", "write"):
    for who in ("fio_plain", "fio_thp", "strata"):
        med[rw, who] = statistics.median(float(v) for d, w, v in rows if d == rw and w == who)
for rw in ("read", "write"):
    print(f"{rw:5s}: fio as it comes {med[rw,'fio_plain']:8.0f} MB/s   fio huge-page buffers "
          f"{med[rw,'fio_thp']:8.0f} MB/s   strata {med[rw,'strata']:8.0f} MB/s")
ratio = {rw: med[rw, "strata"] / max(med[rw, "fio_plain"], med[rw, "fio_thp"]) for rw in ("read", "write")}
print(f"io_vs_fio read_ratio={ratio['read']:.2f} write_ratio={ratio['write']:.2f}")
PY
