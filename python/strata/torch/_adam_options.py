"""OffloadAdam's options: its arguments and param groups against the
AdamW it computes, and against the config's optimizer section (which of
them gives each hyperparameter, and what is refused)."""

from .. import Error, INVALID


_REFUSED_OPTIONS = ("amsgrad", "capturable", "differentiable", "fused")


def _check_group_options(group, where):
    """A param group (added, or loaded from a state_dict) that asks for an
    AdamW option the engine does not compute is refused, as the arguments
    are: it would train as plain AdamW without a word."""
    if not isinstance(group, dict):
        return  # (torch's own add_param_group says what is wrong)
    for flag in _REFUSED_OPTIONS:
        if group.get(flag):
            raise Error(INVALID, f"{where} has {flag}={group[flag]!r}, which is not supported (the engine's "
                        "AdamW kernel computes torch's single-tensor/foreach AdamW, bitwise); leave it off")


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
