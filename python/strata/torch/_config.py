"""strata.torch's configs, ranks and engines: the config as the engines get
it (state format, torch's first-moment arithmetic), this process's rank
and world size, one engine's rendezvous port and its own swap folders.
"""

import copy
import itertools
import json
import operator
import os
import shutil
import warnings

import torch

from .. import Engine, Error, INVALID

_TORCH2 = int(torch.__version__.split(".")[0]) >= 2
# The first moment as this torch's AdamW computes it: 1.x exp_avg.mul_(b1).add_(g, alpha=1-b1),
# 2.x exp_avg.lerp_(g, 1-b1) (engine config optimizer.params.moment_update).
_MOMENT_UPDATE = "lerp" if _TORCH2 else "mul_add"


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


def _with_torch_moment(config):
    """config whose Adam/AdamW (the default optimizer) computes the first
    moment as this torch does, unless the config says otherwise."""
    opt = config.setdefault("optimizer", {})
    if str(opt.get("type", "AdamW")).lower() in ("adam", "adamw"):
        opt.setdefault("params", {}).setdefault("moment_update", _MOMENT_UPDATE)
    return config


# ---- "auto": what the Hugging Face Trainer fills for DeepSpeed ---------------------
#
# A ds_config written for the Trainer says "auto" where the Trainer fills in
# its own arguments (learning_rate, adam_beta1, ...) before DeepSpeed reads
# it. Nothing does that for strata.torch (the Trainer, given optimizers=,
# hands its arguments to no one), and the engine reads "auto" as its
# default. For the learning rate that default (1e-3) is 20 times the
# Trainer's (5e-5) and right only by chance: offload_module, where the
# config is the learning rate's only source, refuses it. Every other
# "auto" the engine fills is said once, with its value.

_LR_PATHS = (("optimizer",), ("optimizer", "params"), ("optimizer", "params", "lr"))


def _is_auto(value):
    return isinstance(value, str) and value.lower() == "auto"


def _at(config, path):
    """The value at a key path of the config; None where there is none."""
    for key in path:
        if not isinstance(config, dict):
            return None
        config = config.get(key)
    return config


def _autos(config, path=()):
    """The key paths whose value is "auto", in the config's order."""
    if _is_auto(config):
        yield path
    elif isinstance(config, dict):
        for key, value in config.items():
            yield from _autos(value, path + (key,))


