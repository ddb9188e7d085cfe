#!/bin/sh
# Runs the binding's pytest suite with Debian's python3 (which has
# python3-torch); says "skipped" (77) when torch or pytest is missing.
# Usage: run_pytest.sh TEST_DIR   (env: STRATA_LIBRARY, PYTHONPATH)
py=/usr/bin/python3
"$py" -c 'import torch, pytest' 2>/dev/null || { echo "python3-torch or pytest missing: skipped"; exit 77; }
exec "$py" -m pytest -q -p no:cacheprovider "$1"
