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
"""

import copy
import itertools
import json
import math
import os
import shutil
import warnings
import weakref

import torch

from . import _sizing
from . import Engine, Error, INVALID, STATE
from . import _fetch_on_use as _fou

__all__ = ["OffloadAdam", "offload_module", "OffloadedModule", "OffloadOptimizer", "is_fetched"]


def _with_state_format(config, state_format):
    """config with strata.state_format set to `state_format` ("fp32" or
    "compact"; None keeps the config's). A config that names another is an
    error, not a silent choice."""
    if state_format is None:
        return config
    if state_format not in ("fp32", "compact"):
        raise ValueError(f"state_format={state_format!r}: not one of 'fp32', 'compact'")
    strata_keys = config.setdefault("strata", {})
    if strata_keys.get("state_format", state_format) != state_format:
        raise ValueError(f"state_format={state_format!r} differs from the config's strata.state_format "
                         f"{strata_keys['state_format']!r}; give one")
    strata_keys["state_format"] = state_format
    return config


def _config_dict(config):
    if config is None:
        return {}
    return copy.deepcopy(json.loads(config) if isinstance(config, str) else config)


# id(parameter) -> its OffloadAdam or OffloadedModule (weakly): the patched
# torch.nn.utils.clip_grad_norm_ sends their parameters to them.
_OWNERS = weakref.WeakValueDictionary()


# ---- Ranks --------------------------------------------------------------------

# The launchers' variables, in the order the C library reads them.
_LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE"), ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("slurm", "SLURM_PROCID", "SLURM_NTASKS"))


def _env_ranks():
    """(rank, world_size, source) from the first launcher whose variables are
    set, or None."""
    for source, rv, wv in _LAUNCHERS:
        if rv in os.environ or wv in os.environ:
            try:
                return int(os.environ[rv]), int(os.environ[wv]), source
            except (KeyError, ValueError):
                raise Error(INVALID, f"{source} launch variables are incomplete or not integers: "
                            f"{rv}={os.environ.get(rv)!r} {wv}={os.environ.get(wv)!r}") from None
    return None


def _resolve_ranks(rank, world_size, who):
    """This process's (rank, world_size) for an engine: rank=/world_size=,
    else torch.distributed, else the launcher's variables, else (0, 1). Every
    source that speaks must agree."""
    if (rank is None) != (world_size is None):
        raise Error(INVALID, f"{who}: give both rank= and world_size=, or neither (got rank={rank!r}, "
                    f"world_size={world_size!r})")
    sources = []
    if rank is not None:
        sources.append((int(rank), int(world_size), "rank=/world_size="))
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        sources.append((dist.get_rank(), dist.get_world_size(), "torch.distributed"))
    env = _env_ranks()
    if env is not None:
        sources.append(env)
    if not sources:
        return 0, 1
    r, w, src = sources[0]
    if not (w >= 1 and 0 <= r < w):
        raise Error(INVALID, f"{who}: {src} gives rank {r} of world size {w}, which is not a rank")
    for r2, w2, src2 in sources[1:]:
        if (r2, w2) != (r, w):
            raise Error(INVALID, f"{who}: {src} says rank {r} of {w} but {src2} says rank {r2} of {w2}")
    if w > 1 and env is None:
        raise Error(INVALID, f"{who}: rank {r} of {w} ({src}) but no launcher variables are set (torchrun's RANK, "
                    "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; or OpenMPI's; or "
                    "Slurm's): the engines of the ranks meet through them")
    return r, w


_engines_with_ranks = itertools.count()  # multi-rank engines made by this process


def _new_engine(cfg, rank, world_size, **kw):
    """An Engine; with several ranks each engine of the process gets its own
    rendezvous port (STRATA_STORE_PORT, or the C library's default, plus the
    engine's ordinal: ranks make their engines in the same order), one above
    MASTER_PORT when torch.distributed holds that port itself."""
    if world_size <= 1:
        return Engine(cfg, rank=rank, world_size=world_size, **kw)
    k = next(_engines_with_ranks)
    user = os.environ.get("STRATA_STORE_PORT")
    if user is not None:
        base = int(user)
    else:
        master = int(os.environ.get("MASTER_PORT", "29500"))
        dist = torch.distributed
        held = dist.is_available() and dist.is_initialized()
        base = master + (1 if held or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0)
    port = base + k
    if port > 65535:
        raise Error(INVALID, f"rendezvous port {port} (base {base} + engine {k}) is beyond 65535; "
                    "set STRATA_STORE_PORT lower")
    os.environ["STRATA_STORE_PORT"] = str(port)
    try:
        return Engine(cfg, rank=rank, world_size=world_size, **kw)
    finally:
        if user is None:
            del os.environ["STRATA_STORE_PORT"]
        else:
            os.environ["STRATA_STORE_PORT"] = user


def _separate_swap_folders(cfg, tag):
    """Gives one engine its own swap subfolders: engines in one process must
    not share swap files."""
    zero = cfg.get("zero_optimization", {})
    for section in ("offload_optimizer", "offload_param"):
        sec = zero.get(section)
        if isinstance(sec, dict) and sec.get("nvme_path"):
            sec["nvme_path"] = _subfolder(sec["nvme_path"], tag)
    st = cfg.get("strata", {})
    if st.get("nvme_paths"):
        st["nvme_paths"] = [_subfolder(p, tag) for p in st["nvme_paths"]]
    return cfg


def _subfolder(path, tag):
    """The engine's own folder under a configured nvme_path, which must
    exist: a mistyped mount point is refused, never created (the swap files
    would land on whatever disk holds the new folder)."""
    if not os.path.isdir(path):
        raise Error(INVALID, f"nvme_path {path!r} does not exist or is not a folder: the swap files go there; "
                    "create it (on the NVMe drive) or fix the path")
    sub = os.path.join(path, tag)
    os.makedirs(sub, exist_ok=True)
    return sub


def _swap_folders(cfg):
    zero = cfg.get("zero_optimization", {})
    out = [zero.get(s, {}).get("nvme_path") for s in ("offload_optimizer", "offload_param")]
    return sorted({p for p in out + list(cfg.get("strata", {}).get("nvme_paths", [])) if p})


def _remove_swap_folders(folders):
    """Removes the per-engine subfolders made by _separate_swap_folders (the
    engine deletes its swap files at close; a crashed one's stay until this)."""
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)


def _torch_dtype(name):
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]


# ---- clip_grad_norm_, shared by OffloadAdam and OffloadedModule ---------------

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


_TORCH2 = int(torch.__version__.split(".")[0]) >= 2
# The first moment as this torch's AdamW computes it: 1.x exp_avg.mul_(b1).add_(g, alpha=1-b1),
# 2.x exp_avg.lerp_(g, 1-b1) (engine config optimizer.params.moment_update).
_MOMENT_UPDATE = "lerp" if _TORCH2 else "mul_add"


def _with_torch_moment(config):
    """config whose Adam/AdamW (the default optimizer) computes the first
    moment as this torch does, unless the config says otherwise."""
    opt = config.setdefault("optimizer", {})
    if str(opt.get("type", "AdamW")).lower() in ("adam", "adamw"):
        opt.setdefault("params", {}).setdefault("moment_update", _MOMENT_UPDATE)
    return config


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


def _engine_clip_for(coef, engine_norm):
    """The max_grad_norm that makes the engine scale the gradients by
    exactly `coef` (a float32 value below 1): the engine takes
    clip / (norm + 1e-6) in double and its kernels multiply by it in
    float32, as torch multiplies by its float32 clip_coef."""
    import numpy as np
    target = np.float32(coef)
    clip = float(target) * (engine_norm + 1e-6)
    for _ in range(4):
        got = np.float32(clip / (engine_norm + 1e-6))
        if got == target:
            return clip
        clip = float(np.nextafter(clip, np.inf if got < target else -np.inf))
    raise Error(INVALID, f"clip_grad_norm_: cannot express torch's clip coefficient {float(target)!r} "
                f"for the engine's norm {engine_norm!r}")


# ---- fp16 loss scaling, shared by OffloadAdam and OffloadedModule ----------------
#
# With fp16 a step divides the gradients it is handed by the loss scale
# (DeepSpeed's semantics): they must be those of the loss times the scale.
# scale_loss() multiplies (as torch's GradScaler.scale and DeepSpeed's
# engine.backward do) and hooks the product, so that a backward that runs
# through it is known to be scaled; gradients from any other backward are
# refused (offload_module: at the backward; OffloadAdam: at step()), unless
# the owner was told loss_scaled=True (the caller multiplies by loss_scale).

def _fp16_section(config):
    sec = config.get("fp16")
    return sec if isinstance(sec, dict) else {}


class _LossScaling:
    """The loss scaling of one OffloadAdam or OffloadedModule: the scale
    (`current`, a function; 1 without fp16), scale_loss(), and which
    backward passes went through a scaled loss."""

    def __init__(self, who, enabled, acknowledged, current):
        if acknowledged not in (True, False):
            raise Error(INVALID, f"{who}: loss_scaled={acknowledged!r}; True (the code multiplies each loss by "
                        "loss_scale itself) or False (the default: use scale_loss() or backward())")
        self.who, self.enabled, self.acknowledged, self._current = who, bool(enabled), acknowledged, current
        self.in_backward = False  # a backward that went through scale_loss's result is running
        self.since_step = False  # one has run since the last step

    @property
    def scale(self):
        return float(self._current()) if self.enabled else 1.0

    @property
    def checked(self):
        """Whether gradients must come from a scaled loss (fp16, not loss_scaled)."""
        return self.enabled and not self.acknowledged

    def scale_loss(self, loss):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{self.who}: scale_loss takes the loss tensor, not a {type(loss).__name__}")
        if not self.enabled:
            return loss
        if not loss.dtype.is_floating_point:
            raise TypeError(f"{self.who}: scale_loss takes a floating-point loss, not {loss.dtype}")
        # In float32 (DeepSpeed's loss.float() * scale): the scaled loss of
        # an fp16 model would overflow fp16 itself.
        scaled = loss.float() * self.scale
        if scaled.requires_grad:
            scaled.register_hook(self._backward_through)
        return scaled

    def _backward_through(self, grad):
        # The root of the backward (or on its way): every gradient this
        # backward produces is of the scaled loss. A reentrant checkpoint's
        # inner backward runs inside it, and the callback ends with the outer.
        self.in_backward = self.since_step = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self):
        self.in_backward = False

    def stepped(self):
        self.in_backward = self.since_step = False

    def refusal(self, what, how):
        s = self.scale
        return Error(INVALID, f"{self.who}: fp16 is enabled and {what} a loss that was not scaled: the step "
                     f"divides every gradient by the loss scale (now {s:g}), so the model would train on gradients "
                     f"{s:g} times too small. {how}, or multiply each loss by loss_scale yourself and pass "
                     "loss_scaled=True. (torch's GradScaler does not apply: the engine keeps the scale, skips a "
                     "step that overflows and lowers it)")