def _count(value, what, who):
    """value as an integer >= 1 (an int, numpy's, a 0-d tensor: operator.index), or INVALID naming it."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise Error(INVALID, f"{who}: {what} is {value!r}; an integer >= 1")
    return n


def _accumulation_steps(config, given, world, who):
    """The backward passes a step averages over, as deepspeed.initialize
    takes them (a ds_config that says 8 must not train with 1, the 8
    gradients summed where DeepSpeed averages them): the argument, where
    given; else the config's gradient_accumulation_steps; else, where the
    config gives train_batch_size and train_micro_batch_size_per_gpu,
    train_batch_size / (micro batch x ranks); else 1. "auto" is no value.
    An argument that differs from the config's count, and batch sizes that
    do not divide (or, with all three keys, do not multiply out), are
    refused, as DeepSpeed refuses the latter."""
    def key(name):
        v = config.get(name)
        return None if v is None or _is_auto(v) else _count(v, f"the config's {name}", who)
    gas, tbs, micro = (key(k) for k in ("gradient_accumulation_steps", "train_batch_size",
                                        "train_micro_batch_size_per_gpu"))
    given = None if given is None else _count(given, "grad_accumulation_steps", who)
    if tbs is not None and micro is not None:
        if gas is None:
            if tbs % (micro * world):
                raise Error(INVALID, f"{who}: the config's train_batch_size {tbs} is not a multiple of "
                            f"train_micro_batch_size_per_gpu {micro} x {world} rank(s); DeepSpeed refuses it too")
            gas = tbs // (micro * world)
        elif tbs != micro * gas * world:
            raise Error(INVALID, f"{who}: the config's train_batch_size {tbs} is not train_micro_batch_size_per_gpu "
                        f"{micro} x gradient_accumulation_steps {gas} x {world} rank(s); DeepSpeed refuses it too")
    if gas is None:
        return 1 if given is None else given
    if given is not None and given != gas:
        raise Error(INVALID, f"{who}: grad_accumulation_steps={given} and the config's {gas} backward passes a step "
                    "(gradient_accumulation_steps, or train_batch_size over the micro batches) differ; give one, "
                    "or make them agree")
    return gas


def _refuse_auto_lr(config, who):
    """Refuses a config whose learning rate is "auto" (itself, or its
    section): nothing here fills it."""
    for path in _LR_PATHS:
        if _is_auto(_at(config, path)):
            raise Error(INVALID, f"{who}: the config's {'.'.join(path)} is \"auto\", and nothing fills the learning "
                        "rate here: the engine would take its default lr 0.001, where the Hugging Face Trainer's "
                        "learning_rate defaults to 5e-05 (a Trainer given optimizers= hands its arguments to no "
                        "one). Give the learning rate itself: optimizer.params.lr (e.g. your "
                        "TrainingArguments.learning_rate)")


def _say_autos(config, engine_config, who, said, source=lambda path: "Strata's default"):
    """Warns once (per key in `said`, a set) of each "auto" of `config` that
    the engine filled, with the value it has in `engine_config`; `source`
    names where a value came from. Keys the engine leaves to the trainer
    (train_batch_size, scheduler) fill nothing, and the ones it resolves
    from the machine (the budgets) stay "auto": neither is said."""
    for path in _autos(config):
        key = ".".join(path)
        value = _at(engine_config, path)
        if key in said or value is None or _is_auto(value):
            continue
        said.add(key)
        warnings.warn(f"{who}: the config's {key} is \"auto\", which nothing fills from a trainer's arguments here: "
                      f"it is {json.dumps(value, sort_keys=True)} ({source(path)}); give the value itself to silence "
                      "this", stacklevel=2)


def _torch_dtype(name):
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]


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


# ---- Swap folders: one engine's own ---------------------------------------------

def _separate_swap_folders(cfg, tag):
    """Gives one engine its own swap subfolders: engines in one process must
    not share swap files. Returns cfg with new dicts for the sections it
    changes: a section dict shared by offload_param and offload_optimizer
    (the docs' Hugging Face example) was given the subfolder twice
    (strata-X/strata-X, the outer one left after close). One subfolder per
    distinct path."""
    made = {}  # configured path -> the engine's folder under it

    def own(path):
        key = os.path.normpath(path)
        if key not in made:
            made[key] = _subfolder(path, tag)
        return made[key]

    cfg = dict(cfg)
    try:
        zero = cfg.get("zero_optimization")
        if isinstance(zero, dict):
            zero = cfg["zero_optimization"] = dict(zero)
            for section in ("offload_optimizer", "offload_param"):
                sec = zero.get(section)
                if isinstance(sec, dict) and sec.get("nvme_path"):
                    zero[section] = dict(sec, nvme_path=own(sec["nvme_path"]))
        st = cfg.get("strata")
        if isinstance(st, dict) and st.get("nvme_paths"):
            cfg["strata"] = dict(st, nvme_paths=[own(p) for p in st["nvme_paths"]])
    except BaseException:  # (a later path refused: the folders made before it go)
        _remove_swap_folders(made.values())
        raise
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


# ---- Streams and devices ----------------------------------------------------------

def _current_stream(device):
    return torch.cuda.current_stream() if device == "cuda" else None


def _engine_device(engine):
    """The torch device of the engine's buffers, with its index on a GPU (the
    engine made its GPU current on this thread when it was created)."""
    if not engine.on_gpu:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
