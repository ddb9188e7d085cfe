#!/bin/sh
# Builds the manifest fuzzer (tests/fuzz/manifest_fuzz.cpp) with clang++
# -fsanitize=fuzzer,address,undefined and runs it for SECONDS on the seed
# corpus (real manifests the engine wrote). Exit 77 (skipped) when clang or
# its fuzzer runtime is missing.
#   run_manifest_fuzz.sh SOURCE_DIR WORK_DIR [SECONDS]
set -eu
src=$1
work=$2
seconds=${3:-20}
cxx=${STRATA_FUZZ_CXX:-clang++}
mkdir -p "$work/corpus"
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "manifest fuzz: $cxx not found; skipped"
  exit 77
fi
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$work/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer "$work/probe.cpp" -o "$work/probe" >"$work/probe.log" 2>&1; then
  echo "manifest fuzz: $cxx has no libFuzzer runtime; skipped"
  cat "$work/probe.log"
  exit 77
fi
flags=$(pkg-config --cflags --libs libxxhash 2>/dev/null || echo -lxxhash)
# shellcheck disable=SC2086
"$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I"$src" \
  "$src/tests/fuzz/manifest_fuzz.cpp" "$src/engine/format/manifest.cpp" "$src/base/status.cpp" "$src/base/dtype.cpp" $flags -o "$work/manifest_fuzz"
# The seeds stay as they are in the source tree; new inputs go to the work corpus.
# libFuzzer's own failure code is 77, ctest's "skipped": make every failure 1.
"$work/manifest_fuzz" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
  -error_exitcode=1 -timeout_exitcode=1 \
  -artifact_prefix="$work/" "$work/corpus" "$src/tests/fuzz/corpus/manifest"
