"""One of the 2 ranks that test_fp16_loss_scale.py starts (the launcher's
variables set, as torchrun sets them): OffloadAdam with fp16 and two param
groups (two engines) trains the fp16 MLP on this rank's batches; rank 1's
bias gradients overflow at one step. Saves the parameters, the optimizer's
state (masters and moments), the loss scale before each step and each
step's skipped flags (per engine) to OUT.
Usage: fp16_ranks_worker.py OUT"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import strata.torch as st  # noqa: E402
from test_fp16_loss_scale import (FP16, INF_RANK, INF_STEP, LR, STEPS, WD, HalfMlp, mlp_batches,  # noqa: E402
                                  mlp_loss, nonzero_wd, with_inf)

rank = int(os.environ["RANK"])
model = HalfMlp().half()
opt = st.OffloadAdam(nonzero_wd(model), lr=LR, weight_decay=WD, force_no_gpu=True,
                     config={"fp16": FP16, "zero_optimization": {"stage": 1}})
scales, skipped = [], []
for s, (x, y) in enumerate(mlp_batches(STEPS, seed=10 + rank)):
    scales.append(opt.loss_scale)
    hook = with_inf(model, "fc2.bias", rank == INF_RANK and s == INF_STEP)
    opt.backward(mlp_loss(model, x, y))
    if hook is not None:
        hook.remove()
    opt.step()
    skipped.append([k for _, k in opt.last_results])
    opt.zero_grad()
torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "scales": scales,
            "skipped": skipped, "engines": len(opt._engines), "state": opt.state_dict()["state"]}, sys.argv[1])
opt.close()
