"""OffloadAdam's options: its arguments and param groups against the
AdamW it computes, and against the config's optimizer section (which of
them gives each hyperparameter, and what is refused); and what step()
checks of them, and of the gradients, before any engine steps."""

import math

import torch

from .. import Error, INVALID
from .._args import _step_options
from ._clip import _engine_clip_for
from ._group_engine import _overflowed, _param_label


_REFUSED_OPTIONS = ("amsgrad", "capturable", "differentiable", "fused")


def _check_group_options(group, where, decoupled=True, engine=None, defaults=None):
    """A param group (added, or loaded from a state_dict) that asks for an
    AdamW option the engine does not compute is refused, as the arguments
    are: it would train as plain AdamW without a word. So is one whose
    decoupled_weight_decay (torch 2.x's Adam and AdamW say it in each group:
    False is Adam's L2 decay) is not the engine's, `decoupled`, with a
    weight_decay other than 0 (where the two agree; None: the engine's
    optimizer has no such mode, nothing to compare). A group without the
    key (torch's Adam had none before 2.x: 1.13's Adam and AdamW state_dicts
    hold the same keys) cannot say: it is taken as the engine's. `engine`:
    the engine's optimizer, as the refusal names it (None: OffloadAdam);
    `defaults`: the optimizer's, which the group's absent keys take."""
    if not isinstance(group, dict):
        return  # (torch's own add_param_group says what is wrong)
    group = dict(defaults or {}, **group)
    for flag in _REFUSED_OPTIONS:
        if group.get(flag):
            raise Error(INVALID, f"{where} has {flag}={group[flag]!r}, which is not supported (the engine's "
                        "AdamW kernel computes torch's single-tensor/foreach AdamW, bitwise); leave it off")
    flag, decay = group.get("decoupled_weight_decay"), group.get("weight_decay")
    if flag is None or decoupled is None or bool(flag) == decoupled or not decay:
        return
    said = f"{where} has decoupled_weight_decay={flag!r} with weight_decay={decay!r}"
    if engine is None:
        raise Error(INVALID, f"{said}: Adam's L2 decay (added to the gradient); OffloadAdam is AdamW (decoupled "
                    "decay) and would train it as AdamW. For L2 decay use offload_module with the config's "
                    "optimizer {\"type\": \"Adam\", \"params\": {\"adam_w_mode\": false}}; else set "
                    "decoupled_weight_decay=True (torch.optim.AdamW's) or weight_decay=0")
    other = ("{\"type\": \"Adam\", \"params\": {\"adam_w_mode\": false}}" if decoupled else
             "{\"type\": \"AdamW\"} (or Adam with adam_w_mode true)")
    raise Error(INVALID, f"{said}, and the engine's optimizer is {engine} with adam_w_mode {str(decoupled).lower()} "
                f"({'decoupled' if decoupled else 'L2'} decay), which it would step with: load a state of torch.optim."
                f"{'AdamW' if decoupled else 'Adam'}, or make the config's optimizer {other}")


def _with_grads(groups, engines, world_size):
    """The ids of the parameters that step now: those whose .grad is set;
    with several ranks, those whose .grad is set on any rank — one sum over
    the ranks of each parameter's flag, on the first of `engines` (the
    optimizer's, in every rank's order) not handed this step's gradients
    (a collective, where every rank steps). A rank without one hands zeros
    in its place (_GroupEngine.hand_grads), so the parameter is updated
    with the ranks' mean gradient, as under torch DDP, whose all-reduce
    averages in the zeros of a rank that did not use it. Before, each rank
    stepped its own parameters: the one that missed a gradient split its
    engine alone (state read, new engines at new rendezvous ports) while the
    others handed theirs, and the ranks' collectives paired wrongly."""
    params = [p for g in groups for p in g["params"]]
    flags = [0.0 if p.grad is None else 1.0 for p in params]
    open_ = [ge for ge in engines if not ge.handed]
    if world_size > 1 and open_:
        flags = open_[0].engine.sum_over_ranks(flags)
    return {id(p) for p, n in zip(params, flags) if n}


def _check_step_groups(groups, where, stepping=None):
    """Before any engine steps: each param group that steps (a parameter
    has a gradient; `stepping`, where given: the ids of those that step,
    from _with_grads) gives the engine options it takes, so that a refusal
    changes nothing (each engine refuses its own options only after those
    before it stepped). A negative lr, beta, eps or weight_decay (an LR
    schedule gone below 0), NaN or infinity is refused (_step_options), a
    beta of 1 or more too (the kernels' range, [0, 1)), and the group's
    options as they are now (_check_group_options), each naming the group."""
    for k, group in enumerate(groups):
        if not any(p.grad is not None if stepping is None else id(p) in stepping for p in group["params"]):
            continue
        try:
            _step_options(group["lr"], group["betas"], group["eps"], group["weight_decay"], group.get("max_grad_norm"))
        except Error as e:
            raise Error(INVALID, f"{where}: param group {k}: {e.message}") from None
        for name, beta in zip(("beta1", "beta2"), group["betas"]):
            if not float(beta) < 1:
                raise Error(INVALID, f"{where}: param group {k}: step option {name} is {float(beta)!r}; allowed: "
                            "0 or more, below 1")
        _check_group_options(group, f"{where}: param group {k}")


