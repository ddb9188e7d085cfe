#!/usr/bin/env bash
# Makes the torch-2 test environment: a virtual environment of Debian's
# /usr/bin/python3 (never a python3 found on PATH) with the packages pinned,
# every one, in python/requirements-torch2.txt, from PyPI. Prints the venv's
# python on stdout (progress goes to stderr).
#   tools/make-venv.sh          make it unless made; print its python
#   tools/make-venv.sh --find   print its python if made, else say why and exit 1
# Cache: ${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}, outside the
# repository so that a fresh clone reuses it:
#   venv-torch2-KEY      the venv (a link to the folder it was built in), KEY a
#                        hash of the pin file, the interpreter and the machine;
#                        it appears only once the venv is complete
#   wheels/              the pinned wheels (pip's own HTTP cache keeps nothing
#                        when the index sends no caching headers): a changed pin
#                        file rebuilds the venv fetching only the changed ones
# A build goes into a fresh venv-torch2-KEY.build.* folder and is published by
# renaming a link onto it, so a half-made venv is never used; an interrupted
# one is removed by the next run. Building one key removes the others' venvs.
# PyPI's torch brings the CUDA libraries as nvidia-* wheels: a cold build
# fetches about 3 GB; the venv takes 5.7 GB of disk, the wheel cache 2.9 GB.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REQ=$ROOT/python/requirements-torch2.txt
PY=/usr/bin/python3
CACHE=${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}
MODE=make
case "${1:-}" in
  "") ;;
  --find) MODE=find ;;
  *) echo "usage: tools/make-venv.sh [--find]" >&2; exit 2 ;;
esac

die() { echo "make-venv: $*" >&2; exit 1; }
[ -r "$REQ" ] || die "no pin file $REQ"
[ -x "$PY" ] || die "$PY not found (Debian's python3; tools/install-deps.sh installs it)"
# Bumped when this script builds the venv differently, so old ones are not reused.
FORMAT=1
KEY=$( { echo "format $FORMAT"; "$PY" -VV; uname -m; cat "$REQ"; } | sha256sum | cut -c1-16)
NAME=venv-torch2-$KEY
VENV=$CACHE/$NAME
MARK=.strata-venv-complete
WHEELS=$CACHE/wheels

found() { [ -L "$VENV" ] && [ -f "$VENV/$MARK" ] && [ -x "$VENV/bin/python" ]; }

if found; then echo "$VENV/bin/python"; exit 0; fi
if [ "$MODE" = find ]; then
  die "no torch-2 venv for the current pins at $VENV (tools/make-venv.sh or ./dev.sh test makes it)"
fi

"$PY" -c 'import venv, ensurepip' 2>/dev/null ||
  die "$PY has no venv/ensurepip module: install Debian's python3-venv (tools/install-deps.sh does)"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # one builder at a time per cache (other clones and checkouts included)
if found; then echo "$VENV/bin/python"; exit 0; fi  # another run made it meanwhile

# Under the lock: what no link points at is a build that was interrupted.
for d in "$CACHE"/venv-torch2-*.build.*; do
  [ -d "$d" ] || continue
  used=0
  for l in "$CACHE"/venv-torch2-*; do
    [ -L "$l" ] && [ "$(readlink "$l")" = "$(basename "$d")" ] && used=1
  done
  [ $used = 1 ] || { echo "make-venv: removing the unfinished $d" >&2; rm -rf "$d"; }
done

start=$(date +%s)
BUILD=$(mktemp -d "$CACHE/$NAME.build.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT
echo "make-venv: building the torch-2 venv from $REQ into $BUILD (first time: a download of about 3 GB)" >&2
"$PY" -m venv "$BUILD" || die "'$PY -m venv $BUILD' failed"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# Installs from the wheel cache alone (no network) when it holds every pinned
# wheel (pip resolves all before it installs any, so a miss installs nothing);
# else fetches the missing ones into it first (pip download skips those there).
# --no-deps: the pin file is the whole set; pip check below proves it complete.
mkdir -p "$WHEELS"
install() { "$BUILD/bin/python" -m pip install --quiet --no-deps --no-index --find-links "$WHEELS" -r "$REQ"; }
if ! install >/dev/null 2>&1; then
  "$BUILD/bin/python" -m pip download --quiet --no-deps --only-binary=:all: -d "$WHEELS" -r "$REQ" ||
    die "pip download -r $REQ failed (see pip's message above)"
  install || die "pip install -r $REQ from $WHEELS failed (see pip's message above)"
fi
"$BUILD/bin/python" -m pip check >&2 ||
  die "pip check failed: $REQ lacks a dependency or pins clashing versions"
want=$(sed -n 's/^torch==//p' "$REQ")
got=$("$BUILD/bin/python" -c 'import torch, torchvision, transformers, peft, accelerate, pytest, numpy; print(torch.__version__)') ||
  die "the new venv cannot import its packages"
[ "${got%%+*}" = "$want" ] || die "the new venv has torch $got, the pin file says $want"
echo "$KEY" >"$BUILD/$MARK"
# Publish: a link renamed onto the final name (atomic), relative so that it
# names the folder the venv was built in (its scripts' #! lines name that path).
ln -sfn "$(basename "$BUILD")" "$CACHE/.$NAME.link"
mv -T "$CACHE/.$NAME.link" "$VENV"
trap - EXIT
for l in "$CACHE"/venv-torch2-*; do
  [ -L "$l" ] && [ "$l" != "$VENV" ] || continue
  echo "make-venv: removing the venv of other pins $l" >&2
  rm -rf "$CACHE/$(readlink "$l")" "$l"
done
# The wheel cache keeps the current pins' wheels only.
"$PY" - "$REQ" "$WHEELS" <<'PRUNE'
import os, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pins = set()
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, _, version = line.partition("==")
        pins.add((norm(name), version))
for f in os.listdir(sys.argv[2]):
    parts = f.split("-")
    if not (f.endswith(".whl") and len(parts) >= 5 and (norm(parts[0]), parts[1]) in pins):
        print(f"make-venv: removing {f} from the wheel cache (not pinned)", file=sys.stderr)
        os.remove(os.path.join(sys.argv[2], f))
PRUNE
echo "make-venv: made $VENV (torch $got) in $(( $(date +%s) - start )) s;" \
  "venv $(du -sh "$BUILD" | cut -f1), wheel cache $(du -sh "$WHEELS" | cut -f1)" >&2
echo "$VENV/bin/python"
