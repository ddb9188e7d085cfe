#!/bin/sh
# Builds tests/fuzz/config_fuzz.cpp with clang++ and libFuzzer (plus ASan and
# UBSan) against the config reader's sources, and fuzzes it for SECONDS,
# seeded with tests/fuzz/corpus/config (new inputs go to WORK/corpus, not to
# the source tree). Exit 0: no crash; 77: skipped (no clang++ or no libFuzzer
# runtime: Debian's clang and libclang-rt-14-dev, see tools/install-deps.sh);
# else the fuzzer's failure, with the crashing input in WORK.
# Usage: run_config_fuzz.sh SOURCE_ROOT SECONDS WORK [extra libFuzzer flags]
# A longer run by hand: sh tests/fuzz/run_config_fuzz.sh . 3600 /tmp/config-fuzz -jobs=2
set -eu
ROOT=$1 SECONDS_=$2 WORK=$3
shift 3
CXX=${FUZZ_CXX:-clang++}
if ! command -v "$CXX" >/dev/null 2>&1; then
  echo "config_fuzz: skipped: $CXX not found (apt-get install clang libclang-rt-14-dev)"
  exit 77
fi
mkdir -p "$WORK/corpus"
probe="$WORK/probe.cpp"
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe"
if ! "$CXX" -fsanitize=fuzzer,address,undefined "$probe" -o "$WORK/probe" 2>"$WORK/probe.log"; then
  echo "config_fuzz: skipped: $CXX cannot link libFuzzer (apt-get install libclang-rt-14-dev):"
  cat "$WORK/probe.log"
  exit 77
fi
SPDLOG=$(pkg-config --cflags --libs spdlog fmt 2>/dev/null || echo "-DSPDLOG_FMT_EXTERNAL -lspdlog -lfmt")
# The config reader and the base it uses; nothing else is linked.
# shellcheck disable=SC2086
"$CXX" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$ROOT" -I"$ROOT/include" \
  "$ROOT/tests/fuzz/config_fuzz.cpp" "$ROOT/engine/config/config.cpp" "$ROOT/engine/config/config_json.cpp" \
  "$ROOT/engine/config/config_reader.cpp" "$ROOT/engine/config/config_validate.cpp" \
  "$ROOT/base/status.cpp" "$ROOT/base/check.cpp" "$ROOT/base/log.cpp" "$ROOT/base/sizes.cpp" \
  "$ROOT/base/dtype.cpp" "$ROOT/base/text.cpp" "$ROOT/base/cgroup.cpp" "$ROOT/kernels/cpu/step_scalars.cpp" $SPDLOG -pthread -o "$WORK/config_fuzz"
cd "$WORK"
# Warnings of accepted documents would flood the log; the checks abort loudly.
# libFuzzer's own failure code is 77, ctest's "skipped": make every failure 1.
STRATA_LOG_LEVEL=off ./config_fuzz -max_total_time="$SECONDS_" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
  -error_exitcode=1 -timeout_exitcode=1 \
  -print_final_stats=1 "$@" "$WORK/corpus" "$ROOT/tests/fuzz/corpus/config"
