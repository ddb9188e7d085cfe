"""Runs a script under torchrun with 2 ranks on a free port, its one
argument a fresh work folder; exits 77 (skipped) when torch, torchrun or
Gloo is missing. With --expect FILE, FILE must then exist in the folder.
Usage: run_ddp.py [SCRIPT [--expect FILE]]   (default: ddp_worker.py)"""
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        raise ImportError("torch.distributed with Gloo")
except ImportError as e:
    print(f"{e}: skipped")
    sys.exit(77)
if shutil.which("torchrun") is None:
    print("torchrun not found: skipped")
    sys.exit(77)
here = os.path.dirname(os.path.abspath(__file__))
script = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "ddp_worker.py")
expect = sys.argv[sys.argv.index("--expect") + 1] if "--expect" in sys.argv else None
# torch's store on port, each multi-rank Strata engine's on port + 1 + k.
sys.path.insert(0, os.path.dirname(here))
from free_ports import free_port_block  # noqa: E402
port = free_port_block(64)
work = tempfile.mkdtemp(prefix="strata-ddp-", dir="/var/tmp")
try:
    # --redirects/--tee given: Debian's torch 1.13 under Python 3.11 fails on
    # their defaults ("0": IntFlag no longer lists the zero flag).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
           "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), script, work]
    p = subprocess.run(cmd, timeout=900)
    if p.returncode == 0 and expect and not os.path.exists(os.path.join(work, expect)):
        print(f"{script} exited 0 but wrote no {expect}")
        sys.exit(1)
    sys.exit(p.returncode)
finally:
    shutil.rmtree(work, ignore_errors=True)
