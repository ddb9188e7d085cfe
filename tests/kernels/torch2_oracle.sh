#!/bin/sh
# kernels_adam_torch_oracle under torch 2 (moment_update "lerp"): the venv of
# tools/make-venv.sh, or skipped (77) saying why.   usage: this.sh <script> <driver>
root=$(cd "$(dirname "$0")/../.." && pwd)
if [ ! -x "$root/tools/make-venv.sh" ]; then
  echo "skipped: no tools/make-venv.sh to find the torch-2 venv"
  exit 77
fi
py=$("$root/tools/make-venv.sh" --find) || { echo "skipped: no torch-2 venv (./dev.sh test or tools/make-venv.sh makes it)"; exit 77; }
# PyPI torch's float32 sqrt is not correctly rounded on every CPU: the script
# corrects it (tests/python/oracle.py), so no MKL or ATen setting is needed.
exec "$py" "$@"
