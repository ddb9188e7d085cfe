#!/usr/bin/env bash
# Downloads (apt-get download, nothing installed) the Debian packages pinned in
# tools/gpu-deps.list into .gpu-debs/ (ignored by git), with a MANIFEST of
# versions, sizes and sha256 sums. The GPU machines cannot download; the
# device tool carries the folder when told (carry: [".gpu-debs"]) and
# tools/gpu-check.sh unpacks it into a private prefix.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
LIST=$ROOT/tools/gpu-deps.list
DEST=$ROOT/.gpu-debs
LIMIT_MB=60  # the device tool carries 64 MiB in all, the checkout included

usage() {
  cat <<EOF
Usage: tools/pack-gpu-deps.sh [--update] [--dest DIR] [--list FILE]
  Downloads every package=version of tools/gpu-deps.list into DIR
  (default .gpu-debs/) and writes DIR/MANIFEST; fails, naming it, on any
  package that apt cannot download at its pinned version.
  --update   first re-pin tools/gpu-deps.list to apt's candidate versions
             (commit the change), then download
  --dest DIR download into DIR instead
  --list F   read the pins from F instead of tools/gpu-deps.list
Needs apt-get with current lists (apt-get update) on Debian 12, amd64.
EOF
}

update=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --update) update=1 ;;
    --dest) DEST=${2:?--dest needs a folder}; shift ;;
    --list) LIST=${2:?--list needs a file}; shift ;;
    *) echo "pack-gpu-deps: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
say() { echo "pack-gpu-deps: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
command -v apt-get >/dev/null || die "apt-get is not on this machine"
[ "$(dpkg --print-architecture)" = amd64 ] || die "the GPU machines are amd64; this is $(dpkg --print-architecture)"

# Pinned lines: "package=version", with comments after '#'.
pins() { sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$'; }

if [ $update -eq 1 ]; then
  tmp=$(mktemp)
  while IFS= read -r line; do
    spec=$(echo "$line" | sed -e 's/#.*//' -e 's/[[:space:]]//g')
    if [ -z "$spec" ]; then echo "$line"; continue; fi
    pkg=${spec%%=*}
    cand=$(apt-cache policy "$pkg" | sed -n 's/^  Candidate: //p')
    if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then die "$pkg: apt knows no candidate version (apt-get update?)"; fi
    [ "$spec" = "$pkg=$cand" ] || say "re-pinned ${spec} -> $pkg=$cand"
    echo "$pkg=$cand"
  done <"$LIST" >"$tmp"
  mv "$tmp" "$LIST"
fi

# Download into a fresh folder beside DEST, then swap: a failed run leaves the
# previous pack as it was.
mkdir -p "$(dirname "$DEST")"
work=$(mktemp -d "$(dirname "$DEST")/.gpu-debs.new.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=()
n=0
while IFS= read -r spec; do
  n=$((n + 1))
  if ! (cd "$work" && apt-get download -q -o APT::Sandbox::User=root "$spec" >"$work/.log" 2>&1); then
    say "cannot download $spec: $(grep -E '^(E|W):' "$work/.log" | head -2 | tr '\n' ' ')"
    failed+=("$spec")
  fi
done < <(pins)
rm -f "$work/.log"
[ ${#failed[@]} -eq 0 ] ||
  die "${#failed[@]} of $n packages could not be downloaded: ${failed[*]} (apt-get update; or --update to re-pin)"

# The MANIFEST: what each .deb says it is, checked against its pin.
{
  echo "# package version arch bytes sha256 file -- written by tools/pack-gpu-deps.sh $(date -u +%FT%TZ)"
  while IFS= read -r spec; do
    pkg=${spec%%=*} ver=${spec#*=}
    matches=()
    for f in "$work"/*.deb; do
      [ "$(dpkg-deb -f "$f" Package)" = "$pkg" ] && matches+=("$f")
    done
    [ ${#matches[@]} -eq 1 ] || die "$pkg: expected one .deb, found ${#matches[@]}"
    f=${matches[0]}
    got=$(dpkg-deb -f "$f" Version)
    [ "$got" = "$ver" ] || die "$pkg: downloaded version $got, pinned $ver"
    echo "$pkg $ver $(dpkg-deb -f "$f" Architecture) $(stat -c %s "$f") $(sha256sum "$f" | cut -d' ' -f1) $(basename "$f")"
  done < <(pins)
} >"$work/MANIFEST"

bytes=$(awk '!/^#/{s+=$4} END{print s}' "$work/MANIFEST")
mb=$(( (bytes + 1048575) / 1048576 ))
[ "$mb" -le "$LIMIT_MB" ] || die "the pack is $mb MiB, over the $LIMIT_MB MiB the device tool can carry"
rm -rf "$DEST"
mv "$work" "$DEST"
trap - EXIT
say "$n packages, $mb MiB in $DEST (MANIFEST written); run the GPU check with carry [\"$(realpath --relative-to="$ROOT" "$DEST" 2>/dev/null || echo "$DEST")\"]"