class _ScalesLoss:
    """loss_scale, scale_loss and backward over self._scaling (a
    _LossScaling): OffloadAdam's and OffloadedModule's."""

    @property
    def loss_scale(self):
        """The scale to multiply the next loss by: fp16's (dynamic, the
        engine's, or the config's static fp16.loss_scale), 1 without fp16."""
        return self._scaling.scale

    def scale_loss(self, loss):
        """The loss to call backward() on: loss.float() * loss_scale with
        fp16 (its backward is then known to be scaled), else the loss."""
        return self._scaling.scale_loss(loss)

    def backward(self, loss, **kwargs):
        """scale_loss(loss).backward(**kwargs) (DeepSpeed's engine.backward)."""
        self.scale_loss(loss).backward(**kwargs)


class _Scaler:
    """OffloadAdam's fp16 loss scaler, one for all its engines: the engine's
    rule (DeepSpeed's; engine/step/loss_scaler.h, docs/config.md): on an
    overflow the step is skipped and, after `hysteresis` overflows, the
    scale halves (not below min_loss_scale); after loss_scale_window clean
    steps it doubles. A static loss_scale (> 0) never changes. Its engines
    run with a static scale of 1 and get the unscaled gradients: their own
    scalers would drift apart (a step one engine skips, another takes)."""

    def __init__(self, fp16):
        def number(key, default, low, integer=False):
            v = fp16.get(key, default)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or
                    (integer and v != int(v)) or v < low):
                kind = "an integer" if integer else "a number"
                raise Error(INVALID, f"OffloadAdam: fp16.{key} is {v!r}; allowed: {kind} >= {low}")
            return int(v) if integer else float(v)

        static = number("loss_scale", 0, 0)
        self.dynamic = static == 0
        self.power = number("initial_scale_power", 16, 0, True)
        self.window = number("loss_scale_window", 1000, 1, True)
        self.hysteresis = number("hysteresis", 2, 1, True)
        self.min_scale = number("min_loss_scale", 1, 0)
        self.scale = math.ldexp(1.0, self.power) if self.dynamic else static
        self.hysteresis_left, self.clean_steps = self.hysteresis, 0

    def update(self, overflow):
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= 2
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self):
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    @staticmethod
    def parse_state(sd):
        try:
            scale, left, clean = float(sd["scale"]), int(sd["hysteresis_left"]), int(sd["clean_steps"])
        except (KeyError, TypeError, ValueError):
            raise Error(INVALID, f"load_state_dict: loss_scaler {sd!r} is not a state_dict()'s") from None
        if not (math.isfinite(scale) and scale > 0) or left < 0 or clean < 0:
            raise Error(INVALID, f"load_state_dict: loss_scaler {sd!r}: scale must be a finite number > 0, "
                        "the counts >= 0")
        return scale, left, clean

    def set_state(self, state):
        self.scale, self.hysteresis_left, self.clean_steps = state


# ---- OffloadAdam -------------------------------------------------------------

