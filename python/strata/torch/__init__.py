"""PyTorch on Strata: an optimizer whose state lives in Strata's tiers, and
ZeRO-3-style parameter offload with module hooks.

    opt = strata.torch.OffloadAdam(model.parameters(), lr=1e-3, config={...})
    ... loss.backward(); opt.step(); opt.zero_grad()

    off = strata.torch.offload_module(model, config={...})
    opt = off.optimizer                      # a torch.optim.Optimizer: LR schedulers drive it
    ... loss = model(x).sum(); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # works: see below
    opt.step()

fp16 (config "fp16": {"enabled": true}): the loss is scaled by the loss
scale, DeepSpeed's way: off.backward(loss) / opt.backward(loss) (or
scale_loss(loss).backward()); a plain loss.backward() is refused, unless
loss_scaled=True says the code multiplies by loss_scale itself.

Ranks. Both join the ranks of the job: `rank=`/`world_size=` when given,
else torch.distributed when it is initialized, else the launcher's variables
(torchrun, then OpenMPI, then Slurm: the order the C library reads them);
conflicting answers are an error, never a silent single rank. State is then
partitioned as the config's zero_optimization.stage says, every rank starts
from rank 0's parameter values (as torch DDP), and gradients are averaged
over the ranks and over grad_accumulation_steps (strata.grad_reduce "mean",
the default: DDP's semantics; "sum" sums them). Calls that read or write
the state (state_dict, load_state_dict, clip_grad_norm_, step) are
collectives: every rank makes them, in the same order.

The package has one concern a module (docs/architecture.md, "The Python
layer", says which owns what).
"""

from . import _clip  # noqa: F401  (patches torch.nn.utils.clip_grad_norm_)
from ._activations import offload_activations  # noqa: F401
from ._api import is_fetched, offload_module
from ._config import _resolve_ranks  # noqa: F401  (tests reach it)
from ._offload_adam import OffloadAdam
from ._offload_optimizer import OffloadOptimizer
from ._offloaded_module import OffloadedModule

__all__ = ["OffloadAdam", "offload_module", "OffloadedModule", "OffloadOptimizer", "is_fetched", "offload_activations"]
