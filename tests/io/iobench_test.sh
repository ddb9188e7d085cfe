#!/usr/bin/env bash
# strata-iobench's input: modes checked before the file is written (and no
# file left), a block size that is not a power of two moves whole blocks of
# it (a 40 KiB file of 12 KiB blocks: 36 KiB), and the file goes afterwards.
# Usage: iobench_test.sh STRATA_IOBENCH
set -euo pipefail
BENCH=${1:?usage: iobench_test.sh path/to/strata-iobench}
WORK=$(mktemp -d /var/tmp/strata-iobench-test-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
rc=0
"$BENCH" --dir "$WORK" --file-size 64MiB --modes read,bogus --buffered >"$WORK/out" 2>&1 || rc=$?
[ "$rc" -eq 2 ] && grep -q "'bogus' is not read" "$WORK/out" || { cat "$WORK/out" >&2; fail "--modes bogus not refused (rc $rc)"; }
grep -q "file " "$WORK/out" && fail "--modes bogus was refused only after the file was laid out"
[ -z "$(ls -A "$WORK" | grep -v '^out$')" ] || fail "a refused run left $(ls "$WORK")"
"$BENCH" --dir "$WORK" --file-size 40KiB --block-size 12KiB --modes read,write --buffered >"$WORK/out" 2>&1 ||
  { cat "$WORK/out" >&2; fail "a 12 KiB block size"; }
[ "$(grep -c 'io=36.00 KiB' "$WORK/out")" -eq 2 ] || { cat "$WORK/out" >&2; fail "12 KiB blocks of a 40 KiB file: not 36 KiB moved"; }
[ ! -e "$WORK/strata-iobench.bin" ] || fail "the test file was left without --keep"
echo "ok: modes refused first, whole 12 KiB blocks, no file left"
