#!/usr/bin/env bash
# engine/'s folders include only folders below them (docs/architecture.md):
#   config, stats, format   (the bottom: nothing of engine/ but themselves)
#   layout                  config stats format
#   residency, reduce, step layout and below (never one another)
#   activations             stats (the tiers below engine/; nothing of the state's layout)
#   checkpoint              step reduce layout and below
#   engine/*.{h,cpp}        the composition: any of the above
#   capi                    the C API: engine.h and below, never engine_impl.h
# A component that reaches up (or sideways) fails here, naming the include;
# so does a file of engine/ over 600 lines (DESIGN.md: one concern per file).
# Usage: layers_test.sh SOURCE_DIR
set -euo pipefail
root=${1:?usage: layers_test.sh SOURCE_DIR}
cd "$root/engine"
declare -A allowed=(
  [config]="config" [stats]="stats" [format]="format"
  [layout]="layout config stats format"
  [residency]="residency layout config stats format"
  [reduce]="reduce layout config stats format"
  [step]="step layout config stats format"
  [activations]="activations stats"
  [checkpoint]="checkpoint step reduce layout config stats format"
  [capi]="capi TOP:engine.h config stats format layout residency reduce step checkpoint activations"
  [TOP]="config stats format layout residency reduce step checkpoint activations TOP"
)
bad=0 checked=0
for f in $(find . -name '*.h' -o -name '*.cpp' | sort); do
  f=${f#./}
  folder=TOP
  [[ $f == */* ]] && folder=${f%%/*}
  if [ -z "${allowed[$folder]+x}" ]; then echo "layers: engine/$folder/ is a folder the rules do not name"; bad=1; continue; fi
  while IFS= read -r inc; do
    checked=$((checked + 1))
    path=${inc#engine/}
    if [[ $path == */* ]]; then to=${path%%/*}; else to=TOP; fi
    ok=0
    for a in ${allowed[$folder]}; do
      if [ "$a" = "$to" ] || [ "$a" = "TOP:$path" ]; then ok=1; fi
    done
    if [ $ok = 0 ]; then
      echo "layers: engine/$f includes \"$inc\": $folder/ may include only: ${allowed[$folder]}"
      bad=1
    fi
  done < <(grep -ho '^#include "engine/[^"]*"' "$f" | sed 's/#include "//; s/"$//')
done
while read -r n f; do
  [ "$f" = total ] && continue
  if [ "$n" -gt 600 ]; then echo "layers: engine/${f#./} has $n lines (at most 600: split it by concern)"; bad=1; fi
done < <(find . -name '*.h' -o -name '*.cpp' | xargs wc -l)
[ "$checked" -gt 50 ] || { echo "layers: only $checked includes checked: the scan is broken"; exit 1; }
[ $bad = 0 ] && echo "layers: $checked includes of engine/ follow the layers"
exit $bad
