#!/usr/bin/env bash
# Unpacks the Debian packages that tools/pack-gpu-deps.sh downloaded into a
# private prefix (dpkg -x, never into /), points the copies of their CMake and
# pkg-config files at that prefix, checks that every library in it finds what
# it needs, and writes PREFIX/strata-deps.cmake: the initial cache (cmake -C)
# that builds Strata against this prefix alone, with an RPATH so that test
# binaries and libstrata.so find the libraries at run time.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tools/unpack-gpu-deps.sh [--force] DEBS_DIR PREFIX
  DEBS_DIR  the folder tools/pack-gpu-deps.sh filled (.deb files and MANIFEST)
  PREFIX    where to unpack (emptied first; skipped when already unpacked from
            the same MANIFEST, unless --force)
Afterwards: cmake -C PREFIX/strata-deps.cmake -S . -B build ...
EOF
}

force=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --force) force=1 ;;
    -*) echo "unpack-gpu-deps: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) args+=("$1") ;;
  esac
  shift
done
[ ${#args[@]} -eq 2 ] || { usage >&2; exit 2; }
DEBS=$(cd "${args[0]}" && pwd)
mkdir -p "${args[1]}"
PREFIX=$(cd "${args[1]}" && pwd)
SELF_DIR=$(cd "$(dirname "$0")" && pwd)
say() { echo "unpack-gpu-deps: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

MANIFEST=$DEBS/MANIFEST
[ -f "$MANIFEST" ] || die "no $MANIFEST (run tools/pack-gpu-deps.sh on a machine with apt)"
# dpkg -x where dpkg is; else the same by hand (a .deb is an ar archive whose
# data.tar.* holds the files).
extract() {
  if command -v dpkg >/dev/null; then
    dpkg -x "$1" "$2"
  else
    local t
    t=$(mktemp -d)
    (cd "$t" && ar x "$1" && tar -xf data.tar.* -C "$2") || { rm -rf "$t"; return 1; }
    rm -rf "$t"
  fi
}
command -v dpkg >/dev/null || command -v ar >/dev/null || die "neither dpkg nor ar is on this machine"

# The MANIFEST's lines: package version arch bytes sha256 file. Every .deb is
# checked against it, and nothing beside it is unpacked.
debs=()
while read -r pkg ver _arch _bytes sha file; do
  case "$pkg" in ''|'#'*) continue ;; esac
  f=$DEBS/$file
  [ -f "$f" ] || die "$pkg $ver: $file is missing from $DEBS"
  got=$(sha256sum "$f" | cut -d' ' -f1)
  [ "$got" = "$sha" ] || die "$pkg $ver: $file has sha256 $got, the MANIFEST says $sha"
  debs+=("$f")
done <"$MANIFEST"
[ ${#debs[@]} -gt 0 ] || die "the MANIFEST lists no package"

stamp=$( (cat "$MANIFEST" "$SELF_DIR/unpack-gpu-deps.sh"; echo "$PREFIX") | sha256sum | cut -d' ' -f1)
if [ $force -eq 0 ] && [ -f "$PREFIX/.strata-deps-stamp" ] && [ "$(cat "$PREFIX/.strata-deps-stamp")" = "$stamp" ]; then
  say "$PREFIX is up to date (${#debs[@]} packages)"
  exit 0
fi

# Empty the prefix, but never something that is not ours.
if [ -n "$(ls -A "$PREFIX")" ] && [ ! -f "$PREFIX/.strata-deps-prefix" ]; then
  die "$PREFIX is not empty and was not made by this script; refusing to empty it"
fi
find "$PREFIX" -mindepth 1 -delete
touch "$PREFIX/.strata-deps-prefix"
for f in "${debs[@]}"; do extract "$f" "$PREFIX" || die "cannot unpack $f"; done

U=$PREFIX/usr
# Merged /usr, as on Debian 12 itself: a few packages (libnl-3-200) still ship
# /lib/x86_64-linux-gnu/...
for d in lib lib64 bin sbin; do
  if [ -d "$PREFIX/$d" ] && [ ! -L "$PREFIX/$d" ]; then
    mkdir -p "$U/$d"
    cp -a "$PREFIX/$d/." "$U/$d/"
    rm -rf "${PREFIX:?}/$d"
    ln -s "usr/$d" "$PREFIX/$d"
  fi
done
MA=lib/x86_64-linux-gnu
LIBDIRS=("$U/$MA" "$U/$MA/openblas-pthread" "$U/lib")

# Debian's .pc files and some CMake files name /usr outright (prefix=/usr,
# libdir=/usr/lib/..., Gloo's and OpenBLAS's imported locations, the "/usr
# move" checks). Rewrite the copies: /usr where it starts a path becomes
# PREFIX/usr. Paths under other roots (Boost's /build/.../debian/tmp/usr) are
# left alone: they are only compared against, never used.
fixed=0
while IFS= read -r -d '' f; do
  sed -E -i "s#(^|[[:space:]\"'=;(:]|-I|-L)/usr(/|\"|'|\$|[[:space:]);])#\\1$U\\2#g" "$f"
  fixed=$((fixed + 1))
done < <(find "$U" \( -name '*.pc' -o -name '*.cmake' \) -type f -print0)
left=$(find "$U" \( -name '*.pc' -o -name '*.cmake' \) -type f -print0 |
  xargs -0 grep -lE "(^|[[:space:]\"=;(:]|-I|-L)/usr(/|\"|\$)" 2>/dev/null || true)
[ -z "$left" ] || die "still naming /usr after the rewrite: $left"

# pkg-config: the packed pkgconf, searching this prefix only (PKG_CONFIG_LIBDIR
# replaces its built-in /usr list), with its own library beside it.
mkdir -p "$PREFIX/bin"
cat >"$PREFIX/bin/pkg-config" <<EOF
#!/bin/sh
# pkgconf from the packed Debian packages, looking in $PREFIX only.
PKG_CONFIG_LIBDIR="$U/$MA/pkgconfig:$U/$MA/openblas-pthread/pkgconfig:$U/lib/pkgconfig:$U/share/pkgconfig"
export PKG_CONFIG_LIBDIR
LD_LIBRARY_PATH="$U/$MA\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$U/bin/pkgconf" "\$@"
EOF
chmod +x "$PREFIX/bin/pkg-config"
"$PREFIX/bin/pkg-config" --exists liburing hwloc libxxhash openblas ||
  die "the packed pkg-config does not find liburing, hwloc, libxxhash and openblas in $PREFIX"

# Every shared library in the prefix must find its needs in the prefix or on
# the machine (libc, libstdc++, libgcc_s: what its compiler brings); a missing
# one, or a too old glibc/libstdc++, is named here rather than at link time.
ldpath=$(IFS=:; echo "${LIBDIRS[*]}")
missing=$(find "${LIBDIRS[@]}" -maxdepth 1 -name '*.so*' -type f -print0 |
  xargs -0 -n 20 env LD_LIBRARY_PATH="$ldpath" ldd 2>&1 |
  awk '/^\//{lib=$1} /not found/{print lib" "$0}' | sort -u)
[ -z "$missing" ] || die "libraries in the prefix lack what this machine should provide:
$missing"

# Each package's CMake config by its folder (<Name>_DIR), so that none depends
# on the compiler reporting the multiarch folder (CMAKE_LIBRARY_ARCHITECTURE).
config_dirs=$(find "$U" \( -name '*Config.cmake' -o -name '*-config.cmake' \) -type f | sort |
  while IFS= read -r f; do
    n=$(basename "$f"); n=${n%Config.cmake}; n=${n%-config.cmake}
    echo "set(${n}_DIR \"$(dirname "$f")\" CACHE PATH \"\")"
  done)

# The initial cache: find everything in the prefix; RPATH (not RUNPATH:
# --disable-new-dtags) so that the libraries these load (libgfortran for
# OpenBLAS, libfmt for spdlog, libnl for ibverbs) are found through it too.
rpath=$(IFS=';'; echo "${LIBDIRS[*]}")
# Headers: the multiarch folder too, which Debian's compiler searches by
# itself for /usr but not for a prefix (hwloc/autogen/config.h is there, and
# hwloc.pc names only include/).
incdirs="$U/include;$U/include/x86_64-linux-gnu"
cat >"$PREFIX/strata-deps.cmake" <<EOF
# Written by tools/unpack-gpu-deps.sh: build against $PREFIX only.
set(CMAKE_PREFIX_PATH "$U" CACHE PATH "")
set(PKG_CONFIG_EXECUTABLE "$PREFIX/bin/pkg-config" CACHE FILEPATH "")
set(CMAKE_C_STANDARD_INCLUDE_DIRECTORIES "$incdirs" CACHE STRING "")
set(CMAKE_CXX_STANDARD_INCLUDE_DIRECTORIES "$incdirs" CACHE STRING "")
set(CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES "$incdirs" CACHE STRING "")
set(CMAKE_BUILD_RPATH "$rpath" CACHE STRING "")
set(CMAKE_EXE_LINKER_FLAGS "-Wl,--disable-new-dtags" CACHE STRING "")
set(CMAKE_SHARED_LINKER_FLAGS "-Wl,--disable-new-dtags" CACHE STRING "")
set(CMAKE_MODULE_LINKER_FLAGS "-Wl,--disable-new-dtags" CACHE STRING "")
$config_dirs
EOF
echo "$stamp" >"$PREFIX/.strata-deps-stamp"
say "${#debs[@]} packages unpacked into $PREFIX ($(du -sh "$PREFIX" | cut -f1)); $fixed .pc/.cmake files pointed at it"