class OffloadAdam(_ScalesLoss, torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) whose fp32 master
    weights and moments live in Strata's tiers (host memory or NVMe, as the
    config says). The parameters stay ordinary tensors: step() hands each
    gradient to the engine, steps, and copies the new weights back.

    Hyperparameters are read from param_groups at every step, so LR schedulers
    work. A parameter whose .grad is None is skipped, as torch skips it: a
    frozen parameter (requires_grad=False) gets no state and never changes,
    and one that misses a step keeps its moments and step count. Each set
    of parameters that have been stepped together has its own engine (and
    swap subfolder); one param group with no frozen parameters is one
    engine.

    torch 2.x's AdamW arguments: `amsgrad`, `capturable` and
    `differentiable` are refused when set (not implemented); `maximize`
    negates the gradients as torch does; `foreach` is accepted (torch's
    foreach and single-tensor AdamW compute the same arithmetic, which the
    engine's kernel reproduces); `fused=True` is refused (torch's fused
    kernel rounds differently). On one rank clip_grad_norm_ is torch's own.
    state_dict() has torch's keys; float32 parameters hold their master
    weights themselves, other dtypes add "master_param". A torch AdamW
    state_dict loads, and ours loads into torch AdamW.

    Ranks (see the module's docstring): with several, OffloadAdam is the
    optimizer of a data-parallel job without DDP — each rank computes the
    gradients of its own batch's mean loss, step() averages them over the
    ranks (strata.grad_reduce) and updates the rank's partition of the
    state (stage 1: optimizer state; 2: and gradients), and every rank ends
    the step with the same parameters. At construction the parameters
    become rank 0's values. `max_grad_norm=` clips as torch's
    clip_grad_norm_ would over the averaged gradient (or use
    clip_grad_norm_(), below, which also returns the norm).

    `config`: the engine's JSON config (dict or string), e.g.
    {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme",
    "nvme_path": "/mnt/nvme"}}}; the optimizer section is filled in here.
    Do not enable bf16/fp16 in it unless the parameters are that dtype.

    `state_format`: "compact" keeps the optimizer state in about 5 bytes a
    parameter instead of 12 (strata.state_format; needs bf16 parameters and
    bf16 in the config); None keeps the config's (fp32 by default).

    `params` may come named, as model.named_parameters() yields them: the
    engine then registers each under its name (its state_dict key), so that
    strata-export of the engine's checkpoint loads into the model (a
    parameter cut over two engine groups, below, is exported flat, in
    pieces named "name[first:end]").

    `bucket_numel`: elements per engine group; a parameter larger than the
    room left in one continues in the next. None (the default) sizes them to
    the model and the host budget (strata._sizing.auto_bucket_numel: 64Ki to
    4Mi elements with the state on NVMe, 4Mi otherwise). With the state on
    NVMe, no GPU and one rank, the engine's copy of the parameters goes to
    NVMe too unless the config places it (strata._sizing.lean_host_config).

    The step is not overlapped with backward (the engine's overlap_step, on
    by default in offload_module): step() reads .grad after whatever the
    code did with it since backward (several backward passes summed,
    torch's clip_grad_norm_, a GradScaler's unscale_), so no backward is
    left to overlap the update with.

    fp16 (the config's fp16.enabled, fp16 parameters): the loss must be
    scaled, DeepSpeed's way — `opt.backward(loss)`, or
    `opt.scale_loss(loss).backward()` (loss.float() * loss_scale) — and
    step() raises INVALID when no backward since the last step went through
    scale_loss, unless `loss_scaled=True` says the code multiplies each loss
    by `opt.loss_scale` itself. step() divides the gradients by the scale
    (in float32), skips the whole step when any gradient overflowed (no
    parameter changes, the step count stays) and updates the scale: one
    dynamic scale for every engine of the optimizer (the config's
    initial_scale_power, loss_scale_window, hysteresis, min_loss_scale),
    kept in state_dict() as "loss_scaler". .grad keeps the scaled values;
    clip_grad_norm_ clips the unscaled ones (on one rank bitwise torch's
    clip_grad_norm_ over float32 masters whose .grad is .grad.float() /
    loss_scale).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, config=None,
                 bucket_numel=None, force_no_gpu=False, rank=None, world_size=None,
                 max_grad_norm=None, state_format=None, loss_scaled=False):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid hyperparameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        for flag, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable),
                            ("fused", fused)):
            if value:
                raise Error(INVALID, f"OffloadAdam: {flag}=True is not supported (the engine's AdamW kernel "
                            "computes torch's single-tensor/foreach AdamW, bitwise); leave it off")
        self._config = _with_state_format(_config_dict(config), state_format)
        # fp16: the scaler is ours, one for every engine (see _Scaler); the
        # engines get unscaled gradients and a static scale of 1.
        fp16 = _fp16_section(self._config)
        self._scaler = _Scaler(fp16) if fp16.get("enabled") is True else None
        if self._scaler is not None:
            fp16["loss_scale"] = 1.0
        self._scaling = _LossScaling("OffloadAdam", self._scaler is not None, loss_scaled,
                                     lambda: self._scaler.scale)
        self._clip_coef = None  # fp16 on one rank: torch's clip coefficient, applied to the unscaled gradients
        params, self._param_names = _split_names(params)
        self._bucket_numel = bucket_numel
        self._force_no_gpu = force_no_gpu
        self._rank, self._world_size = _resolve_ranks(rank, world_size, "OffloadAdam")
        self._clip_next = None  # from clip_grad_norm_, for the coming step
        # Per param group, its cohorts: _GroupEngines whose parameters have
        # been stepped together since each first had a gradient (so they
        # share a step count, as torch's per-parameter "step" would be). A
        # parameter that never had a gradient (frozen) is in none: it has
        # no state and is never changed.
        self._cohorts = []
        self._tags = itertools.count()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=bool(maximize), foreach=foreach, capturable=False, differentiable=False,
                        fused=None, max_grad_norm=max_grad_norm)
        if _TORCH2:
            defaults["decoupled_weight_decay"] = True  # torch 2.x's AdamW says so in its groups
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                _OWNERS[id(p)] = self

    def _clip_ids(self):
        return {id(p) for group in self.param_groups for p in group["params"]}

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        _check_params(self.param_groups[index]["params"], self._param_names, "OffloadAdam",
                      [p for g in self.param_groups[:index] for p in g["params"]])
        # The trainable parameters' engine is made now, not at the first
        # step, so that a bad config fails at construction; their initial
        # master weights are their values now. A group with none gets its
        # config checked by an engine of one element.
        trainable = [p for p in self.param_groups[index]["params"] if p.requires_grad]
        if trainable:
            self._cohorts.append([self._new_engine(index, trainable)])
        else:
            self._new_engine(index, [torch.zeros(1)]).close()
            self._cohorts.append([])

    def _new_engine(self, index, params):
        group = self.param_groups[index]
        tag = f"strata-{os.getpid()}-{id(self)}-{index}-{next(self._tags)}"
        cfg = _separate_swap_folders(copy.deepcopy(self._config), tag)
        opt = cfg.setdefault("optimizer", {})
        opt["type"] = "AdamW"
        hyper = opt.setdefault("params", {})
        hyper.update(lr=group["lr"], betas=list(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"])
        hyper.setdefault("moment_update", _MOMENT_UPDATE)  # as this torch's AdamW computes the first moment
        # The groups' size from the model and the host budget, and the
        # engine's copy of the parameters on NVMe where it would be a second
        # one in host memory (strata/_sizing.py says why and what it costs).
        bucket = self._bucket_numel or _sizing.auto_bucket_numel(sum(p.numel() for p in params), cfg)
        on_gpu = not self._force_no_gpu and torch.cuda.is_available()
        cfg = _sizing.lean_host_config(cfg, bucket, on_gpu=on_gpu, world_size=self._world_size)
        return _GroupEngine(cfg, params, bucket, self._force_no_gpu, self._rank,
                            self._world_size, self._param_names)

    @property
    def _engines(self):
        return [ge for cohorts in self._cohorts for ge in cohorts]

    def _regroup(self, index):
        """The cohorts of param group `index` that step now, as torch
        AdamW's rule has it: a parameter whose .grad is None is skipped (no
        decay, moments and step count kept); one with a gradient is
        stepped. A cohort whose parameters disagree is split (its state
        read out and written into two engines); parameters with a gradient
        for the first time form a new cohort, at step 0."""
        group = self.param_groups[index]
        stepping, kept = [], []
        for ge in self._cohorts[index]:
            have = [p.grad is not None for p in ge.params]
            if all(have):
                stepping.append(ge)
            elif not any(have):
                kept.append(ge)
            else:
                states = ge.read_states()
                parts = []
                for flag in (True, False):
                    ps = [p for p, h in zip(ge.params, have) if h == flag]
                    sts = [st for st, h in zip(states, have) if h == flag]
                    part = self._new_engine(index, ps)
                    part.write_states(sts)
                    part.engine.steps = ge.engine.steps
                    parts.append(part)
                ge.close()
                stepping.append(parts[0])
                kept.append(parts[1])
        known = {id(p) for ge in self._cohorts[index] for p in ge.params}
        new = [p for p in group["params"] if id(p) not in known and p.grad is not None]
        if new:
            stepping.append(self._new_engine(index, new))
        self._cohorts[index] = stepping + kept
        return stepping

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world_size

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, params=None):
        """torch.nn.utils.clip_grad_norm_ over every parameter of this
        optimizer (the torch function, patched by strata.torch, sends them
        here, as `params`: the order torch was given them), as the coming
        step will see the gradients (averaged over the ranks, where torch's
        own would see only this rank's): returns the total norm and clips at
        step(). With several ranks one param group only (the norm of several
        engines' gradients is not one engine's), and a collective."""
        _check_clip_args(max_norm, norm_type)
        self._check_scaled("clip_grad_norm_")
        if params is None:
            params = [p for group in self.param_groups for p in group["params"]]
        if self._world_size == 1 and self._scaler is None:
            # One rank: the gradients are this rank's, in .grad; torch's own
            # function clips them, bitwise as torch would.
            return _torch_clip_grad_norm(params, max_norm, norm_type=norm_type,
                                         error_if_nonfinite=error_if_nonfinite)
        if self._world_size == 1:
            # fp16 on one rank: .grad holds the scaled gradients. torch's
            # arithmetic over the unscaled ones (float32, as the step gets
            # them): its norms, and its coefficient, which step() applies.
            scale = self._scaler.scale
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                return torch.tensor(0.0)
            total = _torch_total_norm([_torch_norm_of(g.float() / scale) for g in grads])
            if error_if_nonfinite and not torch.isfinite(total):
                _clip_result(float("inf"), norm_type, True)
            self._clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            return total
        engines = self._regroup(0) if len(self.param_groups) == 1 else self._engines
        if len(self.param_groups) != 1 or len(engines) != 1:
            raise Error(INVALID, f"clip_grad_norm_ with several ranks: {len(self.param_groups)} param groups, "
                        f"{len(engines)} engines with gradients; one only (each has its own norm): pass "
                        "max_grad_norm per group instead")
        ge = engines[0]
        if not ge.handed:
            ge.hand_grads(negate=self.param_groups[0].get("maximize", False), scale=self.loss_scale)
        norm = ge.engine.grad_norm()
        result = _clip_result(norm, norm_type, error_if_nonfinite)  # raises before anything is set
        self._clip_next = float(max_norm)
        return result

    # -- fp16 loss scaling (see the class docstring): _ScalesLoss
    def _check_scaled(self, what):
        if (self._scaling.checked and not self._scaling.since_step and
                any(p.grad is not None for group in self.param_groups for p in group["params"])):
            raise self._scaling.refusal(f"{what} got the gradients of",
                                        "Call opt.backward(loss) (or opt.scale_loss(loss).backward())")

    def _overflowed(self, engines):
        """Whether any of these engines' parameters has a gradient that is
        not finite (this rank's): one read back per device."""
        by_device = {}
        for ge in engines:
            for p in ge.params:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(torch.isfinite(p.grad).all())
        return not all(bool(torch.stack(flags).all()) for flags in by_device.values())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_scaled("step()")
        results = []
        clip_next, self._clip_next = self._clip_next, None
        coef, self._clip_coef = self._clip_coef, None
        scale = self.loss_scale
        stepping = [(group, ge) for index, group in enumerate(self.param_groups) for ge in self._regroup(index)]
        # fp16: a step is skipped whole when any gradient overflowed. Each
        # engine skips on its own gradients; with several, one that
        # overflowed here makes every other skip too (a NaN in its
        # gradients; with several ranks that reaches every rank's).
        poison = self._scaler is not None and len(stepping) > 1 and self._overflowed(
            [ge for _, ge in stepping if not ge.handed])
        for group, ge in stepping:
            if not ge.handed:
                ge.hand_grads(negate=group.get("maximize", False), scale=scale, coef=coef, poison=poison)
            clip = clip_next if clip_next is not None else group.get("max_grad_norm")
            norm, skipped = ge.engine.step(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                           weight_decay=group["weight_decay"], max_grad_norm=clip)
            ge.handed = False
            ge.copy_params_back()
            results.append((norm, skipped))
            for p in ge.params:
                self.state[p]["step"] = torch.tensor(float(ge.engine.steps))
        if self._scaler is not None and results:
            skipped = [k for _, k in results]
            if any(skipped) and not all(skipped):
                raise Error(STATE, f"OffloadAdam: fp16 step: {skipped.count(True)} of {len(skipped)} engines "
                            "skipped the step (an overflow) and the others did not; the optimizer is no longer "
                            "one model's (report this)")
            self._scaler.update(all(skipped))
        self._scaling.stepped()
        self.last_results = results  # (grad_norm, skipped) per engine that stepped
        return loss

    def state_dict(self):
        """torch.optim.AdamW's format, per parameter that has been stepped:
        "step", "exp_avg", "exp_avg_sq", and "master_param" (its float32
        master weights; torch AdamW loads the dict and ignores it)."""
        for ge in self._engines:
            if ge.engine.steps == 0:
                continue  # torch has no state for a parameter before its first step
            for p, st in zip(ge.params, ge.read_states()):
                self.state[p].update(st)
                self.state[p]["step"] = torch.tensor(float(ge.engine.steps))
        out = super().state_dict()
        # The returned dict keeps the per-parameter dicts; ours drop the copies.
        for p in list(self.state):
            self.state[p] = {"step": self.state[p]["step"]}
        if self._scaler is not None:
            out["loss_scaler"] = self._scaler.state_dict()  # fp16 (torch AdamW ignores it)
        return out

    def load_state_dict(self, state_dict):
        """Restores param_groups, the master weights, both moments and the
        step count (and fp16's loss scaler), so training goes on as if it had
        never stopped."""
        scaler = None
        if self._scaler is not None and "loss_scaler" in state_dict:
            scaler = _Scaler.parse_state(state_dict["loss_scaler"])  # refused before anything changes
        super().load_state_dict(state_dict)
        # torch casts floating-point state to its parameter's dtype: the
        # float32 masters and moments of bf16/fp16 parameters would be
        # rounded. They are taken from the given dict as they are.
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, (p for g in self.param_groups for p in g["params"])):
            for k, v in saved.get(i, {}).items():
                if k in ("master_param", "exp_avg", "exp_avg_sq") and isinstance(v, torch.Tensor):
                    self.state[p][k] = v
        if scaler is not None:
            self._scaler.set_state(scaler)
        self.close()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    master = self.state[p].get("master_param")
                    if master is not None:
                        p.copy_(master.to(p.dtype))
        # Cohorts again: the parameters with state, by their step count;
        # those without (never stepped) join one at their first gradient.
        self._cohorts = []
        for index, group in enumerate(self.param_groups):
            by_step = {}
            for p in group["params"]:
                st = self.state.get(p, {})
                if "exp_avg" in st or "master_param" in st:
                    by_step.setdefault(int(float(st.get("step", 0))), []).append(p)
            cohorts = []
            for steps, ps in sorted(by_step.items()):
                ge = self._new_engine(index, ps)
                ge.write_states([self.state[p] for p in ps])
                ge.engine.steps = steps
                cohorts.append(ge)
            self._cohorts.append(cohorts)
        for p in list(self.state):  # the engine holds them now
            self.state[p] = {"step": self.state[p].get("step", torch.tensor(0.0))}

    def close(self):
        """Frees the engines (and their swap files). step() no longer works."""
        for ge in self._engines:
            ge.close()
        self._cohorts = [[] for _ in self._cohorts]

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _param_label(p, names, where=""):
    name = (names or {}).get(id(p))
    return f"parameter '{name}'" if name else f"parameter{where} of shape {tuple(p.shape)}"


def _check_params(params, names, who, earlier=()):
    """Refuses, naming the parameter, what the engine would train wrongly:
    a parameter listed twice (torch 2.x refuses it too), a float64 one
    (the engine's masters are float32: it would train in float32 without a
    word), a sparse or non-floating one."""
    seen = {id(p) for p in earlier}
    for j, p in enumerate(params):
        label = _param_label(p, names, f" {j}")
        if id(p) in seen:
            raise ValueError(f"{who}: {label} appears more than once (in a group or across groups); "
                             "give each parameter once")
        seen.add(id(p))
        if p.dtype == torch.float64:
            raise Error(INVALID, f"{who}: {label} is float64; the engine keeps float32 master weights and "
                        "would train it in float32 precision: convert the model with .float() (or keep torch's "
                        "optimizer for float64)")
        if not p.dtype.is_floating_point:
            raise Error(INVALID, f"{who}: {label} is {p.dtype}, not a floating-point parameter")
        if p.is_sparse:
            raise Error(INVALID, f"{who}: {label} is a sparse tensor; dense parameters only")


