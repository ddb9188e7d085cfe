#!/bin/sh
# Installs the build into a fresh prefix and uses it as a user would:
#  - consumer.c built with `pkg-config --cflags --libs strata` plus its
#    rpath_ldflags runs without LD_LIBRARY_PATH; built with find_package(strata);
#  - every tool runs (--help) from PREFIX/bin, linked to the installed libstrata;
#  - Debian's python3 imports the installed package (PYTHONPATH=PREFIX/...
#    as printed by the configure step) and it loads the installed library
#    with STRATA_LIBRARY unset;
#  - `pip install --no-deps --no-build-isolation --no-index` of python/ (a
#    copy, to leave the source tree clean) works offline into a --target;
#  - both install every module of python/strata, strata.torch's included.
# Usage: install_test.sh CMAKE BUILD_DIR CC CONSUMER_C WORK_DIR SOURCE_DIR
set -eu
cmake=$1 build=$2 cc=$3 src=$4 work=$5 source=$6
py=/usr/bin/python3
fail() { echo "FAIL: $*"; exit 1; }
command -v pkg-config >/dev/null || { echo "pkg-config not found: skipped"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
prefix="$work/prefix"
"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log"
unset LD_LIBRARY_PATH STRATA_LIBRARY

# pkg-config, with the rpath hint: no LD_LIBRARY_PATH needed.
pc=$(find "$prefix" -name strata.pc)
test -n "$pc" || fail "strata.pc not installed"
export PKG_CONFIG_PATH="$(dirname "$pc")"
rpath=$(pkg-config --variable=rpath_ldflags strata)
test -n "$rpath" || fail "strata.pc has no rpath_ldflags"
echo "pkg-config: $(pkg-config --cflags --libs strata) $rpath"
# shellcheck disable=SC2046 # the flags are words
"$cc" -std=c99 -Wall -Wextra -Werror "$src" -o "$work/consumer_pc" $(pkg-config --cflags --libs strata) $rpath
"$work/consumer_pc" || fail "the pkg-config consumer does not run without LD_LIBRARY_PATH"

mkdir -p "$work/cmake"
cat >"$work/cmake/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(consumer C)
find_package(strata 0.1 REQUIRED CONFIG)
add_executable(consumer_cmake $src)
target_link_libraries(consumer_cmake PRIVATE strata::strata)
CMAKE
"$cmake" -S "$work/cmake" -B "$work/cmake/build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" >"$work/cmake.log"
"$cmake" --build "$work/cmake/build" >>"$work/cmake.log"
"$work/cmake/build/consumer_cmake"  # the build tree's RPATH points at the prefix
echo "ok: pkg-config and find_package consumers build and run"

# The tools, from the prefix, on the installed library.
for tool in strata-train strata-plan strata-iobench strata-launch strata-export; do
  test -x "$prefix/bin/$tool" || fail "$tool not installed in $prefix/bin"
  "$prefix/bin/$tool" --help >"$work/$tool.help" 2>&1 || fail "$tool --help: $(cat "$work/$tool.help")"
done
lib=$(ldd "$prefix/bin/strata-train" | sed -n 's/.*libstrata\.so\.[0-9]* => \([^ ]*\).*/\1/p')
case "$lib" in
  "$prefix"/*) ;;
  *) fail "the installed strata-train loads libstrata from '$lib', not from $prefix" ;;
esac
echo "ok: every tool runs from $prefix/bin; strata-train loads $lib"

# The Python package, as installed.
test -x "$py" || { echo "no $py: the Python checks are skipped"; exit 77; }
init=$(find "$prefix" -path '*/strata/__init__.py')
test -n "$init" || fail "the Python package is not installed"
test -f "$(dirname "$init")/_installed.py" || fail "the installed package has no _installed.py"
site=$(dirname "$(dirname "$init")")
out=$(cd "$work" && PYTHONPATH="$site" "$py" -c \
  "import strata; print('.'.join(map(str, strata.version())), strata._load()._name, strata.__file__)") ||
  fail "import strata: $out"
set -- $out
test "$1" = "$(pkg-config --modversion strata)" || fail "strata.version() $1 is not the installed $(pkg-config --modversion strata)"
case "$2" in "$prefix"/*) ;; *) fail "the installed package loaded '$2', not the library in $prefix" ;; esac
case "$3" in "$prefix"/*) ;; *) fail "python3 imported '$3', not the package in $prefix" ;; esac
echo "ok: PYTHONPATH=$site: strata.version() = $1 from $2"

# Every module of the source package is installed, subpackages (strata.torch) too.
modules=$(cd "$source/python" && find strata -name '*.py' | LC_ALL=C sort)
same_modules() {  # DIR WHAT: DIR holds the source package's modules, no fewer
  got=$(cd "$1" && find strata -name '*.py' ! -name _installed.py | LC_ALL=C sort)
  test "$got" = "$modules" || fail "$2 installed other modules than python/strata has:
$(printf '%s\n' "$modules" >"$work/want"; printf '%s\n' "$got" | diff "$work/want" - || true)"
}
same_modules "$site" "cmake --install"

# pip, offline, from a copy of the source tree's python/.
"$py" -m pip --version >/dev/null 2>&1 || fail "python3 -m pip is missing (tools/install-deps.sh installs python3-pip)"
cp -r "$source/python" "$work/pysrc"
rm -rf "$work/pysrc/build" "$work/pysrc"/*.egg-info
PIP_CONFIG_FILE=/dev/null "$py" -m pip install --no-deps --no-build-isolation --no-index --no-cache-dir \
  --disable-pip-version-check --target "$work/pip" "$work/pysrc" >"$work/pip.log" 2>&1 ||
  fail "pip install: $(tail -20 "$work/pip.log")"
libfile=$(ls "$prefix"/lib*/libstrata.so.0 "$prefix"/lib*/*/libstrata.so.0 2>/dev/null | head -1)
out=$(cd "$work" && PYTHONPATH="$work/pip" STRATA_LIBRARY="$libfile" "$py" -c \
  "import strata; print('.'.join(map(str, strata.version())), strata.__file__)") || fail "import strata (pip): $out"
set -- $out
case "$2" in "$work/pip"/*) ;; *) fail "python3 imported '$2', not the pip-installed package" ;; esac
same_modules "$work/pip" "pip install"
echo "ok: pip install --target: strata.version() = $1 from $2"
echo "installed package: C consumers, tools and Python work from $prefix"
