#!/usr/bin/env bash
# The SIMD optimizer paths prefetch their streams ahead (worth 10-20% of a
# memory-bound Adam step). Nothing numeric can notice when the compiler drops them —
# GCC 12 once deleted the helper's calls as free of side effects — so look at
# the machine code: every SIMD optimizer object in the library must hold
# prefetcht0.
# Usage: prefetch_emitted_test.sh libstrata_kernels_cpu.a
set -euo pipefail
lib=${1:?usage: prefetch_emitted_test.sh LIBRARY}
command -v objdump >/dev/null || { echo "skipped: no objdump"; exit 77; }
status=0
for member in {adam,lion,adagrad,compact}_{avx2,avx512}.cpp.o; do
  n=$(objdump -d "$lib" | awk -v m="$member" '
        /file format/ { inside = index($0, m) > 0; next }
        inside && /prefetcht0/ { n++ }
        END { print n + 0 }')
  if [ "$n" -eq 0 ]; then
    echo "FAIL: $member in $lib has no prefetcht0: its prefetches were compiled away"
    status=1
  else
    echo "ok: $member has $n prefetcht0"
  fi
done
exit $status
