"""OffloadAdam: torch's AdamW with its master weights and moments in
Strata's tiers, one _GroupEngine per set of parameters stepped together.
"""

import copy
import itertools
import warnings
import weakref

import torch

from .. import Error, INVALID, STATE
from .._native import at_child_exit
from . import _signals, _sizing
from ._adam_options import (_check_group_options, _check_step_groups, _filled_by_arguments, _hyperparameters,
                            _joint_clips, _refuse_nonfinite, _with_grads)
from ._clip import (_OWNERS, _check_clip_args, _clip_result, _engine_max_norm, _torch_clip_grad_norm,
                    _torch_norm_of, _torch_total_norm)
from ._config import (_MOMENT_UPDATE, _TORCH2, _absent, _config_dict, _engine_tag, _remove_swap_folders,
                      _resolve_ranks, _say_autos, _separate_swap_folders, _swap_folders, _with_state_format)
from ._group_engine import (_GroupEngine, _check_params, _close_all, _nonfinite, _overflowed, _param_label,
                            _skipped_since, _split_names, _step_marks)
from ._loss_scale import _LossScaling, _Scaler, _ScalesLoss, _fp16_section, _unscale_factor
from ._offload_adam_state import _AdamStateDict
from ._offload_optimizer import _closure_loss

class OffloadAdam(_ScalesLoss, _AdamStateDict, torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) whose fp32 master
    weights and moments live in Strata's tiers (host memory or NVMe, as the
    config says). The parameters stay ordinary tensors: step() hands each
    gradient to the engine, steps, and copies the new weights back. Values
    written into a parameter since (the model's load_state_dict after the
    optimizer was made) are what the next step starts from, as with torch's
    AdamW; not a write through p.data, which torch does not count.

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
    kernel rounds differently); a group with decoupled_weight_decay=False
    (torch Adam's L2 decay) and weight_decay other than 0 is refused (a torch
    Adam state_dict's too). On one rank clip_grad_norm_ is torch's own
    for float32 gradients; for bf16/fp16 ones it is torch's over float32
    masters whose .grad is .grad.float() (a float32 norm, never a bf16 one),
    and the step applies the coefficient (.grad keeps its values).
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
    clip_grad_norm_(), below, which also returns the norm). A parameter
    steps when its .grad is set on any rank (the ranks agree at each step),
    with the mean over the ranks, zeros for a rank whose .grad is None (one
    whose batch did not use it), as torch DDP's all-reduce averages it.

    Clipping by the step: `max_grad_norm` is a param group's option (the
    argument is every group's default), and clips the norm of that group's
    gradients, as torch's clip_grad_norm_ over the group's parameters; the
    config's gradient_clipping clips the norm of every other group's
    together (DeepSpeed's global norm). Either spans the group's engines
    (one split because a parameter missed a step included). A step whose
    gradients hold NaN or infinity anywhere is skipped whole (strata.nonfinite
    "skip", the default: no parameter changes, the step counts stay);
    "error" raises INVALID naming the parameter, and none changes either.

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
    the model and the host budget (strata.torch._sizing.auto_bucket_numel: 64Ki to
    4Mi elements with the state on NVMe, 4Mi otherwise). With the state on
    NVMe, no GPU and one rank, the engine's copy of the parameters goes to
    NVMe too unless the config places it (strata.torch._sizing.lean_host_config).

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
    by `opt.loss_scale` itself. step() unscales the gradients (times the
    float32 1/scale, as the engine and torch's GradScaler do), skips the whole step when any gradient overflowed (no
    parameter changes, the step count stays) and updates the scale: one
    dynamic scale for every engine of the optimizer (the config's
    initial_scale_power, loss_scale_window, hysteresis, min_loss_scale),
    kept in state_dict() as "loss_scaler". .grad keeps the scaled values;
    clip_grad_norm_ clips the unscaled ones (on one rank bitwise torch's
    clip_grad_norm_ over float32 masters whose .grad is .grad.float() times
    the float32 1 / loss_scale).
    """

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, config=None,
                 bucket_numel=None, force_no_gpu=False, rank=None, world_size=None,
                 max_grad_norm=None, state_format=None, loss_scaled=False):
        _check_group_options(dict(amsgrad=amsgrad, capturable=capturable, differentiable=differentiable,
                                  fused=fused), "OffloadAdam(...)")
        self._config = _with_state_format(_config_dict(config), state_format)
        # Arguments not given take the config's optimizer values, else torch
        # AdamW's defaults; one given must agree with the config's.
        lr, betas, eps, weight_decay = _hyperparameters(self._config, lr=lr, betas=betas, eps=eps,
                                                        weight_decay=weight_decay)
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid hyperparameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        # fp16: the scaler is ours, one for every engine (see _Scaler); the
        # engines get unscaled gradients and a static scale of 1.
        fp16 = _fp16_section(self._config)
        self._scaler = _Scaler(fp16) if fp16.get("enabled") is True else None
        if self._scaler is not None:
            fp16["loss_scale"] = 1.0
        # (The scaler, not self, in the function: the optimizer holds
        # _scaling, and a reference back would make a cycle that keeps a
        # dropped optimizer's engines until the cyclic collector runs.)
        self._scaling = _LossScaling("OffloadAdam", self._scaler is not None, loss_scaled,
                                     lambda scaler=self._scaler: scaler.scale)
        self._clip_coef = None  # fp16 on one rank: torch's clip coefficient, applied to the unscaled gradients
        params, self._param_names = _split_names(params)
        self._bucket_numel = bucket_numel
        self._force_no_gpu = force_no_gpu
        self._rank, self._world_size = _resolve_ranks(rank, world_size, "OffloadAdam")
        self._clip_next = None  # from clip_grad_norm_, for the coming step
        self._stepping = None  # several ranks: clip_grad_norm_'s _with_grads, for the coming step
        self._autos_said = set()  # the config's "auto" keys warned of (_config._say_autos)
        # Per param group, its cohorts: _GroupEngines whose parameters have
        # been stepped together since each first had a gradient (so they
        # share a step count, as torch's per-parameter "step" would be). A
        # parameter that never had a gradient (frozen) is in none: it has
        # no state and is never changed.
        self._cohorts = []
        self._closed = False
        self._broken = None  # why the optimizer cannot go on (a step that failed with gradients held), if so
        self._tags = itertools.count()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=bool(maximize), foreach=foreach, capturable=False, differentiable=False,
                        fused=None, max_grad_norm=max_grad_norm)
        if _TORCH2:
            defaults["decoupled_weight_decay"] = True  # torch 2.x's AdamW says so in its groups
        super().__init__(params, defaults)  # (each group through add_param_group, below)

    def _clip_ids(self):
        return {id(p) for group in self.param_groups for p in group["params"]}

    def add_param_group(self, param_group):
        """torch's add_param_group; a group refused (its options, its
        parameters, the config) is not added."""
        self._check_open("add_param_group")
        _check_group_options(param_group, "OffloadAdam: a param group", defaults=self.defaults)  # before it is added
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            _check_params(self.param_groups[index]["params"], self._param_names, "OffloadAdam",
                          [p for g in self.param_groups[:index] for p in g["params"]])
            # The trainable parameters' engine is made now, not at the first
            # step, so that a bad config fails at construction; their initial
            # master weights are their values now, and values written into
            # them later (the model's load_state_dict) are taken at the next
            # step (_take_written). A group with none gets its config
            # checked by an engine of one element.
            trainable = [p for p in self.param_groups[index]["params"] if p.requires_grad]
            if trainable:
                self._cohorts.append([self._new_engine(index, trainable)])
            else:
                self._new_engine(index, [torch.zeros(1)]).close()
                self._cohorts.append([])
        except BaseException:
            self.param_groups.pop()
            raise
        for p in self.param_groups[index]["params"]:  # torch's clip_grad_norm_ over them comes here
            _OWNERS[id(p)] = self

    def _check_open(self, what):
        if self._closed:
            raise Error(STATE, f"OffloadAdam.{what}: the optimizer is closed (its state was freed); make a new one")
        if self._broken and what != "load_state_dict":
            raise Error(STATE, f"OffloadAdam.{what}: {self._broken}; load_state_dict a state saved before, or make "
                        "a new optimizer")

    def _new_engine(self, index, params):
        group = self.param_groups[index]
        tag = _engine_tag(id(self), index, next(self._tags))
        cfg = _separate_swap_folders(copy.deepcopy(self._config), tag)
        try:
            return self._new_engine_in(cfg, group, params)
        except BaseException:
            with _signals.deferred():  # (a second Ctrl-C waits until the undo is done: _signals)
                _remove_swap_folders(_swap_folders(cfg))  # (_GroupEngine removes them itself where it fails)
                raise

    def _new_engine_in(self, cfg, group, params):
        """_new_engine's engine, its swap folders made (cfg names them)."""
        if not isinstance(cfg.get("optimizer"), dict):  # "auto" or null: the section's defaults, filled below
            cfg["optimizer"] = {}
        opt = cfg["optimizer"]
        opt["type"] = "AdamW"
        if not isinstance(opt.get("params"), dict):
            opt["params"] = {}
        hyper = opt["params"]
        hyper.update(lr=group["lr"], betas=list(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"])
        if _absent(hyper.get("moment_update")):  # (missing, null or "auto": as this torch's AdamW computes the first moment)
            hyper["moment_update"] = _MOMENT_UPDATE
        # The groups' size from the model and the host budget, and the
        # engine's copy of the parameters on NVMe where it would be a second
        # one in host memory (_sizing.py says why and what it costs).
        bucket = self._bucket_numel or _sizing.auto_bucket_numel(sum(p.numel() for p in params), cfg)
        on_gpu = not self._force_no_gpu and torch.cuda.is_available()
        cfg = _sizing.lean_host_config(cfg, bucket, on_gpu=on_gpu, world_size=self._world_size)
        ge = _GroupEngine(cfg, params, bucket, self._force_no_gpu, self._rank, self._world_size, self._param_names)
        # In a multiprocessing child, closed (its swap folder removed) at the
        # child's exit, which skips the __del__ of what is still referenced.
        at_child_exit(ge, _close_at_child_exit, weakref.ref(ge))
        _say_autos(self._config, ge.engine.config, "OffloadAdam", self._autos_said, _filled_by_arguments)
        return ge

    def _take_written(self, where):
        """Values written into the parameters since the engines last set
        them (the model's load_state_dict after the optimizer was made, an
        in-place change between steps) become their masters, as torch's
        AdamW steps from what a parameter holds (_GroupEngine.take_written).
        An engine handed this step's gradients already (clip_grad_norm_ with
        several ranks) cannot take values until its step: a write into its
        parameters since is refused, naming one. With several ranks taking
        is a collective, so the decision is every rank's: one sum over the
        ranks of whether each wrote (and where some did, of each parameter's
        flag); a parameter written on some ranks only is refused on every
        rank, naming it (before: the ranks that wrote read and wrote the
        state alone, and the others' next collective hung)."""
        open_, written = [], []
        for ge in self._engines:
            changed = ge.written()
            if ge.handed:
                if changed:
                    raise Error(INVALID, f"OffloadAdam.{where}: {_param_label(ge.params[changed[0]], ge.names)} "
                                "was written after clip_grad_norm_ handed this step's gradients to the engine, "
                                "which takes new values between steps only: write before clip_grad_norm_, or "
                                "after step()")
                continue
            open_.append(ge)
            written.append(changed)
        if not open_:
            return
        if self._world_size > 1:
            anyone = open_[0].engine.sum_over_ranks([1.0 if any(written) else 0.0])[0]
            if anyone == 0:
                return
            flags = []
            for ge, changed in zip(open_, written):
                mine = [0.0] * len(ge.params)
                for i in changed:
                    mine[i] = 1.0
                flags += mine
            counts = iter(open_[0].engine.sum_over_ranks(flags))
            for ge in open_:
                for p in ge.params:
                    n = next(counts)
                    if 0 < n < self._world_size:
                        raise Error(INVALID, f"OffloadAdam.{where}: {_param_label(p, ge.names)} was written "
                                    f"on {int(n)} of {self._world_size} ranks since the last step; its master "
                                    "is one for every rank: write on every rank alike (each rank's "
                                    "load_state_dict, not rank 0's alone)")
            # (Each parameter now written on every rank or on none: the
            # ranks read and write the same buckets below.)
        for ge, changed in zip(open_, written):
            if changed:
                ge.take_written(changed)

    @property
    def _engines(self):
        return [ge for cohorts in self._cohorts for ge in cohorts]

    def _regroup(self, index, with_grads):
        """The cohorts of param group `index` that step now, as torch
        AdamW's rule has it: a parameter without a gradient is skipped (no
        decay, moments and step count kept); one with a gradient is
        stepped. `with_grads`: the ids of those with one (_with_grads: on
        any rank, so that every rank regroups alike). A cohort whose
        parameters disagree is split (its state read out and written into
        two engines); parameters with a gradient for the first time form a
        new cohort, at step 0."""
        group = self.param_groups[index]
        # Every new engine is made before an old one is closed: a failure
        # (NOSPACE, NOMEM) closes the new ones and leaves the cohorts as
        # they were (it leaked the first part, or lost the split cohort).
        stepping, kept, made, retired = [], [], [], []
        try:
            for ge in self._cohorts[index]:
                have = [id(p) in with_grads for p in ge.params]
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
                        made.append(part)
                        part.write_states(sts)
                        part.engine.steps = ge.engine.steps
                        parts.append(part)
                    retired.append(ge)
                    stepping.append(parts[0])
                    kept.append(parts[1])
            known = {id(p) for ge in self._cohorts[index] for p in ge.params}
            new = [p for p in group["params"] if id(p) not in known and id(p) in with_grads]
            if new:
                made.append(self._new_engine(index, new))
                stepping.append(made[-1])
        except BaseException:
            with _signals.deferred():
                for part in made:
                    part.close()
                raise
        # The new cohorts first, then the old engines closed: an interrupt
        # while one is closed (its threads joined, its swap folder removed)
        # left the cohorts holding closed engines (every later call: STATE).
        self._cohorts[index] = stepping + kept
        for ge in retired:
            ge.close()
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
        self._check_open("clip_grad_norm_")
        _check_clip_args(max_norm, norm_type)
        self._check_scaled("clip_grad_norm_")
        self._take_written("clip_grad_norm_")  # (before any gradient is handed: the masters are written between steps)
        if params is None:
            params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if self._world_size == 1 and self._scaler is None and all(g.dtype == torch.float32 for g in grads):
            # One rank, float32 gradients: this rank's, in .grad; torch's own
            # function clips them, bitwise as torch would.
            total = _torch_clip_grad_norm(params, max_norm, norm_type=norm_type,
                                          error_if_nonfinite=error_if_nonfinite)
            self._clip_next = 0.0  # clipped, in .grad: the step clips no more (not at gradient_clipping)
            return total
        if self._world_size == 1:
            # One rank, fp16 (.grad holds the scaled gradients) or bf16
            # gradients (torch's own norm would be rounded to bf16): torch's
            # arithmetic over the float32 gradients the step gets, as over
            # float32 masters (.grad.float() times the float32 1 / loss_scale,
            # as step() unscales): its norms, and its coefficient, which
            # step() applies.
            inv = _unscale_factor(self.loss_scale)
            if not grads:
                return torch.tensor(0.0)
            total = _torch_total_norm([_torch_norm_of(g.float() * inv) for g in grads])
            if error_if_nonfinite and not torch.isfinite(total):
                _clip_result(float("inf"), norm_type, True)
            self._clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            self._clip_next = 0.0  # the coefficient is the clipping: the step clips no more
            return total
        # The parameters with a gradient on any rank, agreed by all (kept
        # for the step): every rank regroups alike, and refuses alike.
        if self._stepping is None:
            self._stepping = _with_grads(self.param_groups, self._engines, self._world_size)
        engines = self._regroup(0, self._stepping) if len(self.param_groups) == 1 else self._engines
        if len(self.param_groups) != 1 or len(engines) != 1:
            raise Error(INVALID, f"clip_grad_norm_ with several ranks: {len(self.param_groups)} param groups, "
                        f"{len(engines)} engines with gradients; one only (each has its own norm): pass "
                        "max_grad_norm per group instead")
        ge = engines[0]
        if not ge.handed:
            ge.hand_grads(negate=self.param_groups[0].get("maximize", False), scale=self.loss_scale)
        norm = ge.engine.grad_norm()
        result = _clip_result(norm, norm_type, error_if_nonfinite)  # raises before anything is set
        self._clip_next = _engine_max_norm(max_norm)  # (0 clips to exact zeros, infinity not at all, as torch's)
        return result

    # -- fp16 loss scaling (see the class docstring): _ScalesLoss
    def _check_scaled(self, what):
        if (self._scaling.checked and not self._scaling.since_step and
                any(p.grad is not None for group in self.param_groups for p in group["params"])):
            raise self._scaling.refusal(f"{what} got the gradients of",
                                        "Call opt.backward(loss) (or opt.scale_loss(loss).backward())")

    @torch.no_grad()
    def step(self, closure=None):
        self._check_open("step")
        loss = _closure_loss(closure)
        self._check_scaled("step()")
        self._take_written("step")
        # What clip_grad_norm_ prepared for this step (the ranks' agreement
        # on which parameters step, its clip, torch's coefficient) is taken
        # now, and put back where the step raises before any engine stepped
        # (Ctrl-C in _regroup, a refusal): a step() run again (a notebook
        # cell) is clipped, as after torch's clip_grad_norm_, which scaled
        # .grad itself. Before, the re-run stepped unclipped.
        prepared = self._stepping, self._clip_next, self._clip_coef
        self._stepping = self._clip_next = self._clip_coef = None
        results = []  # (grad_norm, skipped) per engine that stepped, in order
        try:
            self._step_engines(*prepared, results)
        except BaseException as e:
            with _signals.deferred():  # (a second Ctrl-C waits until the step is put back or ended: _signals)
                if not results:
                    self._stepping, self._clip_next, self._clip_coef = prepared
                else:  # (the engines that stepped did: the loss scale counts their step)
                    try:
                        self._after_engines(results)
                    except Exception as late:  # (the exception being handled is the one that goes on)
                        _note(f"OffloadAdam.step: ending the step after {type(e).__name__}: {late}", e)
                raise
        with _signals.deferred():  # (a Ctrl-C in the step's end waits until it is done)
            self._after_engines(results)
        return loss

    def _step_engines(self, agreed, clip_next, coef, results):
        """step()'s engines: each is handed its gradients and steps, and its
        new weights go into the parameters; (grad_norm, skipped) goes into
        `results` per engine as it steps."""
        # Which parameters step: one agreement of the ranks (clip_grad_norm_'s, where it made it).
        with_grads = agreed if agreed is not None else _with_grads(self.param_groups, self._engines,
                                                                    self._world_size)
        _check_step_groups(self.param_groups, "OffloadAdam.step", with_grads)  # (before any engine steps, or is made)
        scale = self.loss_scale
        stepping = [(group, ge) for index, group in enumerate(self.param_groups)
                    for ge in self._regroup(index, with_grads)]
        # A step is skipped whole when any gradient overflowed (fp16) or is
        # not finite (strata.nonfinite "skip", the default). Each engine
        # skips on its own gradients; with several, one that is not finite
        # here makes every other skip too (a NaN in its gradients; with
        # several ranks that reaches every rank's); "error" checks them all before any steps.
        poison = len(stepping) > 1 and (self._scaler is not None or _nonfinite(stepping[0][1]) == "skip") and \
            _overflowed([ge for _, ge in stepping if not ge.handed])
        if len(stepping) > 1 and self._scaler is None and _nonfinite(stepping[0][1]) == "error":
            _refuse_nonfinite(stepping, self.param_groups, self._world_size, "OffloadAdam.step")
        def hand(group, ge):
            if not ge.handed:
                ge.hand_grads(negate=group.get("maximize", False), scale=scale, coef=coef, poison=poison)

        # A clip spanning several engines needs all their norms first, so
        # their gradients are handed before any steps; every other engine's
        # just before its own step, as always.
        clips = _joint_clips(stepping, clip_next, hand)
        for k, ((group, ge), clip) in enumerate(zip(stepping, clips)):
            try:
                hand(group, ge)  # (all its buckets or none: hand_grads)
                # Read right before the step, after the gradients are
                # handed: a failure handing them (discard_grads, which the
                # engine runs as a skipped step) must not read as a step.
                counts = _step_marks(ge.engine)
            except BaseException as e:
                with _signals.deferred():  # (a second Ctrl-C waits until the undo is done: _signals)
                    self._drop_from(stepping, k, e)
                    raise
            try:
                result = ge.engine.step(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                        weight_decay=group["weight_decay"], max_grad_norm=clip)
            except BaseException as e:
                # The engine's Error (it refused the step, strata.nonfinite "error", or the
                # step failed and is left pending: IO, NOSPACE, a lost peer): nothing is recorded
                # as stepped (its counters move on such a step too). Another (a Ctrl-C): as the
                # native step returned (it stepped: its counters moved) or before it ran.
                with _signals.deferred():
                    skipped = None if isinstance(e, Error) else _skipped_since(ge.engine, counts)
                    if skipped is None:  # the engine did not step
                        self._drop_from(stepping, k, e)
                    else:  # (its norm was lost with the call)
                        self._finish_stepped(stepping, k, results, (float("nan"), skipped), e)
                    raise
            try:
                self._engine_stepped(ge)
            except BaseException as e:
                with _signals.deferred():
                    self._finish_stepped(stepping, k, results, result, e)
                    raise
            results.append(result)

    def _drop_from(self, stepping, k, e):
        """Engine k did not step: what the engines hold for this step goes
        (drop_handed): engine k's, so that the next step hands it fresh
        gradients (before, it stayed "handed" and its parameters silently
        missed that step; not where its failed step is pending: the same
        step again finishes it, with them), and those of the engines after
        it that were handed theirs for a joint clip (a later step would
        apply them). Where those cannot be dropped, the optimizer refuses to
        go on, saying so."""
        stepping[k][1].drop_handed()
        held = [g for _, g in stepping[k + 1:] if not g.drop_handed()]
        if held:
            self._broken = (f"a step failed ({e}) after {len(held)} more engine(s) were handed their "
                            "gradients for a joint clip; they could not be dropped")

    def _finish_stepped(self, stepping, k, results, result, e):
        """Engine k stepped, and then something raised (a Ctrl-C delivered
        as the native step, or a fetch of its copy back, returned). Its step
        is finished before the exception goes on (its new weights into the
        parameters, again whole; its step count; `result` counted), so that
        the model's weights are its masters and training goes on bitwise as
        if its step had completed (before, the weights stayed a step behind,
        silently). The engines after it have not stepped: as if the step had
        not started for them, what they were handed goes (zero_grad then
        drops .grad; a step() run again steps them from .grad). Whatever
        raises here, the exception being handled is the one that goes on."""
        if len(results) == k:
            results.append(result)
        try:
            self._engine_stepped(stepping[k][1])
        except Exception as late:
            _note(f"OffloadAdam.step: copying engine {k}'s stepped weights back failed again: {late}", e)
        finally:
            for _, later in stepping[k + 1:]:
                later.drop_handed()

    def _engine_stepped(self, ge):
        """An engine stepped: its new weights into the parameters and its
        step count into the state (idempotent: run again, it changes
        nothing more)."""
        ge.handed = False
        ge.copy_params_back()
        for p in ge.params:
            self.state[p]["step"] = torch.tensor(float(ge.engine.steps))

    def _after_engines(self, results):
        """The step's end, once some engine stepped: fp16's scale updated by
        whether they skipped, the backward count reset."""
        if self._scaler is not None and results:
            skipped = [k for _, k in results]
            if any(skipped) and not all(skipped):
                raise Error(STATE, f"OffloadAdam: fp16 step: {skipped.count(True)} of {len(skipped)} engines "
                            "skipped the step (an overflow) and the others did not; the optimizer is no longer "
                            "one model's (report this)")
            self._scaler.update(all(skipped))
        self._scaling.stepped()
        self.last_results = results  # (grad_norm, skipped) per engine that stepped

    def __setstate__(self, state):
        # torch's load_state_dict replaces each param group by the saved one:
        # keys a dict saved by another optimizer lacks (torch AdamW's has no
        # max_grad_norm) take this optimizer's defaults, as torch's own
        # optimizers fill theirs, not None (which would stop the clipping).
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def __deepcopy__(self, memo):
        raise Error(INVALID, "copy.deepcopy of an OffloadAdam: not supported (its state lives in the Strata engines, "
                    "which are not copied). Make a new OffloadAdam over the copy's parameters and "
                    "load_state_dict(opt.state_dict()) into it")

    def zero_grad(self, *args, **kwargs):
        """torch's zero_grad; and what clip_grad_norm_ prepared for a step
        that did not come goes with the gradients it was for, as torch's
        clip (which scales .grad itself) would: the clip, and gradients it
        handed to an engine already (several ranks; discard_grads, a
        collective where the step would have been). Before, the next step
        took the old clip, or the old handed gradients instead of the new."""
        self._clip_next, self._clip_coef, self._stepping = None, None, None
        if not self._closed:
            for ge in self._engines:
                ge.drop_handed(quiet=False)
        super().zero_grad(*args, **kwargs)

    def close(self):
        """Frees the engines (and their swap files). After it, step(),
        clip_grad_norm_, state_dict, load_state_dict and add_param_group
        raise STATE."""
        self._closed = True
        self._close_engines()

    def _close_engines(self):
        # (The cohorts emptied first: an interrupt during a close leaves none
        # that holds a closed engine.)
        old = self._engines
        self._cohorts = [[] for _ in self._cohorts]
        _close_all(old)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _close_at_child_exit(ref):
    ge = ref()
    if ge is not None:  # (None: collected, after its OffloadAdam closed it)
        ge.close()


def _note(message, exc):
    """`message` on the exception `exc` that goes on (another raised while
    it was handled, which would have replaced it)."""
    if hasattr(exc, "add_note"):  # (Python 3.11)
        exc.add_note(message)
    else:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
