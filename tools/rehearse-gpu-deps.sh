#!/usr/bin/env bash
# Rehearses, on a machine without a GPU, what tools/gpu-check.sh does on a bare
# CUDA machine: inside a private mount namespace, an overlay over /usr hides
# every file of the packed Debian packages (and of the -dev packages that could
# stand in for them: pkg-config, gmock, benchmark, ...); then the packs are
# unpacked into an empty prefix, the project is configured and built by
# gpu-check.sh --build-only against that prefix and the CUDA toolkit alone,
# the build is checked for any path to the system's copies, and a few CPU tests
# run from it. Nothing outside the namespace changes. Needs root, unshare and
# overlayfs.
set -euo pipefail

DEFAULT_TARGETS=(kernels_adam_paths_test kernels_cast_test kernels_isa_test tiers_test layer_gradient_test
                 net_comm_test kernels_cuda_adam_test strata)
DEFAULT_TESTS='^(kernels_(adam_paths|cast|isa|cuda_adam)_test|kernels_isa_env_.*|tiers_test|layer_gradient_test|net_comm_test)$'

usage() {
  cat <<EOF
Usage: tools/rehearse-gpu-deps.sh [--jobs N] [--all] [--tests REGEX | --ctest ARGS] [OUTDIR]
  Builds in build-rehearsal/ against build-rehearsal-deps/ (emptied first),
  with the system's copies of the packed packages hidden; logs in OUTDIR
  (default build-rehearsal-out/).
  --jobs N      build jobs (default 1)
  --all         build every target (default: ${DEFAULT_TARGETS[*]})
  --tests REGEX the ctest -R run afterwards (default: the kernels, tiers,
                layer_gradient (OpenBLAS) and net_comm (Gloo) tests)
  --ctest ARGS  ctest's arguments instead of -R REGEX, as one word
                (e.g. --all --ctest "-LE exhaustive|fuzz|python")
Run tools/pack-gpu-deps.sh first.
EOF
}

jobs=1
all=0
tests=$DEFAULT_TESTS
ctest_args=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --jobs) jobs=${2:?--jobs needs a number}; shift ;;
    --all) all=1 ;;
    --tests) tests=${2:?--tests needs a regex}; shift ;;
    --ctest) ctest_args=${2:?--ctest needs arguments}; shift ;;
    -*) echo "rehearse-gpu-deps: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/build-rehearsal-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DEBS=$ROOT/.gpu-debs