def _split_names(params):
    """`params` as torch.optim takes them, and {id(param): name} for those
    given as (name, param) pairs, as model.named_parameters() yields them."""
    names = {}

    def strip(seq):
        out = []
        for x in seq:
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
                names[id(x[1])] = x[0]
                x = x[1]
            out.append(x)
        return out

    params = list(params)
    if params and isinstance(params[0], dict):
        groups = []
        for g in params:
            ps = g["params"]
            groups.append(dict(g, params=[ps] if isinstance(ps, torch.Tensor) else strip(ps)))
        return groups, names
    return strip(params), names


class _GroupEngine:
    """One torch param group on one engine: parameters packed in buckets of
    bucket_numel elements (_sizing.split_buckets: a parameter larger than the
    room left continues in the next bucket), one engine group per bucket."""

    def __init__(self, cfg, params, bucket_numel, force_no_gpu, rank=0, world_size=1, names=None):
        self.params = list(params)
        self.folders = _swap_folders(cfg)
        self.handed = False  # this step's gradients are in the engine (clip_grad_norm_)
        try:
            self.engine = _new_engine(cfg, rank, world_size, force_no_gpu=force_no_gpu)
        except Error:
            _remove_swap_folders(self.folders)
            raise
        self.names = names or {}
        dtype = _torch_dtype(self.engine.compute_dtype)
        if dtype != torch.float32:
            for p in self.params:
                if p.dtype != dtype:
                    self.engine.close()
                    _remove_swap_folders(self.folders)
                    raise Error(INVALID, f"OffloadAdam: the config computes in {dtype} (bf16/fp16 enabled) but "
                                f"{_param_label(p, names)} is {p.dtype}: the parameters must be that dtype (convert "
                                "the model), or leave bf16/fp16 off (float32 masters of any parameter dtype)")
        # [(group, [(param index, first element, count, offset in the group)])]
        self.buckets = []
        for g, bucket in enumerate(_sizing.split_buckets([p.numel() for p in self.params], bucket_numel)):
            entries = []
            for k, (i, start, count) in enumerate(bucket):
                p = self.params[i]
                # The model's name (its state_dict key) where the parameters
                # came named, so that strata-export's file loads into the
                # model; a piece of a parameter cut over groups is named
                # "name[first:end]" and exported flat.
                name = (names or {}).get(id(p), f"p{g}.{k}")
                if count == p.numel():
                    off = self.engine.add_param(g, name, p.detach())
                else:
                    piece = p.detach().reshape(-1)[start:start + count]
                    off = self.engine.add_param(g, f"{name}[{start}:{start + count}]", piece)
                entries.append((i, start, count, off))
            self.buckets.append((g, entries))
        self.engine.build()
        self.device = "cuda" if self.engine.on_gpu else "cpu"
        if world_size > 1:
            with torch.no_grad():
                self.copy_params_back()  # every rank starts from rank 0's values

    def hand_grads(self, negate=False, scale=1.0, coef=None, poison=False):
        """Hands .grad to the engine, divided by fp16's loss `scale` and
        multiplied by torch's clip coefficient `coef` (a float32 tensor;
        None: 1), in float32, as torch would over float32 masters;
        `poison`: with a NaN, so that the engine skips the step."""
        for g, entries in self.buckets:
            numel = self.engine.group_numel(g)
            flat = torch.zeros(numel, dtype=torch.float32, device=self.device)
            for i, start, count, off in entries:
                p = self.params[i]
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise Error(INVALID, f"OffloadAdam: {_param_label(p, self.names)} has a sparse gradient "
                                    "(e.g. nn.Embedding(sparse=True)); dense gradients only")
                    flat[off:off + count].copy_(p.grad.reshape(-1)[start:start + count])
            if scale != 1.0:
                flat.div_(scale)
            if coef is not None:
                flat.mul_(coef.to(flat.device))
            if poison:
                flat[0] = float("nan")
            if negate:  # maximize: torch steps with -grad
                flat.neg_()
            self.engine.grads(g, flat, stream=_current_stream(self.device))
            del flat  # one bucket's at a time
        self.handed = True

    def copy_params_back(self):
        pending = {}  # param index -> flat copy of a non-contiguous parameter cut over groups
        for g, entries in self.buckets:
            stream = _current_stream(self.device)
            buf = self.engine.fetch_tensor(g, stream=stream)
            for i, start, count, off in entries:
                p = self.params[i]
                if count == p.numel():
                    p.copy_(buf[off:off + count].view_as(p))
                elif p.is_contiguous():
                    p.view(-1)[start:start + count].copy_(buf[off:off + count])
                else:
                    flat = pending.setdefault(i, torch.empty(p.numel(), dtype=p.dtype, device=p.device))
                    flat[start:start + count].copy_(buf[off:off + count])
                    if start + count == p.numel():
                        p.copy_(pending.pop(i).view(p.shape))
            self.engine.release(g, stream=stream)

    def _per_param(self, reads):
        """Per parameter, shaped like it: {key: values} from `reads(group)`,
        {key: the group's flat values}, over the pieces in every group."""
        out = [{} for _ in self.params]
        for g, entries in self.buckets:
            full = reads(g)
            for i, start, count, off in entries:
                for k, v in full.items():
                    out[i].setdefault(k, []).append(v[off:off + count])
        return [{k: torch.cat(v).view_as(p) if len(v) > 1 else v[0].view_as(p).clone() for k, v in st.items()}
                for p, st in zip(self.params, out)]

    def read_states(self):
        """Per parameter: {"master_param", "exp_avg", "exp_avg_sq"} as tensors shaped like it."""
        return self._per_param(lambda g: {k: self.engine.read_state(g, w) for k, w in
                                          (("master_param", "master"), ("exp_avg", "exp_avg"),
                                           ("exp_avg_sq", "exp_avg_sq"))})

    def write_states(self, states):
        """The inverse of read_states (a missing key keeps the engine's value)."""
        for g, entries in self.buckets:
            for key, which in (("master_param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                if not all(key in states[i] for i, _, _, _ in entries):
                    continue
                flat = self.engine.read_state(g, which)
                for i, start, count, off in entries:
                    flat[off:off + count] = states[i][key].reshape(-1)[start:start + count].to(torch.float32).cpu()
                self.engine.write_state(g, which, flat)

    def read_masters(self):
        return [st["m"] for st in self._per_param(lambda g: {"m": self.engine.read_master(g)})]

    def close(self):
        self.engine.close()
        _remove_swap_folders(self.folders)


def _current_stream(device):
    return torch.cuda.current_stream() if device == "cuda" else None


def _engine_device(engine):
    """The torch device of the engine's buffers, with its index on a GPU (the
    engine made its GPU current on this thread when it was created)."""
    if not engine.on_gpu:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# ---- offload_module ----------------------------------------------------------

class OffloadedModule(_ScalesLoss):
    """What offload_module returns: the engine that owns the parameters, the
    optimizer that steps them (`optimizer`, a torch.optim.Optimizer), and
    the model's full state (state_dict / load_state_dict, through the model
    too). close() removes the hooks and gives the module its parameters
    back as ordinary tensors holding the master weights."""

    def __init__(self, module, config, force_no_gpu, grad_accumulation_steps, rank=None, world_size=None,
                 overlap_step=None, loss_scaled=False):
        self.module = module
        self.engine = None
        self._scaling = _LossScaling("offload_module", _fp16_section(config).get("enabled") is True, loss_scaled,
                                     self._engine_loss_scale)
        self.rank, self.world_size = _resolve_ranks(rank, world_size, "offload_module")
        if overlap_step not in (None, True, False):
            raise Error(INVALID, f"offload_module: overlap_step={overlap_step!r}; one of None (on, the default), "
                        "True, False")
        config = _separate_swap_folders(config, f"strata-{os.getpid()}-{id(self)}")
        self._folders = _swap_folders(config)
        try:
            # A group that got no gradient in a step (a module unused in it,
            # or whose parameters were all frozen since) is left untouched,
            # with its own step count: torch AdamW's rule for .grad None.
            self.engine = _new_engine(config, self.rank, self.world_size, force_no_gpu=force_no_gpu,
                                      grad_accumulation_steps=grad_accumulation_steps, skip_groups_without_grads=True,
                                      overlap_step=overlap_step is not False)
        except Error:
            _remove_swap_folders(self._folders)
            raise
        try:
            self._check_module(module)
        except Exception:
            self.engine.close()
            _remove_swap_folders(self._folders)
            raise
        self._handles = []
        self._groups = []  # _ModuleGroup per module with direct trainable parameters of its own
        self._names = []  # (qualified name, parameter) of every offloaded name, tied ones included
        owner_of = {}  # id(parameter) -> its group
        users = []  # (module, [groups its forward needs])
        tied = []  # (qualified name, parameter) of a tied parameter's later names
        self._frozen_names = []  # (qualified name, parameter) of the frozen ones
        for name, m in module.named_modules():
            own, frozen, needs = [], [], []
            for n, p in m.named_parameters(recurse=False):
                qual = f"{name}.{n}" if name else n
                self._names.append((qual, p))
                g = owner_of.get(id(p))
                if g is not None:  # tied: one master, in the group of its first module
                    tied.append((qual, p))
                    if g not in needs:
                        needs.append(g)
                elif p.requires_grad:
                    own.append((qual, p))
                else:
                    frozen.append((qual, p))
                    self._frozen_names.append((qual, p))
            # A module's frozen parameters (a LoRA base layer's weight) are
            # a group of their own: P only in the engine, never a gradient.
            for named, is_frozen in ((frozen, True), (own, False)):
                if named:
                    g = _ModuleGroup(self, len(self._groups), m, named, frozen=is_frozen)
                    self._groups.append(g)
                    for _, p in named:
                        owner_of[id(p)] = g
                    needs.insert(0, g)
            users.append((m, needs))  # every module: a scope for the parameters its forward reads
        if not any(not g.frozen for g in self._groups):
            self.engine.close()
            _remove_swap_folders(self._folders)
            raise Error(INVALID, "offload_module: the module has no trainable parameters")
        for qual, p in tied:  # strata-export writes a tied weight under each name
            g = owner_of[id(p)]
            first = next(n for n, q in zip(g.names, g.params) if q is p)
            self.engine.add_alias(g.index, qual, first)
        self.engine.build()
        # With its index: a tensor's device is cuda:N, and torch.device("cuda")
        # compares unequal to it (saved views of fetched groups went unseen by
        # pack, and backward read released buffers).
        self.device = _engine_device(self.engine)
        self.dtype = _torch_dtype(self.engine.compute_dtype)
        self._fetched = {}  # group index -> (flat tensor, first byte address, end address)
        self._refs = {}  # group index -> running forwards (scopes) that hold it
        self._scopes = []  # _Scope per module forward running, innermost last
        self._pinned = {}  # group index -> group, held until its gradients are in or backward ends
        self._loose = {}  # group index -> group, used outside any forward: held until backward ends or step
        self._callback_queued = False
        self._clip_next = None
        self._norms, self._norms_exact = {}, True  # id(param) -> torch's norm of its staged gradient
        self.engine_accumulates = grad_accumulation_steps != 1
        self._keep_zero_grads = not _TORCH2  # zero_grad()'s default meaning in this torch
        self._handed = set()  # groups handed gradients this step
        self._warned_missed = set()
        self._overlap = _Overlap(self, overlap_step, grad_accumulation_steps)
        self._group_of = owner_of
        for g in self._groups:
            g.install()
            for p, qual in zip(g.params, g.names):
                if not g.frozen:
                    _OWNERS[id(p)] = self  # clip_grad_norm_: the trainable ones
                _fou.adopt(p, self, g, qual)
        for qual, p in tied:
            _fou.adopt(p, self, owner_of[id(p)], _fou._OFFLOADED[id(p)][3])
        always = _forward_hooks_always_called()
        for m, needs in users:
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, inp, needs=needs: self._before_forward(needs)))
            self._handles.append(m.register_forward_hook(
                lambda mod, inp, out: self._after_forward(out), **always))
        self._handles.append(module._register_state_dict_hook(self._state_dict_hook))
        self._handles.append(module._register_load_state_dict_pre_hook(self._load_pre_hook, with_module=True))
        self._handles.append(module.register_load_state_dict_post_hook(self._load_post_hook))
        self._load_ctx = None
        # torch's hooks are not told whether a load is strict: the model's
        # load_state_dict says it here (called otherwise, a load is strict).
        self._load_strict = True
        module.load_state_dict = self._module_load_state_dict
        module.state_dict = self._module_state_dict
        opt = self.engine.config["optimizer"]["params"]
        self.optimizer = OffloadOptimizer(self, [g for g in self._groups if not g.frozen], opt)

    def _check_module(self, module):
        """Refuses, naming the parameter, what would train wrongly or fail
        later: float64 (float32 masters), a dtype the config does not
        compute in (the model would run in the compute dtype), sparse
        gradients, a parameter subclass."""
        dtype = _torch_dtype(self.engine.compute_dtype)
        for name, m in module.named_modules():
            if getattr(m, "sparse", False) and isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                raise Error(INVALID, f"offload_module: {name or type(m).__name__}.weight would get sparse gradients "
                            "(sparse=True); offload_module takes dense gradients only")
        for name, p in module.named_parameters():
            if p.dtype == torch.float64:
                raise Error(INVALID, f"offload_module: parameter '{name}' is float64; the engine keeps float32 "
                            "master weights and would train it in float32: convert the model with .float()")
            if p.dtype != dtype and p.dtype != torch.float32:
                # float32 parameters under bf16/fp16 compute are mixed
                # precision (the model runs in the compute dtype, masters
                # stay float32); a half-precision model under float32
                # compute would run in float32 behind the user's back.
                raise Error(INVALID, f"offload_module: parameter '{name}' is {p.dtype} but the config computes in "
                            f"{dtype}: enable the matching bf16/fp16 section in the config, or convert the model "
                            "to float32")
            if type(p) not in (torch.nn.Parameter, _fou._OffloadedParameter):
                raise Error(INVALID, f"offload_module: parameter '{name}' is a {type(p).__name__}; plain "
                            "nn.Parameter only")

    # -- forward: a scope per module forward; parameters fetched on use
    #
    # A group is fetched (once; the engine counts nothing else) when a
    # forward that needs it starts (its module's own parameters, a tied
    # one's first module) or when torch code reads one of its parameters
    # (_fetch_on_use: nn.MultiheadAttention's out_proj, a parent reading a
    # child's weight, F.linear on another module's weight). It is held by
    # the innermost running forward (its scope) and released when that
    # forward ends, unless the forward's output aliases it (then the
    # enclosing forward holds it). A use outside every forward holds it
    # "loose", until backward ends or the step. While the outermost forward
    # runs, tensors that autograd saves pass _pack, which saves a view of
    # a fetched group as its place, so that backward fetches the group
    # again rather than read a released buffer. Where other saved-tensor
    # hooks are active at the outermost forward (torch.utils.checkpoint
    # recomputing a forward inside backward, non-reentrant), those keep the
    # saved tensors, and the groups the forward fetched stay "pinned" until
    # their gradients are in or backward ends.
    def _before_forward(self, needs):
        if _fou.compiling():
            _fou.refuse_compile(type(self.module).__name__)
        scope = _Scope()
        if not self._scopes:
            if _fou.foreign_saved_tensor_hooks():
                scope.pin = True
            else:
                scope.ctx = _fou.saved_tensor_hooks(self.pack, self.unpack)
                scope.ctx.__enter__()
        else:
            scope.pin = self._scopes[-1].pin
        self._scopes.append(scope)
        try:
            for g in needs:
                self._hold(scope, g)
                self.fetch(g)
        except BaseException:
            self._after_forward(None)  # a fetch refused: the scope ends with the forward that will not run
            raise

    def _after_forward(self, output):
        if not self._scopes:
            return
        scope = self._scopes.pop()
        if scope.ctx is not None:
            scope.ctx.__exit__(None, None, None)
        escaping = self._aliased(output, scope.held) if scope.held and not scope.pin else ()
        for idx, g in scope.held.items():
            self._refs[idx] -= 1
            if scope.pin:
                self._pinned[idx] = g
            elif idx in escaping:
                if self._scopes:
                    self._hold(self._scopes[-1], g)
                else:
                    self._loose[idx] = g
            self.release(g)

    def _hold(self, scope, g):
        if g.index not in scope.held:
            scope.held[g.index] = g
            self._refs[g.index] = self._refs.get(g.index, 0) + 1

    def _aliased(self, output, held):
        """Indices of the held groups whose buffer a tensor of `output` views."""
        out = set()
        with _fou.quiet():
            for t in _fou._each_tensor(output, []):  # tensors, tuples, lists, dicts (HF's ModelOutput)
                if t.device != self.device:
                    continue
                ptr = t.data_ptr()
                for idx in held:
                    f = self._fetched.get(idx)
                    if f is not None and f[1] <= ptr < f[2]:
                        out.add(idx)
        return out

    def use(self, g, name):
        """_fetch_on_use: torch code reads a parameter of group g. Returns
        True when the use is outside every forward (the caller then saves
        what autograd keeps through pack/unpack)."""
        if self._scopes:
            self._hold(self._scopes[-1], g)
            self.fetch(g)
            return False
        self._loose[g.index] = g
        self.fetch(g)
        return True

    def fetch(self, g):
        if g.index in self._fetched:
            return
        self._overlap.before_fetch(g)
        try:
            flat = self.engine.fetch_tensor(g.index, stream=_current_stream(self.device.type))
        except Error as e:
            raise self._overlap.explain(e, g, "fetched") from None
        start = flat.data_ptr()
        self._fetched[g.index] = (flat, start, start + flat.numel() * flat.element_size())
        with _fou.quiet():
            for p, off, n in zip(g.params, g.offsets, g.numels):
                p.data = flat[off:off + n].view(g.shapes[p])

    def release(self, g):
        """Releases g unless something still holds it: a running forward, a
        pin until its gradients, a use outside every forward."""
        idx = g.index
        if idx not in self._fetched or self._refs.get(idx, 0) > 0 or idx in self._pinned or idx in self._loose:
            return
        with _fou.quiet():
            for p in g.params:
                p.data = g.placeholders[p]
        del self._fetched[idx]
        self.engine.release(idx, stream=_current_stream(self.device.type))

    def _between_passes(self):
        """Before reading or writing the engine's state outside a pass: a
        group held by a use outside every forward is let go (no forward runs;
        a backward in flight keeps its pinned groups)."""
        if not self._scopes:
            held = list(self._loose.values())
            self._loose.clear()
            for g in held:
                self.release(g)

    def _drop_holds(self):
        """Backward has ended (or the step came): nothing is pinned or loose."""
        held = list(self._pinned.values()) + list(self._loose.values())
        self._pinned.clear()
        self._loose.clear()
        for g in held:
            self.release(g)

    # -- saved tensors: a view of a fetched group is saved as (group, place)
    def pack(self, t):
        if self._fetched and t.device == self.device:
            with _fou.quiet():
                ptr = t.data_ptr()
            for index, (flat, start, end) in self._fetched.items():
                if start <= ptr < end and t.dtype == flat.dtype:
                    return _SavedView(index, (ptr - start) // flat.element_size(), tuple(t.shape), t.stride())
        return t

    def unpack(self, saved):
        if not isinstance(saved, _SavedView):
            return saved
        if self.engine is None:
            raise Error(STATE, "backward needs an offloaded parameter, but its offload_module was closed")
        self._queue_end_of_backward()
        g = self._groups[saved.group]
        held = g.index in self._fetched
        self.fetch(g)  # backward: bring the group back; it is released when its gradients are in
        flat = self._fetched[g.index][0]
        view = flat.as_strided(saved.shape, saved.stride, saved.offset)
        if g.frozen and not held:
            # No gradient will say when a frozen group is done with: the
            # backward op gets its own copy, and the group goes at once.
            view = view.clone()
            self.release(g)
        return view

    # -- backward: gradients to the engine as they are produced
    def _queue_end_of_backward(self):
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def grad_ready(self, g, p):
        """A parameter's gradient is in .grad (a tied one's summed over its
        uses; once more for each backward that reaches it, e.g. a reentrant
        checkpoint's): stage it; a group whose every gradient is in goes to
        the engine and is released."""
        if self._scaling.checked and not self._scaling.in_backward:
            self._refuse_unscaled(p)
        self._queue_end_of_backward()
        g.stage(p)
        if g.complete():
            self._hand(g)

    def _refuse_unscaled(self, p):
        """fp16, and a backward from a loss that did not go through
        scale_loss reached parameter p: before any of its gradients reach
        the engine, the backward ends with an error (its callback will not
        run) and lets go of the groups it fetched."""
        p.grad = None  # the refused gradient (the next backward would add to it)
        self._callback_queued = False
        self._drop_holds()
        for g in self._groups:
            self.release(g)
        raise self._scaling.refusal("backward reached the offloaded parameters from",
                                    "Call off.backward(loss) (or off.scale_loss(loss).backward(); off.optimizer "
                                    "has both)")

    def _hand(self, g):
        # The engine adds every grads call of a step to the group's
        # accumulator, so a group handed in parts (a backward that ended
        # early: a reentrant checkpoint's inner one) sums right.
        self._overlap.before_grads(g)
        g.handed_params |= g.arrived
        g.ever_handed = True
        self._handed.add(g.index)
        try:
            self.engine.grads(g.index, g.take_staged(), stream=_current_stream(self.device.type))
        except Error as e:
            raise self._overlap.explain(e, g, "given more gradients") from None
        self._pinned.pop(g.index, None)
        self.release(g)

    def _end_of_backward(self):
        self._callback_queued = False
        self._hand_pending_and_let_go()

    def _hand_pending_and_let_go(self):
        # A group with a parameter that got no gradient (unused in this
        # forward) goes with zeros there; groups still fetched are released.
        for g in self._groups:
            if g.pending():
                self._hand(g)
        self._drop_holds()
        for g in self._groups:
            self.release(g)

    # -- the optimizer
    def step(self, lr=None, betas=None, eps=None, weight_decay=None, max_grad_norm=None):
        """One optimizer step over every group; None takes the config's
        value (max_grad_norm: the clip_grad_norm_ of this step, else the
        config's gradient_clipping). A group that got no gradient since the
        last step is left alone, as torch leaves a parameter whose .grad is
        None (but see zero_grad). Gradients are
        averaged over the ranks and the grad_accumulation_steps backward
        passes (strata.grad_reduce "mean"). Returns (grad_norm, skipped)."""
        self._settle()
        if self._keep_zero_grads:
            for g in self._groups:  # torch would step their zero .grad
                if not g.frozen and g.ever_handed and g.index not in self._handed:
                    self.engine.grads(g.index, torch.zeros(g.numel, dtype=self.dtype, device=self.device),
                                      stream=_current_stream(self.device.type))
        clipped = max_grad_norm is None and self._clip_next is not None
        if max_grad_norm is None:
            max_grad_norm = self._clip_next
        self._clip_next = None
        self._norms, self._norms_exact = {}, True
        self._handed = set()
        for g in self._groups:
            g.handed_params = set()
        # The options as the engine will take them, None as the config's
        # value, so that prepare_step's and step's compare equal.
        opts = self._overlap.options(lr, betas, eps, weight_decay, max_grad_norm)
        self._scaling.stepped()
        try:
            return self.engine.step(**opts)
        finally:
            self._overlap.after_step(opts, clipped)

    # -- fp16 loss scaling (see offload_module)
    def _engine_loss_scale(self):
        if self.engine is None:
            raise Error(STATE, "offload_module: closed; it has no loss scale")
        return self.engine.loss_scale

    def zero_grad(self, set_to_none=None):
        """Gradients go to the engine and never stay in .grad; what is
        recorded is torch's meaning of the call for the next step: with
        set_to_none=False (torch 1.x's default) a parameter that had a
        gradient keeps a zero one, so a step it gets no new gradient in
        still updates it (decay, moments), as torch would; with True (torch
        2.x's default) it is skipped."""
        self._keep_zero_grads = not (_TORCH2 if set_to_none is None else bool(set_to_none))

    def _settle(self):
        """Between backward and step: a backward that ended without our
        callback (no gradient reached a group) leaves nothing held; a frozen
        parameter made trainable since offload_module is refused, naming it;
        one that got no gradient beside others of its group is warned of."""
        self._hand_pending_and_let_go()
        for name, p in self._frozen_names:
            if p.requires_grad or p.grad is not None:
                raise Error(INVALID, f"offload_module: frozen parameter '{name}' was made trainable after "
                            "offload_module; its gradients would be dropped: close() and offload the module "
                            "again")
        missed = [n for g in self._groups if g.index in self._handed
                  for i, n in enumerate(g.names) if i not in g.handed_params]
        if missed and not self._warned_missed.issuperset(missed):
            self._warned_missed.update(missed)
            warnings.warn(f"offload_module: {len(missed)} parameter(s) got no gradient this step while others of "
                          f"their module did ({', '.join(missed[:5])}{', ...' if len(missed) > 5 else ''}); the "
                          "engine steps a module's parameters together, so these step with zero gradients "
                          "(weight decay and moments advance), where torch AdamW would skip them")

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, params=None):
        """torch.nn.utils.clip_grad_norm_ for the offloaded parameters (which
        the torch function, patched by strata.torch, sends here): returns the
        total L2 norm of this step's gradients (averaged over the ranks) and
        clips them to max_norm at the coming step. On one rank with one
        backward per step it is torch's arithmetic, bitwise (`params`: the
        order torch was given them); else the engine's norm (in double). A
        collective."""
        _check_clip_args(max_norm, norm_type)
        self._settle()
        norm = self.engine.grad_norm()
        exact = self._exact_norms(params)
        if exact is not None:
            # torch's own arithmetic over the gradients as they were staged
            # (one rank, one backward per step): its norm, and its float32
            # coefficient, which the engine then applies exactly.
            total = _torch_total_norm(exact)
            if error_if_nonfinite and not torch.isfinite(total):
                _clip_result(float("inf"), norm_type, True)
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            if not (torch.isfinite(total) and math.isfinite(norm)):
                # An overflow (fp16) or a NaN: the step skips it (or, with
                # strata.nonfinite "apply", applies it unclipped).
                self._clip_next = 0.0
            else:
                self._clip_next = _engine_clip_for(float(coef), norm) if float(coef) < 1.0 else 0.0
            self._overlap.clip_unclipped = 0.0  # what this path gives a step it does not clip
            return total
        result = _clip_result(norm, norm_type, error_if_nonfinite)  # raises before anything is set
        self._clip_next = float(max_norm)
        self._overlap.clip_unclipped = float(max_norm)
        return result

    def _exact_norms(self, params):
        """torch's per-parameter norms, in the order clip_grad_norm_ was
        given the parameters, where they are exact: one rank, and every
        gradient of this step staged once. Else None."""
        if not self._norms_exact or self.world_size != 1 or self.engine_accumulates or not self._norms:
            return None
        order = params if params is not None else [p for g in self._groups if not g.frozen for p in g.params]
        return [self._norms[id(p)] for p in order if id(p) in self._norms] or None

    # -- the model's state
    def master_parameters(self):
        """{qualified name: fp32 master weights} of every offloaded parameter
        (tied parameters under each of their names). A collective."""
        self._between_passes()
        self._overlap.check_readable("master_parameters (state_dict, close)")
        masters = {}
        for g in self._groups:
            m = self.engine.read_master(g.index)
            for p, off, n in zip(g.params, g.offsets, g.numels):
                masters[id(p)] = m[off:off + n].view(g.shapes[p]).clone()
        return {name: masters[id(p)] for name, p in self._names}

    def state_dict(self, *args, **kwargs):
        """The module's state_dict, with the offloaded parameters' master
        weights (in each parameter's own dtype and device) in their places."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        """The module's load_state_dict: the offloaded parameters' values
        become the master weights (the moments stay)."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def _module_state_dict(self, *args, **kwargs):
        with _fou.quiet():  # the hook puts the masters in the placeholders' places
            return type(self.module).state_dict(self.module, *args, **kwargs)

    def _module_load_state_dict(self, state_dict, strict=True):
        self._load_strict = bool(strict)
        try:
            with _fou.quiet():  # torch copies the values into the parameters' real tensors (the pre hook's)
                return type(self.module).load_state_dict(self.module, state_dict, strict=strict)
        finally:
            self._load_strict = True

    def _dtype_device(self, p):
        g = self._group_of[id(p)]
        return g.dtypes[p], g.devices[p]

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        if self.engine is None:
            return
        masters = self.master_parameters()
        for name, p in self._names:
            key = prefix + name
            if key in state_dict:
                dtype, device = self._dtype_device(p)
                state_dict[key] = masters[name].to(dtype=dtype, device=device)

    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        # The root's hook runs before any module loads: each offloaded
        # parameter gets a real tensor holding its master weights, which
        # torch then copies the given values into; the post hook hands them
        # to the engine, or (a refused load) drops them.
        if self.engine is None or self._load_ctx is not None:
            return
        if self._scopes:
            raise Error(INVALID, "load_state_dict: a forward is running")
        self._drop_holds()
        for g in self._groups:
            if g.index in self._fetched or self._refs.get(g.index, 0) or g.pending():
                raise Error(INVALID, "load_state_dict: a backward is running, or its gradients wait for the step")
        masters = self.master_parameters()
        with _fou.quiet():
            for name, p in self._names:
                dtype, _ = self._dtype_device(p)
                p.data = masters[name].to(dtype=dtype, device=self.device)
        # torch passes strict=True to every hook; the load's own is ours.
        self._load_ctx = (self._load_strict, missing, unexpected, error_msgs)

    def _load_post_hook(self, module, incompatible):
        if self._load_ctx is None:
            return
        strict, missing, unexpected, error_msgs = self._load_ctx
        self._load_ctx = None
        refused = bool(error_msgs) or (strict and (missing or unexpected))
        with _fou.quiet():
            self._load_commit(refused)

    def _load_commit(self, refused):
        try:
            if not refused:
                for g in self._groups:
                    flat = torch.zeros(self.engine.group_numel(g.index), dtype=torch.float32)
                    for p, off, n in zip(g.params, g.offsets, g.numels):
                        flat[off:off + n] = p.data.reshape(-1).to(device="cpu", dtype=torch.float32)
                    self.engine.write_state(g.index, "master", flat)
        finally:
            for g in self._groups:
                for p in g.params:
                    p.data = g.placeholders[p]

    def _clip_ids(self):
        return {id(p) for g in self._groups if not g.frozen for p in g.params}

    def close(self):
        """Removes the hooks; the parameters become ordinary tensors holding
        the master weights (in their original dtype); the engine is freed."""
        if self.engine is None:
            return
        while self._scopes:  # a forward that raised: its scopes never ended
            scope = self._scopes.pop()
            if scope.ctx is not None:
                scope.ctx.__exit__(None, None, None)
        masters = self.master_parameters()
        named = dict((id(p), name) for name, p in self._names)
        self._pinned.clear()
        self._loose.clear()
        for g in self._groups:
            self._refs[g.index] = 0
            self.release(g)
            with _fou.quiet():
                for p in g.params:
                    p.data = masters[named[id(p)]].to(dtype=g.dtypes[p], device=g.devices[p])
                    _OWNERS.pop(id(p), None)
                    _fou.disown(p)
        for h in self._handles:
            h.remove()
        self._handles = []
        self.module.__dict__.pop("load_state_dict", None)
        self.module.__dict__.pop("state_dict", None)
        self.engine.close()
        self.engine = None
        _remove_swap_folders(self._folders)


