"""Peak host memory (RSS) of 5 training steps of a 33M-parameter MLP with
plain torch AdamW, OffloadAdam with its state in host memory, and
OffloadAdam with its state on NVMe, each in a fresh process.
Usage: host_memory.py NVME_DIR"""
import json
import os
import resource
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
import strata.torch as st
mode, swap = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
if mode == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
else:
    dev = {"cpu": {"device": "cpu"}, "nvme": {"device": "nvme", "nvme_path": swap}}[mode]
    opt = st.OffloadAdam(model.parameters(), lr=1e-3, force_no_gpu=True,
                         config={"zero_optimization": {"stage": 1, "offload_optimizer": dev}})
x = torch.randn(16, 2048)
for _ in range(5):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
print(json.dumps({"mode": mode, "params": sum(p.numel() for p in model.parameters()),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

swap = sys.argv[1]
os.makedirs(swap, exist_ok=True)
out = {}
for mode in ("torch", "cpu", "nvme"):
    p = subprocess.run([sys.executable, "-c", CHILD, mode, swap], capture_output=True, text=True, check=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    out[mode] = r["peak_rss_mib"]
    print(f"{mode:5s} params={r['params']} peak_rss={r['peak_rss_mib']:.0f} MiB")
print(f"host_memory torch_mib={out['torch']:.0f} cpu_mib={out['cpu']:.0f} nvme_mib={out['nvme']:.0f} "
      f"nvme_over_cpu={out['nvme'] / out['cpu']:.2f}")
