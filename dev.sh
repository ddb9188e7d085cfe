#!/usr/bin/env bash
# The two commands of the README's quick start:
#   ./dev.sh run    install what is missing, build, run the main job
#   ./dev.sh test   install what is missing, build, run every test
# Options after the verb: --sanitize=address,undefined | --sanitize=thread
# (a separate build folder), --label=L (only tests labelled L; the default
# run leaves out the labels `exhaustive`, the kernels' full bit-pattern
# sweeps, and `timing`, the planner's prediction against a timed run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
VERB=${1:-}
shift || true
SANITIZE="" LABEL=""
for a in "$@"; do
  case "$a" in
    --sanitize=*) SANITIZE=${a#--sanitize=} ;;
    --label=*) LABEL=${a#--label=} ;;
    *) echo "dev.sh: unknown option '$a'" >&2; exit 2 ;;
  esac
done
BUILD=$ROOT/build${SANITIZE:+-${SANITIZE//,/-}}
JOBS=$(nproc)

build() {
  "$ROOT/tools/install-deps.sh"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_WERROR=ON \
    -DSTRATA_SANITIZE="$SANITIZE" >/dev/null
  cmake --build "$BUILD" -j"$JOBS"
}

case "$VERB" in
  run)
    build
    # The main job: a GPT whose state is 8x the device budget, trained with its
    # parameters and optimizer state on NVMe (a fresh folder under /var/tmp).
    "$BUILD/tools/strata-train"
    ;;
  test)
    build
    # The Python suite runs twice: Debian's torch 1.13 (/usr/bin/python3) and
    # torch 2 from a venv (tools/make-venv.sh, cached outside the repository;
    # the first time a download of about 3 GB). STRATA_NO_VENV=1: no venv, the
    # *_torch2 tests skip. A --label that selects none of them makes none.
    if [ "${STRATA_NO_VENV:-}" = 1 ]; then
      echo "dev.sh: STRATA_NO_VENV=1: no torch-2 venv; the python_*_torch2 tests will skip" >&2
    elif [ -z "$LABEL" ] || (cd "$BUILD" && ctest -N -L "$LABEL" | grep '_torch2$' >/dev/null); then
      STRATA_TORCH2_PYTHON=$("$ROOT/tools/make-venv.sh") || {
        echo "dev.sh: tools/make-venv.sh failed: no torch-2 venv, so the python_*_torch2 tests cannot run" \
          "(its message above; STRATA_NO_VENV=1 tests without them)" >&2
        exit 1
      }
      export STRATA_TORCH2_PYTHON
    fi
    cd "$BUILD"
    # The exhaustive kernel sweeps take many minutes: only when asked for by label.
    set +e
    if [ -n "$LABEL" ]; then
      ctest --output-on-failure -j"$JOBS" -L "$LABEL" 2>&1 | tee "$BUILD/ctest.log"
    else
      ctest --output-on-failure -j"$JOBS" -LE 'exhaustive|timing' 2>&1 | tee "$BUILD/ctest.log"
    fi
    status=${PIPESTATUS[0]}
    set -e
    # A test skips (77) for want of a GPU, and says so; one that skips for
    # want of a tool (clang++, objdump, torch, numpy, ...) hides an install
    # step this script lacks. STRATA_REQUIRE_TOOLS=1 (CI sets it) fails the
    # run on such a skip. Tests that need a GPU have cuda, gpu or nccl in
    # their names (the GPU rehearsal runs on the CPU: not one of them);
    # those that need root and namespaces (hosts_*, tiers_small_fs_test)
    # are listed, never failed: privileges are the machine's, not an install.
    # ctest's lines: "<tab> 18 - kernels_cuda_adam_test (Skipped)": the name is field 3.
    skipped=$(sed -n '/The following tests did not run:/,/^$/p' "$BUILD/ctest.log" | awk '$2 == "-"')
    privileged=$(printf '%s\n' "$skipped" | awk '$3 ~ /^(hosts_|tiers_small_fs_test$)/')
    others=$(printf '%s\n' "$skipped" |
      awk '$2 == "-" && $3 !~ /^(hosts_|tiers_small_fs_test$)/ && ($3 ~ /rehearsal/ || $3 !~ /cuda|gpu|nccl/)')
    [ -z "$privileged" ] || { echo "dev.sh: these tests need root and namespaces, and did not run:" >&2; echo "$privileged" >&2; }
    if [ -n "$others" ]; then
      echo "dev.sh: these tests did not run, and not for want of a GPU:" >&2
      echo "$others" >&2
      if [ "${STRATA_REQUIRE_TOOLS:-}" = 1 ]; then
        echo "dev.sh: STRATA_REQUIRE_TOOLS=1: a skip that is not a GPU's is a failure (each test's output says what it lacked)" >&2
        [ "$status" -ne 0 ] || status=1
      fi
    fi
    exit "$status"
    ;;
  *)
    echo "usage: ./dev.sh run|test [--sanitize=address,undefined|thread] [--label=L]" >&2
    exit 2
    ;;
esac
