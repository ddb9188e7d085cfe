#!/bin/sh
# kernels_adam_torch_oracle under torch 2 (moment_update "lerp"): the venv of
# tools/make-venv.sh, or skipped (77) saying why.   usage: this.sh <script> <driver>
root=$(cd "$(dirname "$0")/../.." && pwd)
if [ ! -x "$root/tools/make-venv.sh" ]; then
  echo "skipped: no tools/make-venv.sh to find the torch-2 venv"
  exit 77
fi
py=$("$root/tools/make-venv.sh" --find) || { echo "skipped: no torch-2 venv (./dev.sh test or tools/make-venv.sh makes it)"; exit 77; }
# MKL's AVX-512 float32 sqrt (PyPI's x86 wheels, on AVX-512 CPUs) rounds about
# 0.6% of results 1 ulp away from IEEE's; its AVX2 code is IEEE's, and the
# comparison then bitwise throughout (the script alone falls back to bitwise
# moments and a param within 1e-6 where torch's sqrt is not IEEE's).
MKL_ENABLE_INSTRUCTIONS=AVX2 exec "$py" "$@"
