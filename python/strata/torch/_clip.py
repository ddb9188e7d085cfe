"""clip_grad_norm_ for OffloadAdam and OffloadedModule: torch's norms
(per gradient, total) as this torch takes them, the engine's clip for
torch's coefficient, and torch.nn.utils.clip_grad_norm_ patched to send
their parameters to them (_OWNERS says whose a parameter is);
clip_grad_value_ patched to refuse offload_module's.
"""

import math
import weakref

import torch

from .. import Error, INVALID
from . import _fetch_on_use as _fou
from ._config import _TORCH2

# id(parameter) -> its OffloadAdam or OffloadedModule (weakly): the patched
# torch.nn.utils.clip_grad_norm_ sends their parameters to them.
_OWNERS = weakref.WeakValueDictionary()


def _check_clip_args(max_norm, norm_type):
    if float(norm_type) != 2.0:
        raise Error(INVALID, f"clip_grad_norm_: norm_type {norm_type}; only the L2 norm (2.0) is supported")
    if float(max_norm) < 0:
        raise Error(INVALID, f"clip_grad_norm_: max_norm {max_norm} is negative")


def _clip_result(norm, norm_type, error_if_nonfinite):
    """torch's return value (and error) for the engine's norm."""
    if error_if_nonfinite and not torch.isfinite(torch.tensor(norm)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return torch.tensor(norm)


def _torch_norm_of(g):
    """The L2 norm of one gradient as this torch's clip_grad_norm_ takes it
    (2.x: _foreach_norm where it has foreach support, else vector_norm;
    1.13: torch.norm), so that a norm made of these is bitwise torch's."""
    if _TORCH2:
        try:
            from torch.utils._foreach_utils import _has_foreach_support
            if _has_foreach_support([g], g.device):
                return torch._foreach_norm([g], 2.0)[0]
        except ImportError:
            pass
        return torch.linalg.vector_norm(g, 2.0)
    return torch.norm(g.detach(), 2.0)


def _torch_total_norm(norms):
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    return torch.linalg.vector_norm(stacked, 2.0) if _TORCH2 else torch.norm(stacked, 2.0)


# The smallest positive double. As the engine's max_grad_norm it clips, and
# its coefficient clip / (norm + 1e-6) is at most 5e-324 / 1e-6, which the
# kernels' float32 factor (coefficient / (loss scale * mean), the loss scale
# >= 2^-24) rounds to exactly 0: torch's coefficient at max_norm 0. (0 itself
# is the engine's "no clipping".)
_ZERO_CLIP = math.ulp(0.0)


def _engine_max_norm(max_norm):
    """The engine's max_grad_norm for clip_grad_norm_'s max_norm where the
    engine takes the norm itself (several ranks, several backward passes a
    step), so that it clips as torch: max_norm 0 zeroes the gradients
    (torch's coefficient 0 / (norm + 1e-6) = 0; the engine would read 0 as
    no clipping), infinity clips nothing (torch's coefficient clamps to 1;
    the engine refuses an infinite max_grad_norm)."""
    m = float(max_norm)
    if m == 0:
        return _ZERO_CLIP
    if m == math.inf:
        return 0.0
    return m


def _engine_clip_for(coef, engine_norm):
    """The max_grad_norm that makes the engine scale the gradients by
    exactly `coef` (a float32 value below 1): the engine takes
    clip / (norm + 1e-6) in double and its kernels multiply by it in
    float32, as torch multiplies by its float32 clip_coef. A coefficient of
    0 (torch's at max_norm 0) is the smallest positive max_grad_norm: 0 is
    the engine's "no clipping"."""
    import numpy as np
    target = np.float32(coef)
    if target == 0:
        return _ZERO_CLIP
    clip = float(target) * (engine_norm + 1e-6)
    for _ in range(4):
        got = np.float32(clip / (engine_norm + 1e-6))
        if got == target:
            return clip
        clip = float(np.nextafter(clip, np.inf if got < target else -np.inf))
    raise Error(INVALID, f"clip_grad_norm_: cannot express torch's clip coefficient {float(target)!r} "
                f"for the engine's norm {engine_norm!r}")


# ---- torch.nn.utils.clip_grad_norm_ ---------------------------------------------

_torch_clip_grad_norm = torch.nn.utils.clip_grad_norm_


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, **kwargs):
    """torch.nn.utils.clip_grad_norm_, which for the parameters of an
    OffloadedModule (whose gradients are in the engine, not in .grad) calls
    its clip_grad_norm_; any other parameters go to torch's own."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(o): o for o in (_OWNERS.get(id(p)) for p in params) if o is not None}
    if not owners:
        return _torch_clip_grad_norm(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                                     **kwargs)
    owner = next(iter(owners.values()))
    others = [p for p in params if _OWNERS.get(id(p)) is None and p.grad is not None]
    mine = {id(p) for p in params if _OWNERS.get(id(p)) is owner}
    if len(owners) > 1 or others or mine != owner._clip_ids():
        raise Error(INVALID, "clip_grad_norm_: the parameters must be all those of one OffloadAdam or "
                    "offload_module (their norm is the engine's, over every rank), without others that have "
                    "gradients")
    return owner.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, params=params)


torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_


# ---- torch.nn.utils.clip_grad_value_ --------------------------------------------

_torch_clip_grad_value = torch.nn.utils.clip_grad_value_


def _clip_grad_value_(parameters, clip_value, *args, **kwargs):
    """torch.nn.utils.clip_grad_value_, which refuses the trainable
    parameters of an offload_module: their gradients go to the engine and
    never stay in .grad, so torch's would clip nothing, without a word. Any
    other parameters (OffloadAdam's keep .grad) go to torch's own."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for p in params:
        if _fou.is_offloaded(p) and p.requires_grad:
            raise Error(INVALID, f"clip_grad_value_: parameter '{_fou._OFFLOADED[id(p)][3]}' is under "
                        "strata.torch.offload_module, whose gradients go to the engine and never to .grad: "
                        "nothing would be clipped. Clip by norm instead: the config's gradient_clipping, or "
                        "torch.nn.utils.clip_grad_norm_ (which offload_module clips with)")
    return _torch_clip_grad_value(params, clip_value, *args, **kwargs)


torch.nn.utils.clip_grad_value_ = _clip_grad_value_
torch.nn.utils.clip_grad.clip_grad_value_ = _clip_grad_value_
