"""One rank of hosts_test.sh's torch mode, started by torchrun (on one host,
or on several with --nnodes): the small GPT of tests/python/tiny_gpt.py
through strata.torch.offload_module at ZeRO stage 3 with every state on NVMe,
in state_format fp32 (fp32 compute) and then compact (bf16 compute, as it
requires), each rank training on its slice of
every global batch. No torch.distributed: the engine finds the ranks from
torchrun's variables. Writes OUT/<format>.r<rank>: the SHA-256 of the master
weights (sorted by name) and this rank's losses, for the test to compare
bitwise. Usage: torch_worker.py OUT SWAP_FOLDER"""
import hashlib
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
import strata.torch as st  # noqa: E402
from tiny_gpt import TinyGpt, batches, loss_of  # noqa: E402

STEPS, BATCH = 4, 8
torch.set_num_threads(1)  # the same kernels' sums on every host and in the reference
out, swap = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.makedirs(out, exist_ok=True)
for fmt in ("fp32", "compact"):
    folder = os.path.join(swap, f"{fmt}-r{rank}")
    os.makedirs(folder, exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": folder}
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "strata": {"timeout": 60, "state_format": fmt},
           # compact keeps the parameters as the master's bf16 half: bf16 compute.
           "bf16": {"enabled": fmt == "compact"}}
    model = TinyGpt(seed=0)
    off = st.offload_module(model, cfg, force_no_gpu=True)
    assert (off.rank, off.world_size) == (rank, world), (off.rank, off.world_size, rank, world)
    losses = []
    for x, y in batches(STEPS, BATCH):
        n = x.shape[0] // world
        off.optimizer.zero_grad()
        loss = loss_of(model, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        loss.backward()
        off.optimizer.step()
        losses.append(loss.item())
    masters = off.master_parameters()
    h = hashlib.sha256()
    for name in sorted(masters):
        h.update(masters[name].detach().contiguous().numpy().tobytes())
    off.close()
    with open(os.path.join(out, f"{fmt}.r{rank}"), "w") as f:
        f.write(h.hexdigest() + " " + " ".join(repr(v) for v in losses) + "\n")
    print(f"rank {rank} of {world}: {fmt}: weights sha256 {h.hexdigest()[:16]}", flush=True)
