"""Runs ddp_worker.py under torchrun with 2 ranks on a free port; exits 77
(skipped) when torch, torchrun or Gloo is missing. Usage: run_ddp.py"""
import os
import shutil
import socket
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
torchrun = shutil.which("torchrun")
if torchrun is None:
    print("torchrun not found: skipped")
    sys.exit(77)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
work = tempfile.mkdtemp(prefix="strata-ddp-", dir="/var/tmp")
try:
    here = os.path.dirname(os.path.abspath(__file__))
    # --redirects/--tee given: Debian's torch 1.13 under Python 3.11 fails on
    # their defaults ("0": IntFlag no longer lists the zero flag).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
           "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), os.path.join(here, "ddp_worker.py"), work]
    p = subprocess.run(cmd, timeout=900)
    sys.exit(p.returncode)
finally:
    shutil.rmtree(work, ignore_errors=True)