class _Overlap:
    """offload_module's overlapped step (the engine's overlap_step): each
    group is updated as soon as its gradients of the step are complete,
    while backward goes on; the engine speculates (no clipping, all finite)
    and, after backward, commits, or discards and redoes the update, so the
    result is bitwise that of a step after backward.

    The engine needs the step's options (prepare_step) before the step's
    first grads call: they are taken at the first gradient handed, from the
    optimizer's param group as it is then (the options step() will pass),
    max_grad_norm as the last step had it when it did not clip. Options that
    differ at step() (a scheduler stepped between backward and step(),
    clipping that triggers) cost a redo of the update, never a wrong one.

    A group updated early that is touched again before step() (a forward
    between backward and step(), more backward passes in a step than
    grad_accumulation_steps says, a read of the state) makes the engine
    undo the step's speculative updates: exact, but that step is not
    overlapped. So the first step is not overlapped, and none is once a
    step has done the first two; where the early updates are final (no
    clipping, no fp16, strata.nonfinite "apply": the engine cannot undo
    them) such a step raises STATE saying so."""

    def __init__(self, owner, overlap_step, accumulation):
        self.owner = owner
        self.wanted = overlap_step is not False
        self.explicit = overlap_step is True
        self.accumulation = accumulation
        self.fits = False  # a step has been seen that an overlapped one would not break
        self.off = None  # why no step is overlapped any more
        self.prepared = None  # this step's prepare_step options; None: not overlapped
        self.hands = {}  # group index -> grads calls this step
        self.late = None  # a group fetched after its gradients were complete (its parameter's name)
        self.clip_unclipped = None  # clip_grad_norm_ this step: the max_grad_norm it gives a step it does not clip
        self.last = None  # the last step's options, max_grad_norm as it would have been unclipped
        self.via_optimizer = False  # the last step came from the optimizer (its param group holds the options)
        self.last_clipped = False  # the last step's max_grad_norm came from clip_grad_norm_
        self.final_unclipped = False  # (options(): the config makes unclipped early updates final)
        self.misses = 0  # consecutive overlapped steps whose lr, betas, eps or weight_decay were not foreseen
        self._config = None

    def options(self, lr=None, betas=None, eps=None, weight_decay=None, max_grad_norm=None):
        """The step's options with None as the config's value."""
        if self._config is None:
            c = self.owner.engine.config
            self._config = (c["optimizer"]["params"], float(c.get("gradient_clipping", 0.0)))
            # Without clipping, loss scaling or strata.nonfinite skip/error,
            # nothing after backward can change an early update: the engine
            # makes it final, and a step() with other options is refused.
            self.final_unclipped = (c.get("strata", {}).get("nonfinite", "skip") == "apply" and
                                    not c.get("fp16", {}).get("enabled", False))
        opt, clip = self._config
        return dict(lr=float(opt["lr"] if lr is None else lr),
                    betas=tuple(float(b) for b in (opt.get("betas", (0.9, 0.999)) if betas is None else betas)),
                    eps=float(opt["eps"] if eps is None else eps),
                    weight_decay=float(opt["weight_decay"] if weight_decay is None else weight_decay),
                    max_grad_norm=clip if max_grad_norm is None else float(max_grad_norm))

    def before_grads(self, g):
        first = not self.hands
        self.hands[g.index] = self.hands.get(g.index, 0) + 1
        if first and self.wanted and self.fits and self.off is None and self.last is not None:
            # The options step() will get: the optimizer's param group as it
            # is now (a scheduler steps it after step()), or, stepped
            # directly, the last step's.
            opts = dict(self.last)
            if self.via_optimizer:
                group = self.owner.optimizer.param_groups[0]
                opts.update(self.options(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                         opts["max_grad_norm"]))
            if self.final_unclipped and opts["max_grad_norm"] <= 0 and (not self.explicit or self.last_clipped):
                # Final early updates: a step() with other options (a
                # clip_grad_norm_ that clips, a scheduler stepped before
                # step()) would be refused, not redone. Only when asked
                # for, and not after a step that clip_grad_norm_ set.
                return
            try:
                self.owner.engine.prepare_step(**opts)
            except Error as e:
                if e.status != INVALID:
                    raise
                return  # options step() will refuse, naming them: this step is not overlapped
            self.prepared = opts

    def before_fetch(self, g):
        if not g.frozen and self.late is None and self.hands.get(g.index, 0) >= self.accumulation:
            self.late = g.names[0]

    def check_readable(self, what):
        """Between backward and step() of an overlapped step a read of the
        state of a group updated early makes the engine undo the step's
        speculative updates first (the read sees the state before the step,
        as without overlap); early updates that are final cannot be undone:
        the engine's STATE then says so."""
        del what

    def explain(self, err, g, what):
        """The engine's STATE for a group the overlapped step updated early,
        as what the user did and what to do."""
        if not (isinstance(err, Error) and err.status == STATE and self.prepared is not None and
                self.hands.get(g.index, 0) >= self.accumulation):
            return err
        self.off = self.off or f"the group of '{g.names[0]}' was {what} after its gradients were complete"
        return Error(STATE, f"offload_module: the group of parameter '{g.names[0]}' was {what} after its "
                     f"gradients of this step were complete ({self.hands[g.index]} backward pass(es), "
                     f"grad_accumulation_steps={self.accumulation}), and the overlapped step had updated it: run "
                     "forwards after step(), give offload_module the backward passes a step has "
                     "(grad_accumulation_steps=), or pass overlap_step=False. Later steps are not overlapped. "
                     f"({err.message})")

    def after_step(self, opts, clipped):
        extra = [i for i, n in self.hands.items() if n > self.accumulation]
        if self.late is not None or extra:
            if self.off is None:
                self.off = (f"the group of '{self.late}' was fetched after its gradients were complete"
                            if self.late is not None else
                            f"a group took {self.hands[extra[0]]} gradients in a step "
                            f"(grad_accumulation_steps={self.accumulation})")
                if self.explicit:
                    warnings.warn(f"offload_module(overlap_step=True): steps are no longer overlapped: {self.off}, "
                                  "which an overlapped step cannot do (the group is updated once its gradients "
                                  "are in); give grad_accumulation_steps= the backward passes of a step, and run "
                                  "forwards after step()")
        else:
            self.fits = True
        if self.prepared is not None:
            # Options that step() changes after backward every time (a
            # scheduler stepped before step()) make every overlapped update
            # a wasted one: no more overlap. Clipping that triggers is not
            # that (the update would be redone without overlap too).
            same = all(self.prepared[k] == opts[k] for k in ("lr", "betas", "eps", "weight_decay"))
            self.misses = 0 if same else self.misses + 1
            if self.misses >= 2 and self.off is None:
                self.off = "step()'s lr, betas, eps or weight_decay differed from those at backward in 2 steps running"
                if self.explicit:
                    warnings.warn(f"offload_module(overlap_step=True): steps are no longer overlapped: {self.off} "
                                  "(step the LR scheduler after step())")
        # The next step's options as foreseen: these, and the max_grad_norm
        # this step would have had unclipped.
        self.last = dict(opts, max_grad_norm=self.clip_unclipped if clipped else opts["max_grad_norm"])
        self.last_clipped = clipped
        self.via_optimizer, self.prepared, self.hands, self.late, self.clip_unclipped = False, None, {}, None, None


