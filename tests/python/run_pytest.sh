#!/bin/sh
# Runs the binding's pytest suite (or, with --script, one Python script such
# as run_ddp.py) under one interpreter, and says which interpreter and torch.
# Usage: run_pytest.sh TEST_DIR | run_pytest.sh --script FILE [ARGS...]
# env: STRATA_LIBRARY, PYTHONPATH, and the interpreter:
#   default                 STRATA_TEST_PYTHON, else Debian's /usr/bin/python3
#                           (python3-torch, torch 1.13); without torch or pytest
#                           it says "skipped" (77), never "passed"
#   STRATA_TEST_VENV=torch2 the torch-2 venv of tools/make-venv.sh: the python in
#                           STRATA_TORCH2_PYTHON (./dev.sh test sets it), else the
#                           one made for the current pins; none, or
#                           STRATA_NO_VENV=1: skipped (77) saying why. Its bin/ goes
#                           first on PATH (torchrun) and STRATA_REQUIRE_HF=1 is set:
#                           there the transformers/peft/accelerate/torchvision
#                           tests fail rather than skip; OMP_WAIT_POLICY defaults
#                           to PASSIVE. Not torch 2: a failure.
here=$(cd "$(dirname "$0")" && pwd)
if [ "${STRATA_TEST_VENV:-}" = torch2 ]; then
  if [ "${STRATA_NO_VENV:-}" = 1 ]; then
    echo "STRATA_NO_VENV=1: no torch-2 venv was made: skipped"; exit 77
  fi
  if [ -n "${STRATA_TORCH2_PYTHON:-}" ]; then
    py=$STRATA_TORCH2_PYTHON
    [ -x "$py" ] || { echo "STRATA_TORCH2_PYTHON=$py is not an executable: skipped"; exit 77; }
  else
    py=$("$here/../../tools/make-venv.sh" --find 2>&1) || { echo "$py: skipped"; exit 77; }
  fi
  PATH=$(dirname "$py"):$PATH
  STRATA_REQUIRE_HF=1
  # PyPI's torch 2 (libgomp) spins its OpenMP threads between ops; beside the
  # engine's threads and the other ctest jobs on few cores that made the suite
  # several times slower (resnet18 test: 15 s spinning, 4 s passive, 2.4 s on
  # Debian's 1.13). The wait policy changes no result.
  OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
  # (PyPI torch's float32 sqrt is not correctly rounded on every CPU, whatever
  # MKL_ENABLE_INSTRUCTIONS says: the bitwise tests' oracle, oracle.py,
  # corrects it.)
  export PATH STRATA_REQUIRE_HF OMP_WAIT_POLICY
  v=$("$py" -c 'import torch, pytest; print(torch.__version__)') ||
    { echo "the torch-2 venv's $py cannot import torch and pytest: a broken venv (remove it; tools/make-venv.sh remakes it)"; exit 1; }
  case "$v" in
    2.*) ;;
    *) echo "the torch-2 venv's $py has torch $v, not 2.x"; exit 1 ;;
  esac
else
  py=${STRATA_TEST_PYTHON:-/usr/bin/python3}
  v=$("$py" -c 'import torch, pytest; print(torch.__version__)' 2>/dev/null) ||
    { echo "$py: torch or pytest missing: skipped"; exit 77; }
fi
echo "run_pytest.sh: $py, torch $v"
if [ "${1:-}" = --script ]; then
  shift
  exec "$py" "$@"
fi
exec "$py" -m pytest -q -p no:cacheprovider "$1"
