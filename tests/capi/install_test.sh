#!/bin/sh
# Installs the build into a fresh prefix, then builds consumer.c against it
# twice: with `pkg-config --cflags --libs strata` and with find_package(strata).
# Usage: install_test.sh CMAKE BUILD_DIR CC CONSUMER_C WORK_DIR
set -eu
cmake=$1 build=$2 cc=$3 src=$4 work=$5
command -v pkg-config >/dev/null || { echo "pkg-config not found: skipped"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
"$cmake" --install "$build" --prefix "$work/prefix" >"$work/install.log"
pc=$(find "$work/prefix" -name strata.pc)
test -n "$pc" || { echo "strata.pc not installed"; exit 1; }
export PKG_CONFIG_PATH="$(dirname "$pc")"
libdir=$(pkg-config --variable=libdir strata)
echo "pkg-config: $(pkg-config --cflags --libs strata)"
# shellcheck disable=SC2046 # the flags are words
"$cc" -std=c99 -Wall -Wextra -Werror "$src" -o "$work/consumer_pc" $(pkg-config --cflags --libs strata)
LD_LIBRARY_PATH="$libdir" "$work/consumer_pc"

mkdir -p "$work/cmake"
cat >"$work/cmake/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(consumer C)
find_package(strata 0.1 REQUIRED CONFIG)
add_executable(consumer_cmake $src)
target_link_libraries(consumer_cmake PRIVATE strata::strata)
CMAKE
"$cmake" -S "$work/cmake" -B "$work/cmake/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_C_COMPILER="$cc" >"$work/cmake.log"
"$cmake" --build "$work/cmake/build" >>"$work/cmake.log"
"$work/cmake/build/consumer_cmake"  # the build tree's RPATH points at the prefix
echo "installed package: pkg-config and find_package consumers build and run"
