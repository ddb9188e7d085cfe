#!/bin/sh
# libstrata.so exports the C API and nothing else: every defined dynamic
# symbol is strata_* (besides the version node STRATA_0 of strata.map).
# Usage: symbols_test.sh LIBSTRATA_SO
set -eu
lib=$1
command -v nm >/dev/null || { echo "nm not found: skipped"; exit 77; }
syms=$(nm -D --defined-only "$lib" | awk '{print $NF}' | sed 's/@.*//')
bad=$(printf '%s\n' "$syms" | grep -v -e '^strata_' -e '^STRATA_0$' || true)
count=$(printf '%s\n' "$syms" | grep -c '^strata_')
if [ -n "$bad" ]; then
  echo "symbols other than strata_* leave $lib:"
  printf '%s\n' "$bad" | head -50
  exit 1
fi
test "$count" -ge 15 || { echo "only $count strata_* symbols exported"; exit 1; }
if printf '%s\n' "$syms" | grep -q '^strata_internal_'; then echo "a strata_internal_ symbol leaks"; exit 1; fi
echo "$count symbols, all strata_*"
