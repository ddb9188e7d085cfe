#!/bin/sh
# Runs tiers_test's NvmeTierSmallFs cases on a 16 MiB tmpfs, mounted in a
# private mount namespace that goes with the test (root only: else skipped, 77).
# Usage: small_fs_test.sh path/to/tiers_test
set -eu
TEST=${1:?usage: small_fs_test.sh path/to/tiers_test}
DIR=$(mktemp -d /tmp/strata-small-fs-XXXXXX)
trap 'rmdir "$DIR" 2>/dev/null || true' EXIT
if ! unshare --mount --propagation private true 2>/dev/null; then
  echo "skipped: cannot make a mount namespace (needs root)"
  exit 77
fi
unshare --mount --propagation private sh -c "
  mount -t tmpfs -o size=16m strata-small-fs '$DIR' || { echo 'skipped: cannot mount a tmpfs'; exit 77; }
  STRATA_SMALL_FS='$DIR' exec '$TEST' --gtest_filter='NvmeTierSmallFs.*'"