class OffloadOptimizer(torch.optim.Optimizer):
    """The optimizer of an OffloadedModule (its `optimizer`): one param group
    whose lr, betas, eps, weight_decay (the config's at first) each step()
    uses, so torch LR schedulers drive it. zero_grad() does nothing (the
    gradients are in the engine). state_dict() gives torch's format
    ({"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": ...},
    read from the engine's tiers: a collective) and load_state_dict() puts
    it back, bitwise."""

    def __init__(self, owner, groups, opt):
        self._strata_offloaded_ok = True  # its parameters are offload_module's (see _fetch_on_use)
        self._owner = owner
        self._groups = groups  # the trainable engine groups (_ModuleGroup), in order
        group_params = [g.params for g in groups]
        self._group_params = group_params  # per trainable group, its parameters in order
        params = [p for ps in group_params for p in ps]
        betas = tuple(opt.get("betas", (0.9, 0.999)))
        defaults = dict(lr=opt["lr"], betas=betas, eps=opt["eps"], weight_decay=opt["weight_decay"])
        super().__init__(params, defaults)
        self.last_result = None

    def add_param_group(self, param_group):
        if self.param_groups:
            raise Error(INVALID, "OffloadOptimizer has one param group: the engine steps every parameter with the "
                        "same options (per-group options need one offload_module per group)")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        g = self.param_groups[0]
        self.last_result = self._owner.step(lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                            weight_decay=g["weight_decay"])
        self._owner._overlap.via_optimizer = True  # the next step's options: the group's (after a scheduler)
        return loss

    def zero_grad(self, set_to_none=None):
        """See OffloadedModule.zero_grad: gradients are in the engine; the
        call says what torch would keep in .grad."""
        self._owner.zero_grad(set_to_none)

    @property
    def loss_scale(self):
        """OffloadedModule.loss_scale: the scale for the next loss (fp16)."""
        return self._owner.loss_scale

    def scale_loss(self, loss):
        """OffloadedModule.scale_loss."""
        return self._owner.scale_loss(loss)

    def backward(self, loss, **kwargs):
        """OffloadedModule.backward: scale_loss(loss).backward(**kwargs)."""
        self._owner.backward(loss, **kwargs)

    def state_dict(self):
        owner = self._owner
        owner._between_passes()
        owner._overlap.check_readable("optimizer.state_dict")
        state, i = {}, 0
        for g in self._groups:
            gi = g.index
            steps = torch.tensor(float(owner.engine.group_steps(gi)))
            if float(steps) == 0:
                i += len(g.params)  # torch has no state for a parameter before its first step
                continue
            full = {k: owner.engine.read_state(gi, w) for k, w in (("exp_avg", "exp_avg"),
                                                                   ("exp_avg_sq", "exp_avg_sq"))}
            for p, off, n in zip(g.params, g.offsets, g.numels):
                st = {"step": steps.clone()}
                for k, v in full.items():
                    st[k] = v[off:off + n].view(g.shapes[p]).clone()
                state[i] = st
                i += 1
        groups = [{k: v for k, v in self.param_groups[0].items() if k != "params"}]
        groups[0]["params"] = list(range(i))
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        owner = self._owner
        owner._between_passes()
        groups = state_dict.get("param_groups")
        n = sum(len(ps) for ps in self._group_params)
        if not isinstance(groups, list) or len(groups) != 1 or len(groups[0].get("params", ())) != n:
            raise Error(INVALID, f"load_state_dict: expected one param group of {n} parameters, got "
                        f"{[len(g.get('params', ())) for g in groups] if isinstance(groups, list) else groups!r}")
        saved = state_dict["state"]
        order = groups[0]["params"]
        for k in ("exp_avg", "exp_avg_sq"):  # check everything before changing anything
            for j, (pi, p) in enumerate(zip(order, (p for ps in self._group_params for p in ps))):
                st = saved.get(pi, {})
                if k in st and tuple(st[k].shape) != tuple(p.shape):
                    raise Error(INVALID, f"load_state_dict: parameter {j}'s {k} has shape {tuple(st[k].shape)}, "
                                f"not {tuple(p.shape)}")
        i = 0
        for g, params in zip(self._groups, self._group_params):
            gi = g.index
            for k in ("exp_avg", "exp_avg_sq"):
                ids = order[i:i + len(params)]
                if not all(k in saved.get(pi, {}) for pi in ids):
                    continue
                flat = owner.engine.read_state(gi, k)
                for pi, p, off, cnt in zip(ids, g.params, g.offsets, g.numels):
                    flat[off:off + cnt] = saved[pi][k].reshape(-1).to(device="cpu", dtype=torch.float32)
                owner.engine.write_state(gi, k, flat)
            i += len(params)
        steps = [float(st["step"]) for st in saved.values() if "step" in st]
        if steps:
            owner.engine.steps = int(max(steps))
        i = 0
        for g, params in zip(self._groups, self._group_params):  # each group's own count (torch's per-parameter step)
            ids = order[i:i + len(params)]
            i += len(params)
            gs = [float(saved[pi]["step"]) for pi in ids if "step" in saved.get(pi, {})]
            owner.engine.set_group_steps(g.index, int(max(gs)) if gs else 0)
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        self.param_groups[0].update(hyper)