def _refuse_nonfinite(stepping, groups, world_size, where):
    """strata.nonfinite "error" with several engines stepping (several param
    groups, or one split into cohorts): each engine refuses only its own
    gradients, after those before it stepped. So before any steps, a
    gradient that is not finite anywhere (on any rank: sums over the ranks,
    collectives every rank makes at this point) fails the step, INVALID
    naming its parameter and param group: nothing is updated, as the policy
    says. `stepping`: (param group, _GroupEngine) pairs."""
    engines = [ge for _, ge in stepping]
    seen = 1.0 if _overflowed(engines) else 0.0  # this rank's: one read back per device
    if world_size > 1:
        seen = engines[0].engine.sum_over_ranks([seen])[0]
    if not seen:
        return
    flags = [0.0 if p.grad is None or bool(torch.isfinite(p.grad).all()) else 1.0 for ge in engines for p in ge.params]
    if world_size > 1:
        flags = engines[0].engine.sum_over_ranks(flags)
    at = first = next(i for i, n in enumerate(flags) if n)
    for group, ge in stepping:
        if first < len(ge.params):
            break
        first -= len(ge.params)
    index = next(k for k, g in enumerate(groups) if g is group)
    ranks = f" on {int(flags[at])} of {world_size} ranks" if world_size > 1 else ""
    for other in engines:
        other.drop_handed()  # (gradients clip_grad_norm_ handed: the next step hands fresh ones)
    raise Error(INVALID, f"{where}: param group {index}'s {_param_label(ge.params[first], ge.names)} has a gradient "
                f"that is not finite (NaN or infinity){ranks}; strata.nonfinite is \"error\": nothing was updated "
                "(\"skip\" skips such a step whole)")


def _joint_clips(stepping, clip_next, hand):
    """The max_grad_norm each stepping engine gets. A clip bounds the
    norm of a set of parameters together, as torch's clip_grad_norm_
    over them: a param group's max_grad_norm, its group's; the config's
    gradient_clipping (None here: as the engines resolved it), every
    group's without one (DeepSpeed's global norm). Where such a set spans
    several engines (several param groups, or one split because some of
    its parameters missed a step), each engine's own norm is not the
    set's: each gets the max_grad_norm that scales its gradients by the
    set's coefficient, clip / (norm of the engines' norms + 1e-6), at
    most 1 (0: unclipped). Their norms are collectives with several
    ranks, taken in the same order on every rank. A set whose norm is
    not finite keeps each engine's clip: its steps skip (strata.nonfinite
    "skip": every engine's gradients were poisoned above), or apply or
    fail as that policy says. `hand(group, ge)` hands an engine its
    gradients: called for the engines of a set that spans several."""
    clips, sets = [], {}
    for k, (group, ge) in enumerate(stepping):
        clip = clip_next if clip_next is not None else group.get("max_grad_norm")
        clips.append(clip)
        sets.setdefault("config" if clip is None else ("group", id(group), clip), []).append(k)
    for key, ks in sets.items():
        limit = stepping[ks[0]][1].engine.config.get("gradient_clipping") if key == "config" else key[2]
        if len(ks) < 2 or not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0:
            continue
        for k in ks:
            hand(*stepping[k])
        norms = [stepping[k][1].engine.grad_norm() for k in ks]
        total = math.sqrt(math.fsum(n * n for n in norms))
        if not math.isfinite(total):
            continue
        coef = float(limit) / (total + 1e-6)
        for k, n in zip(ks, norms):
            clips[k] = _engine_clip_for(coef, n) if coef < 1.0 else 0.0
    return clips


_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}  # torch AdamW's


def _hyperparameters(config, **arguments):
    """OffloadAdam is AdamW: (lr, betas, eps, weight_decay) from its
    arguments, where given; else from the config's optimizer section, where
    it has a value ("auto" is none); else torch AdamW's defaults. A config
    optimizer of another type (or Adam with L2 decay, adam_w_mode false) is
    refused, and so is an argument that differs from the config's value,
    naming both: neither is overridden without a word."""
    opt = config.get("optimizer")
    opt = opt if isinstance(opt, dict) else {}  # absent, null or "auto": the arguments and defaults fill it
    kind = opt.get("type", "AdamW")
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    if kind != "auto" and (not isinstance(kind, str) or kind.lower() not in ("adamw", "adam")):
        raise Error(INVALID, f"OffloadAdam: the config's optimizer.type is {kind!r}; OffloadAdam is AdamW. Use "
                    "offload_module for the config's optimizer, or leave the optimizer section out")
    if isinstance(kind, str) and kind.lower() == "adam" and params.get("adam_w_mode") is False:
        raise Error(INVALID, "OffloadAdam: the config's optimizer is Adam with adam_w_mode false (L2 decay); "
                    "OffloadAdam is AdamW (decoupled decay). Use offload_module for it, or leave the section out")
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def floats(key, v):  # betas as a tuple of floats, the others a float
        return tuple(float(b) for b in v) if key == "betas" else float(v)

    out = []
    for key, arg in arguments.items():
        given = params.get(key)
        if given is None or given == "auto":
            out.append(_ADAMW_DEFAULTS[key] if arg is None else arg)
            continue
        if not (isinstance(given, (list, tuple)) and len(given) == 2 and all(map(number, given))
                if key == "betas" else number(given)):
            raise Error(INVALID, f"OffloadAdam: the config's optimizer.params.{key} is {given!r}; "
                        f"{'two numbers' if key == 'betas' else 'a number'} or \"auto\"")
        value = floats(key, given)
        if arg is not None and floats(key, arg) != value:
            raise Error(INVALID, f"OffloadAdam: the config's optimizer.params.{key} is {given!r} and the "
                        f"argument {key}={arg!r}; give one, or make them agree (param groups may still set "
                        "their own)")
        out.append(value if arg is None else arg)
    return tuple(out)


def _filled_by_arguments(path):
    """Where OffloadAdam's engine config got the value at `path`: its
    optimizer section is OffloadAdam's own (the param group's options)."""
    if path[:1] != ("optimizer",):
        return "Strata's default"
    return f"OffloadAdam's {path[2]}=" if len(path) == 3 and path[1] == "params" else "OffloadAdam's arguments"
