"""A small GPT trained on 2 ranks with its parameters and optimizer state on
NVMe, the way a PyTorch user trains: torch.distributed, an LR schedule,
clip_grad_norm_, a tied head, torch.save of model and optimizer.

    torchrun --nproc_per_node 2 --redirects 1 --tee 1 python/examples/torchrun_gpt.py [SWAP_FOLDER]

SWAP_FOLDER: by default /var/tmp/strata-swap-<uid> (on disk: /tmp is often tmpfs, memory), made mode 0700.
(--redirects/--tee: Debian 12's torch 1.13 needs them under Python 3.11.)"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import strata.torch

swap = sys.argv[1] if len(sys.argv) > 1 else f"/var/tmp/strata-swap-{os.getuid()}"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
os.makedirs(swap, mode=0o700, exist_ok=True)
if len(sys.argv) == 1 and os.stat(swap).st_uid != os.getuid():
    sys.exit(f"{swap} is another user's: name a folder of yours")

vocab, dim = 96, 64
model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 4 * dim),
                            torch.nn.GELU(), torch.nn.Linear(4 * dim, dim), torch.nn.Linear(dim, vocab, bias=False))
model[5].weight = model[0].weight  # the head tied to the embedding

off = strata.torch.offload_module(model, {
    "zero_optimization": {"stage": 3,
                          "offload_param": {"device": "nvme", "nvme_path": swap},
                          "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}})
opt = off.optimizer  # a torch.optim.Optimizer
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)

torch.manual_seed(1234)  # the same global batches on every rank
for step in range(20):
    tokens = torch.randint(0, vocab, (8, 17))
    mine = tokens[rank * 8 // world:(rank + 1) * 8 // world]  # this rank's half
    logits = model(mine[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), mine[:, 1:].reshape(-1))
    loss.backward()  # gradients go to the engine; it averages them over the ranks
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    if rank == 0 and step % 5 == 0:
        print(f"step {step} loss {loss.item():.4f} grad norm {norm.item():.4f}")

state = {"model": model.state_dict(), "optimizer": opt.state_dict()}  # every rank calls these
if rank == 0:
    torch.save(state, os.path.join(swap, "gpt.pt"))
    print("saved", sum(t.numel() for t in state["model"].values()), "model values to", os.path.join(swap, "gpt.pt"))
off.close()
dist.destroy_process_group()