class _Scope:
    """One module forward running: the groups it holds (index -> group),
    the saved-tensor hooks it entered (the outermost only), and whether its
    groups stay pinned after it (foreign saved-tensor hooks keep what
    autograd saves)."""
    __slots__ = ("held", "ctx", "pin")

    def __init__(self):
        self.held, self.ctx, self.pin = {}, None, False


def _forward_hooks_always_called():
    """register_forward_hook's always_call=True where torch has it (2.1+):
    a forward that raises still ends its scope."""
    import inspect
    try:
        return {"always_call": True} if "always_call" in inspect.signature(
            torch.nn.Module.register_forward_hook).parameters else {}
    except (TypeError, ValueError):
        return {}


class _SavedView:
    __slots__ = ("group", "offset", "shape", "stride")

    def __init__(self, group, offset, shape, stride):
        self.group, self.offset, self.shape, self.stride = group, offset, shape, stride


class _ModuleGroup:
    """The direct trainable parameters of one module (tied ones only in the
    first module that has them): one engine group."""

    def __init__(self, owner, index, module, named_params, frozen=False):
        self.owner, self.index, self.module, self.frozen = owner, index, module, frozen
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = {p: p.shape for p in self.params}
        self.dtypes = {p: p.dtype for p in self.params}
        self.devices = {p: p.device for p in self.params}
        self.offsets = [owner.engine.add_param(index, n, p.detach()) for n, p in zip(self.names, self.params)]
        if frozen:
            owner.engine.freeze_group(index)
        self.numels = [p.numel() for p in self.params]  # .data is empty while released
        self.numel = sum(self.numels)
        self.staged = None
        self.arrived = set()
        self.ever_handed = False  # had a gradient in some step (torch would keep a zero .grad for it)
        self.handed_params = set()  # indices of parameters whose gradients went to the engine this step
        self.grad_accs = []  # AccumulateGrad nodes, kept alive so that their hooks stay

    def install(self):
        o = self.owner
        # A released parameter is one element expanded to its shape: it costs
        # nothing, and autograd's AccumulateGrad, which shapes .grad after
        # the parameter, still sees the right shape.
        one = torch.zeros(1, dtype=o.dtype, device=o.device)
        # A 0-d parameter cannot be expanded from one element: it gets its own.
        self.placeholders = {p: one.expand(self.shapes[p]) if len(self.shapes[p]) else
                             torch.zeros((), dtype=o.dtype, device=o.device) for p in self.params}
        for p in self.params:
            # The compute dtype first: changing a parameter's dtype gives it a
            # new AccumulateGrad node, which would not have our hook.
            with _fou.quiet():
                p.data = self.placeholders[p]
            if self.frozen:
                continue
            # The AccumulateGrad node of p: its hook runs once p.grad holds
            # this backward's gradient.
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda *_, p=p: o.grad_ready(self, p))
            self.grad_accs.append(acc)

    def stage(self, p):
        if self.staged is None:
            self.staged = torch.zeros(self.numel, dtype=self.owner.dtype, device=self.owner.device)
        i = next(k for k, q in enumerate(self.params) if q is p)
        off = self.offsets[i]
        grad = p.grad
        if grad.is_sparse:
            raise Error(INVALID, f"{self.names[i]}: a sparse gradient (e.g. nn.Embedding(sparse=True)); "
                        "offload_module takes dense gradients only")
        dst = self.staged[off:off + self.numels[i]]
        o = self.owner
        if i in self.arrived:  # another backward reached it (a reentrant checkpoint's, a second loss)
            dst.add_(grad.reshape(-1))
            o._norms_exact = False
        else:
            dst.copy_(grad.reshape(-1))
            if id(p) in o._norms:  # handed in parts this step
                o._norms_exact = False
            elif o._norms_exact and not o.engine_accumulates and o.world_size == 1:
                # fp16: the norm of the unscaled gradient, as torch's
                # clip_grad_norm_ would take it of a float32 master's .grad.
                o._norms[id(p)] = _torch_norm_of(grad.float() / o._scaling.scale if o._scaling.enabled else grad)
        p.grad = None
        self.arrived.add(i)

    def complete(self):
        return len(self.arrived) == len(self.params)

    def pending(self):
        return bool(self.arrived)

    def take_staged(self):
        staged, self.staged, self.arrived = self.staged, None, set()
        return staged