BUILD=$ROOT/build-rehearsal
PREFIX=$ROOT/build-rehearsal-deps
say() { echo "rehearse-gpu-deps: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (unshare -m and mount)"
[ -f "$DEBS/MANIFEST" ] || die "no $DEBS/MANIFEST: run tools/pack-gpu-deps.sh first"

if [ "${STRATA_REHEARSAL_INSIDE:-}" != 1 ]; then
  again=(--jobs "$jobs" --tests "$tests")
  [ -z "$ctest_args" ] || again+=(--ctest "$ctest_args")
  [ $all -eq 0 ] || again+=(--all)
  exec unshare -m --propagation private env STRATA_REHEARSAL_INSIDE=1 "$0" "${again[@]}" "$OUT"
fi

# ---- inside the private mount namespace from here on ----
# What to hide: the packed packages, and whatever else is installed that the
# build could fall back on.
EXTRA=(pkgconf pkg-config googletest libgmock-dev libbenchmark-dev libbenchmark1debian libboost-dev
       libnuma-dev libltdl-dev libhiredis-dev libibverbs-dev libopenblas-dev libopenblas0 libblas-dev
       liblapack-dev libblas3 liblapack3)
mapfile -t packs < <(awk '!/^#/{print $1}' "$DEBS/MANIFEST")
hidden_pkgs=()
for p in "${packs[@]}" "${EXTRA[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" && hidden_pkgs+=("$p")
done

scratch=$(mktemp -d /tmp/strata-rehearsal.XXXXXX)
mount -t tmpfs tmpfs "$scratch"
mkdir "$scratch/upper" "$scratch/work"
mount -t overlay overlay -o "lowerdir=/usr,upperdir=$scratch/upper,workdir=$scratch/work" /usr
# The files of those packages (/lib is /usr/lib on Debian 12), then their
# folders that this leaves empty (deepest first).
dpkg -L "${hidden_pkgs[@]}" 2>/dev/null | sed -e 's#^/lib/#/usr/lib/#' -e 's#^/lib64/#/usr/lib64/#' |
  grep '^/usr/' | sort -u >"$scratch/files"
xargs -d '\n' rm -f <"$scratch/files" 2>/dev/null || true  # rm refuses the folders
sort -r "$scratch/files" | xargs -d '\n' rmdir --ignore-fail-on-non-empty 2>/dev/null || true
# The alternatives' links (libopenblas.so.0, libblas.so.3, cblas.h,
# openblas.pc) now point at nothing: drop them too.
find /usr/lib/x86_64-linux-gnu /usr/include -xtype l -delete
hidden_files=$(find "$scratch/upper" -type c | wc -l)
{
  echo "hidden packages (${#hidden_pkgs[@]}): ${hidden_pkgs[*]}"
  echo "hidden files under /usr: $hidden_files (overlay whiteouts)"
  for probe in /usr/include/spdlog /usr/include/boost /usr/include/CLI /usr/include/gtest /usr/include/hwloc.h \
               /usr/include/liburing.h /usr/include/xxhash.h /usr/include/gloo /usr/include/oneapi \
               /usr/include/nlohmann /usr/include/fmt /usr/lib/x86_64-linux-gnu/libspdlog.so.1.10 \
               /usr/lib/x86_64-linux-gnu/libtbb.so.12 /usr/lib/x86_64-linux-gnu/libgfortran.so.5 \
               /usr/lib/libgloo.so.0 /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/bin/pkg-config; do
    if [ -e "$probe" ]; then echo "STILL THERE: $probe"; else echo "gone: $probe"; fi
  done
} | tee "$OUT/hidden.txt"
grep -q "STILL THERE" "$OUT/hidden.txt" && die "something that should be hidden is not"

# ccache links libhiredis, hidden above: give it the prefix's copy (compiler
# launcher only; the build itself sees none of this).
cat >"$scratch/ccache" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu" exec /usr/bin/ccache "\$@"
EOF
chmod +x "$scratch/ccache"
if command -v ccache >/dev/null; then
  export CMAKE_C_COMPILER_LAUNCHER=$scratch/ccache CMAKE_CXX_COMPILER_LAUNCHER=$scratch/ccache \
         CMAKE_CUDA_COMPILER_LAUNCHER=$scratch/ccache
fi

# An empty prefix and a fresh build folder, every time.
rm -rf "$PREFIX" "$BUILD"
targets=()
[ $all -eq 1 ] || for t in "${DEFAULT_TARGETS[@]}"; do targets+=(--target "$t"); done
t0=$(date +%s)
STRATA_GPU_DEBS=$DEBS STRATA_GPU_PREFIX=$PREFIX STRATA_GPU_BUILD=$BUILD \
  nice "$ROOT/tools/gpu-check.sh" --build-only --jobs "$jobs" "${targets[@]}" "$OUT" ||
  die "gpu-check.sh --build-only failed (logs in $OUT)"
say "unpack + configure + build: $(( $(date +%s) - t0 )) s"

# Proof that the system's copies were not used.
{
  echo "== CMake cache: where the dependencies were found"
  grep -E '^(TBB_DIR|spdlog_DIR|fmt_DIR|nlohmann_json_DIR|GTest_DIR|Boost_DIR|boost_headers_DIR|GLOO_INCLUDE_DIR|GLOO_LIBRARY|PKG_CONFIG_EXECUTABLE|pkgcfg_lib_[A-Z]+_[a-z]+|NCCL_LIBRARY|CUDAToolkit_BIN_DIR)[:=]' \
    "$BUILD/CMakeCache.txt"
  echo "== paths into the system's /usr/include or /usr/lib in build.ninja (CUDA's and the compiler's aside)"
  grep -oE '(^|[ :;"=])/usr/(include|lib)[^ ;"]*' "$BUILD/build.ninja" | sed 's/^[ :;"=]//' | sort | uniq -c || echo "none"
  echo "== RPATH of the test binaries and libstrata.so"
  for b in "$BUILD"/tests/kernels/kernels_adam_paths_test "$BUILD"/tests/net/net_comm_test "$BUILD"/engine/libstrata.so*; do
    [ -f "$b" ] && [ ! -L "$b" ] && echo "$(basename "$b"): $(readelf -d "$b" | grep -E 'RPATH|RUNPATH' | sed 's/.*Library //')"
  done
  echo "== ldd (the namespace hides the system's copies; a 'not found' or a /usr path for a packed library fails)"
  for b in "$BUILD"/tests/layers/layer_gradient_test "$BUILD"/tests/net/net_comm_test "$BUILD"/engine/libstrata.so; do
    [ -f "$b" ] || continue
    echo "-- $(basename "$b")"
    ldd "$b"
  done
} >"$OUT/proof.txt" 2>&1
cat "$OUT/proof.txt"
if grep -q "=> not found" "$OUT/proof.txt"; then die "a library was not found (see $OUT/proof.txt)"; fi
if grep -E '=> /usr/lib/x86_64-linux-gnu/lib(uring|hwloc|udev|xxhash|tbb|spdlog|fmt|gloo|hiredis|ibverbs|nl-|openblas|gfortran|quadmath)' \
     "$OUT/proof.txt"; then die "a packed library resolved to the system's copy"; fi

# libstrata.so with STRATA_LIBRARY alone, as the Python tests load it.
if [ -f "$BUILD/engine/libstrata.so" ]; then
  STRATA_LIBRARY=$BUILD/engine/libstrata.so python3 -c '
import ctypes, os
lib = ctypes.CDLL(os.environ["STRATA_LIBRARY"])
print("libstrata.so loaded by STRATA_LIBRARY alone; strata_version() =", lib.strata_version())' | tee -a "$OUT/proof.txt"
fi

if [ -n "$ctest_args" ]; then
  read -ra cargs <<<"$ctest_args"
else
  cargs=(-R "$tests")
fi
say "ctest ${cargs[*]}"
(cd "$BUILD" && ctest --output-on-failure "${cargs[@]}") 2>&1 | tee "$OUT/ctest.txt"
