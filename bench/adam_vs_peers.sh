#!/usr/bin/env bash
# Adam step throughput vs the memory bound of its seven streams and vs
# torch.optim.AdamW(foreach=True), all in one run (see bench/kernels/adam_bench.cpp).
# Last line: `adam_vs_peers bound_ratio=B torch_ratio=T compact_bound_ratio=C` for the
# best ISA path; C is the compact-state step (kernels/cpu/compact.h) against a
# streaming loop over its own 12.5 bytes a parameter, run on the same threads.
# Env: BUILD_DIR (default ./build), PYTHON (default /usr/bin/python3, which has torch).
# Extra arguments go to adam_bench (--n, --rounds, --steps).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
PYTHON="${PYTHON:-/usr/bin/python3}"
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$BUILD_DIR" --target adam_bench >/dev/null
WORKER="$ROOT/bench/kernels/torch_adamw_worker.py"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "adam_vs_peers: $PYTHON has no torch; torch_ratio will be nan" >&2
  WORKER=""
fi
exec "$BUILD_DIR/bench/kernels/adam_bench" --python "$PYTHON" ${WORKER:+--torch-worker "$WORKER"} "$@"