def is_fetched(p):
    """Whether a parameter under offload_module holds its values now (its
    group is fetched) rather than its one-element placeholder. Reads
    nothing, fetches nothing. A parameter not under offload_module: True."""
    ent = _fou._OFFLOADED.get(id(p))
    if ent is None or ent[0]() is not p:
        return True
    return ent[2].index in ent[1]._fetched


def offload_module(module, config, force_no_gpu=False, grad_accumulation_steps=1, *, rank=None, world_size=None,
                   state_format=None, overlap_step=None, loss_scaled=False):
    """ZeRO-3-style offload of `module`'s trainable parameters into a Strata
    engine configured by `config` (dict or JSON string): each module's direct
    parameters form one group, fetched before its forward (and again in
    backward, when autograd needs them) and released after; gradients go to
    the engine as autograd produces them and never stay in .grad. Returns an
    OffloadedModule; step with its `optimizer` (or its step()) after
    backward. The optimizer is the config's (AdamW by default).

    Tied parameters (a GPT's embedding and head) keep one master, in the
    first module that has them, and their gradients are summed over the
    uses. With several ranks (rank=/world_size=, torch.distributed or the
    launcher's variables) each rank runs its own batch; gradients are
    averaged over the ranks and the grad_accumulation_steps backward passes
    of a step (strata.grad_reduce "mean"), as torch DDP with a loss divided
    by the accumulation steps.

    `state_format`: "compact" keeps the optimizer state in about 5 bytes a
    parameter instead of 12 (strata.state_format; needs bf16 in the config);
    None keeps the config's (fp32 by default).

    `overlap_step`: None (the default) or True updates each group while
    backward goes on, as soon as its gradients of the step are complete
    (the last micro-batch's backward with grad_accumulation_steps), so that
    step() has little left to do; the result is bitwise that of False,
    which updates every group in step(). The engine speculates that the
    step is not clipped and its gradients are finite: after backward it
    redoes the update when clipping applies (clip_grad_norm_, the config's
    gradient_clipping) or step() gets other options (a scheduler stepped
    between backward and step()), which costs one more update of the
    groups, and drops it when the step is skipped (an fp16 overflow, a
    NaN). The first step is not overlapped, nor any after a step that
    fetched a group again after its gradients were complete (a forward
    between backward and step()) or handed a group more gradients than
    grad_accumulation_steps says (several backward passes summed into one
    step): an overlapped step cannot do that (docs/pytorch.md). True warns
    when that turns it off. The engine's stats() count what it did
    (speculated_steps, committed_steps, replayed_steps, discarded_steps,
    early_updates, exposed_step_s).

    fp16 (the config's fp16.enabled): the engine divides each step's
    gradients by its loss scale (DeepSpeed's semantics), so the loss must be
    scaled: `off.backward(loss)` (DeepSpeed's engine.backward), or
    `off.scale_loss(loss).backward()` (loss.float() * off.loss_scale, as
    torch's GradScaler.scale; off.optimizer has both too). A backward that
    reaches the offloaded parameters from an unscaled loss raises INVALID
    (nothing of it reaches the engine), unless `loss_scaled=True` says the
    code multiplies each loss by `off.loss_scale` itself. The engine skips a
    step whose gradients overflowed and lowers the scale; `off.loss_scale`
    is the scale for the next loss at any time. clip_grad_norm_ clips the
    unscaled gradients (on one rank, one backward a step, torch's
    arithmetic over gradient.float() / loss_scale).
    """
    return OffloadedModule(module, _with_torch_moment(_with_state_format(_config_dict(config), state_format)),
                           force_no_gpu,
                           grad_accumulation_steps, rank, world_size, overlap_step, loss_scaled)


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
