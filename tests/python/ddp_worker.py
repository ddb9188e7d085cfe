"""Started by torchrun (2 ranks, Gloo) through run_ddp.py: a small GPT
trained the way a PyTorch user trains it on several ranks — an LR schedule,
clip_grad_norm_, a tied head — with torch DDP + torch.optim.AdamW (the
oracle) and with Strata: offload_module at stage 3 with every state on NVMe,
and OffloadAdam at stages 1 and 2. Each rank takes its half of every global
batch. Strata's ranks start from other seeds on purpose: the engine must
start them from rank 0's values, as DDP does. Checks: the weights and the
gradient norms match the oracle's within TOL (fp32 sums in another order),
every rank holds bitwise the same weights, and the model's state_dict holds
the real weights; offload_module's overlapped step (the default) speculated
and is bitwise overlap_step=False's; its gradients went in parts and are
bitwise those staged whole, and lent (the reduce-scatter reading them
where autograd put them) with every state in host memory; the engine's stats of its collectives (bytes
reduced and gathered, wall and CPU seconds) read through the binding; with
P in host memory or on NVMe and W, M, V on NVMe in units, every step wrote
behind by default (strata.write_behind "auto" at several ranks), bitwise
the same.
Usage: ddp_worker.py WORK_DIR"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import strata.torch as st  # noqa: E402
from tiny_gpt import TinyGpt, batches, loss_of, lr_factor  # noqa: E402

STEPS, BATCH, CLIP, LR, WD = 8, 8, 0.5, 3e-3, 0.01
# fp32: DDP averages each bucket before its all-reduce, Strata sums and then
# scales, and the norms are summed in other orders; Adam's update divides by
# sqrt(v), which magnifies last-bit differences of small gradients. Measured
# at 3e-7 relative to each tensor's largest value; bound 5e-6.
TOL = 5e-6

work = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, BATCH)
failures = []


def local(t):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def check(name, ok, detail=""):
    print(f"rank {rank}: {'ok' if ok else 'FAIL'}: {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


def train(model, opt, sched, forward_model=None):
    norms = []
    for x, y in data:
        opt.zero_grad()
        loss_of(forward_model or model, local(x), local(y)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
    return norms


def reference():
    model = TinyGpt(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor), ddp)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def compare(tag, weights, norms, ref_weights, ref_norms):
    worst = max(((weights[n] - w).abs().max() / w.abs().max()).item() for n, w in ref_weights.items())
    check(f"{tag}: weights match DDP + AdamW", worst <= TOL, f"(max relative difference {worst:.2e})")
    nd = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    check(f"{tag}: gradient norms match", nd <= TOL, f"(max relative difference {nd:.2e})")
    clipped = sum(n > CLIP for n in ref_norms)
    check(f"{tag}: clipping took part", 0 < clipped, f"({clipped} of {STEPS} steps clipped)")
    flat = torch.cat([weights[n].reshape(-1) for n in sorted(ref_weights)])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    check(f"{tag}: every rank holds the same bits", all(torch.equal(e, every[0]) for e in every))


ref_weights, ref_norms = reference()
seed = 0 if rank == 0 else 100 + rank  # rank 0's values must win

# offload_module, stage 3, every state on NVMe.
swap = os.path.join(work, f"swap{rank}")
os.makedirs(swap, exist_ok=True)
cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": swap},
                             "offload_param": {"device": "nvme", "nvme_path": swap}},
       "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
       "strata": {"timeout": 120, "speculation": "always"}}  # the counts below: every step speculates
model = TinyGpt(seed=seed)
off = st.offload_module(model, cfg, force_no_gpu=True)
check("offload_module joined the ranks", (off.rank, off.world_size) == (rank, world), f"{off.rank}/{off.world_size}")
in_parts, engine_part = set(), off.engine.grads_part
off.engine.grads_part = lambda *a, **k: in_parts.add(a[0]) or engine_part(*a, **k)
norms = train(model, off.optimizer, torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor))
trained = [g.index for g in off._groups if not g.frozen]
# Several ranks, overlap_comm (stage 3's default): gradients go to the
# reduction in parts, one group at a time (read where they lie: G is in host memory).
check("gradients went in parts", len(in_parts) > 1 and all(g.takes_parts for g in off._groups if not g.frozen),
      f"({len(in_parts)} of {len(trained)} groups)")
masters = off.master_parameters()
compare("offload_module stage 3 on NVMe", masters, norms, ref_weights, ref_norms)
sd = model.state_dict()
check("state_dict holds the real weights",
      all(torch.equal(sd[n], masters[n]) and sd[n].shape == ref_weights[n].shape for n in ref_weights))
check("state_dict keeps the tied head", torch.equal(sd["head.weight"], sd["wte.weight"]))
# The overlapped step (the default): every step but the first speculated,
# those that clipped replayed; bitwise the run with overlap_step=False.
stats = off.engine.stats()
clipped = sum(n > CLIP for n in norms[1:])
check("offload_module's steps were overlapped",
      (stats["speculated_steps"], stats["replayed_steps"], stats["committed_steps"]) ==
      (STEPS - 1, clipped, STEPS - 1 - clipped) and stats["early_updates"] >= STEPS - 1 - clipped,
      {k: v for k, v in stats.items() if k.endswith("_steps") or k == "early_updates"})
# The collectives' stats, read through the binding's struct: each step
# reduced every trained group's fp32 gradient once (padded to the ranks'
# 2048-element shards), stage 3 gathered P, and the seconds add up.
shard = 2048 * world
padded = sum(-(-g.flat_numel // shard) * shard * 4 for g in off._groups if not g.frozen)
comm = {k: stats[k] for k in ("comm_s", "comm_cpu_s", "reduced_bytes", "gathered_bytes")}
# (P is fp32 here: forward gathers each group once a step at least.)
check("W, M, V on NVMe, G in host memory: the gradients reduced from where they lay",
      stats["lent_reduced_bytes"] == stats["reduced_bytes"], stats["lent_reduced_bytes"])
check("the collectives' stats", comm["reduced_bytes"] == STEPS * padded and comm["gathered_bytes"] >= STEPS * padded and
      0 < comm["comm_cpu_s"] <= comm["comm_s"] * 1.02 + 0.005, f"{comm}, {STEPS} steps of {padded} bytes")
off.close()
model = TinyGpt(seed=seed)
off = st.offload_module(model, cfg, force_no_gpu=True, overlap_step=False)
plain_norms = train(model, off.optimizer, torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor))
plain = off.master_parameters()
check("offload_module overlapped == overlap_step=False, bitwise",
      plain_norms == norms and all(torch.equal(plain[n], masters[n]) for n in masters))
check("overlap_step=False speculated nothing", off.engine.stats()["speculated_steps"] == 0)
off.close()
model = TinyGpt(seed=seed)
off = st.offload_module(model, cfg, force_no_gpu=True)
for g in off._groups:  # each group's gradients staged in Python and handed whole
    g.takes_parts = False
staged_norms = train(model, off.optimizer, torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor))
staged = off.master_parameters()
check("gradients in parts == each group staged whole, bitwise",
      staged_norms == norms and all(torch.equal(staged[n], masters[n]) for n in masters))
off.close()
# Every state in host memory: the gradients are lent (grads_part with
# lend=True), and the reduce-scatter reads them where autograd put them
# (the ranks share this host); the numbers are every state on NVMe's, bitwise.
cfg_host = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "strata": {"timeout": 120}}
model = TinyGpt(seed=seed)
off = st.offload_module(model, cfg_host, force_no_gpu=True)
still_read = []  # at each step: the held groups whose lent gradients the engine may still read
engine_step = off.engine.step


def step_checking(*args, **kwargs):
    still_read.append([g for g in off.engine._lent if off.engine.grads_lent(g)])
    return engine_step(*args, **kwargs)


off.engine.step = step_checking
host_norms = train(model, off.optimizer, torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor))
host = off.master_parameters()
host_stats = off.engine.stats()
check("state in host memory: every reduction read the lent gradients where they lay",
      host_stats["lent_reduced_bytes"] == host_stats["reduced_bytes"] == STEPS * padded,
      {k: host_stats[k] for k in ("lent_reduced_bytes", "reduced_bytes")})
# clip_grad_norm_ waited for the reductions: the engine reads no lent gradient by the step.
check("state in host memory: the reductions were done with every lent gradient by the step",
      len(still_read) == STEPS and not any(still_read), still_read)
check("state in host memory, gradient parts lent == every state on NVMe, bitwise",
      host_norms == norms and all(torch.equal(host[n], masters[n]) for n in masters))
off.close()
# W, M, V on NVMe stepped in units, P in host memory or on NVMe (whose
# gathered copies then stay in memory from step to step): the defaults
# write behind at several ranks (a lost write would fail every rank's next
# step together); the numbers are those of every state on NVMe, bitwise.
for param_dev in ("cpu", "nvme"):
    swap_wb = os.path.join(work, f"swap_wb{param_dev}{rank}")
    os.makedirs(swap_wb, exist_ok=True)
    cfg_wb = {"zero_optimization": {"stage": 3, "sub_group_size": 2048,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": swap_wb},
                                    "offload_param": {"device": param_dev, "nvme_path": swap_wb}},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "strata": {"timeout": 120}}
    model = TinyGpt(seed=seed)
    off = st.offload_module(model, cfg_wb, force_no_gpu=True)
    wb_norms = train(model, off.optimizer, torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor))
    wb = off.master_parameters()
    wb_steps = off.engine.stats()["write_behind_steps"]
    check(f"P on {param_dev}, W, M, V on NVMe in units: every step wrote behind (write_behind auto, two ranks)",
          wb_steps == STEPS, f"write_behind_steps {wb_steps} of {STEPS}")
    check(f"P on {param_dev}, W, M, V on NVMe in units == every state on NVMe, bitwise",
          wb_norms == norms and all(torch.equal(wb[n], masters[n]) for n in masters))
    off.close()

# OffloadAdam, stages 1 and 2, optimizer state in host memory.
for stage in (1, 2):
    model = TinyGpt(seed=seed)
    opt = st.OffloadAdam(model.parameters(), lr=LR, weight_decay=WD, force_no_gpu=True,
                         config={"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
                                 "strata": {"timeout": 120}})
    check(f"OffloadAdam stage {stage} joined the ranks", (opt.rank, opt.world_size) == (rank, world))
    norms = train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor))
    compare(f"OffloadAdam stage {stage}", {n: p.detach() for n, p in model.named_parameters()}, norms, ref_weights,
            ref_norms)
    opt.close()

dist.barrier()
dist.destroy_process_group()
sys.exit(1 if failures else 0)
