"""strata.torch's configs, ranks and engines: the config as the engines get
it (state format, torch's first-moment arithmetic), this process's rank
and world size, one engine's rendezvous port and its own swap folders
(and the swap folders of killed engines, removed).

"auto" and null mean the default for every key and every section, as the
engine reads them (docs/config.md): what is read here takes them as
absent (_absent, _section), never calling a method on them.
"""

import copy
import fcntl
import hashlib
import itertools
import json
import operator
import os
import re
import shutil
import stat
import time
import warnings

import torch

from .. import CONFIG, Engine, Error, INVALID

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
    strata_keys = _own_section(config, "strata")
    if strata_keys is None:  # (not an object: the engine refuses it, naming it)
        return config
    if not _absent(strata_keys.get("state_format")) and strata_keys["state_format"] != state_format:
        raise ValueError(f"state_format={state_format!r} differs from the config's strata.state_format "
                         f"{strata_keys['state_format']!r}; give one")
    strata_keys["state_format"] = state_format
    return config


def _config_dict(config):
    """A copy of the user's config (a dict, a JSON string or None) that the
    functions here may change. Invalid JSON, or a top level that is not an
    object, is CONFIG, as the engine says it."""
    if config is None:
        return {}
    if isinstance(config, (str, bytes, bytearray)):
        try:
            config = json.loads(config)
        except ValueError as e:
            raise Error(CONFIG, f"config: invalid JSON: {e}") from None
    if not isinstance(config, dict):
        raise Error(CONFIG, f"config: the top level must be a JSON object, got {type(config).__name__} "
                    f"{json.dumps(config, default=repr)[:80]}")
    return copy.deepcopy(config)


def _absent(value):
    """Whether a config value means "the default": missing, null or "auto"."""
    return value is None or _is_auto(value)


def _section(config, *path):
    """The section at a key path of the config, {} where it or one above it
    is missing, null, "auto" (its defaults) or not an object (the engine
    refuses that, naming it). Read only: not the config's own dict where
    there is none."""
    for key in path:
        config = config.get(key) if isinstance(config, dict) else None
    return config if isinstance(config, dict) else {}


def _own_section(config, key):
    """config[key] to change in place: a new {} where it is missing, null or
    "auto"; None where it is something else (the engine refuses it)."""
    sec = config.get(key)
    if _absent(sec):
        sec = config[key] = {}
    return sec if isinstance(sec, dict) else None


def _with_torch_moment(config):
    """config whose Adam/AdamW (the default optimizer) computes the first
    moment as this torch does, unless the config says otherwise ("auto" or
    null: not otherwise)."""
    opt = _own_section(config, "optimizer")
    if opt is None:
        return config
    kind = opt.get("type")
    if _absent(kind) or str(kind).lower() in ("adam", "adamw"):
        params = _own_section(opt, "params")
        if params is not None and _absent(params.get("moment_update")):
            params["moment_update"] = _MOMENT_UPDATE
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
    """Exactly "auto", as the engine reads it (its IsAuto): "Auto" or
    "AUTO" is no default there, and is not here either."""
    return isinstance(value, str) and value == "auto"


def _at(config, path):
    """The value at a key path of the config; None where there is none."""
    for key in path:
        if not isinstance(config, dict):
            return None
        config = config.get(key)
    return config


def _given(config, path):
    """Whether the key path is in the config (its value null included)."""
    for key in path:
        if not isinstance(config, dict) or key not in config:
            return False
        config = config[key]
    return True


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
    """Refuses a config whose learning rate is "auto" or null (itself, or
    its section): the engine reads both as its default, and nothing here
    fills them."""
    for path in _LR_PATHS:
        if _given(config, path) and _absent(_at(config, path)):
            raise Error(INVALID, f"{who}: the config's {'.'.join(path)} is {json.dumps(_at(config, path))}, and "
                        "nothing fills the learning "
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
                if isinstance(sec, dict) and _a_path(sec.get("nvme_path")):
                    zero[section] = dict(sec, nvme_path=own(sec["nvme_path"]))
        st = cfg.get("strata")
        if isinstance(st, dict) and isinstance(st.get("nvme_paths"), list):
            cfg["strata"] = dict(st, nvme_paths=[own(p) if _a_path(p) else p for p in st["nvme_paths"]])
    except BaseException:  # (a later path refused: the folders made before it go)
        _remove_swap_folders(made.values())
        raise
    return cfg


def _a_path(value):
    """Whether a configured nvme_path names a folder ("auto", null, "" and
    non-strings do not: the engine's default, or its refusal)."""
    return isinstance(value, str) and value != "" and not _is_auto(value)


def _subfolder(path, tag):
    """The engine's own folder under a configured nvme_path, which must
    exist: a mistyped mount point is refused, never created (the swap files
    would land on whatever disk holds the new folder). Killed engines'
    folders beside it go first (_remove_dead_swap_folders)."""
    if not os.path.isdir(path):
        raise Error(INVALID, f"nvme_path {path!r} does not exist or is not a folder: the swap files go there; "
                    "create it (on the NVMe drive) or fix the path")
    if _ENGINE_FOLDER.match(tag):
        _remove_dead_swap_folders(path, tag)
    sub = os.path.join(path, tag)
    try:
        os.mkdir(sub, 0o700)  # (the user's alone: other users may not list the swap files)
    except FileExistsError:
        _check_own_folder(sub)
    return sub


def _check_own_folder(sub):
    """An engine folder that exists already under its name: taken only where
    it is a real folder (not a link: os.lstat) of this user with no group or
    other permission bits, as _subfolder makes them; anything else (a link
    to another folder, another user's, a folder others may list) is
    refused, naming it."""
    st = os.lstat(sub)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
            "not a folder" if not stat.S_ISDIR(st.st_mode) else \
            f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else f"mode {stat.S_IMODE(st.st_mode):o}"
        raise Error(INVALID, f"swap folder {sub!r} exists and is {kind}: an engine's swap folder must be a real "
                    f"folder of this user (uid {os.getuid()}) with mode 0700; remove it (or fix the nvme_path)")


def _swap_folders(cfg):
    """The engine's swap folders that cfg names (after _separate_swap_folders:
    the ones made for it)."""
    zero = _section(cfg, "zero_optimization")
    out = [_section(zero, s).get("nvme_path") for s in ("offload_optimizer", "offload_param")]
    paths = _section(cfg, "strata").get("nvme_paths")
    return sorted({p for p in out + (paths if isinstance(paths, list) else []) if _a_path(p)})


# ---- Swap folders: a killed engine's ----------------------------------------------
#
# An engine killed (SIGKILL, the OOM killer, torchrun stopping its workers,
# scancel) leaves its folder under the nvme_path, and the fallocated swap
# files in it (about 12 bytes per parameter): the engine sweeps only its own
# folder, and the next run's has another name. A new engine's folder made
# under an nvme_path removes, first, the ones beside it that no engine uses:
# named by this scheme exactly, holding nothing but swap files, made by a
# process that is gone, and each swap file's flock free (the engine holds
# an exclusive flock on its swap files for its life, tiers/nvme_tier.cpp:
# a live one in another pid namespace or on another host keeps it). A
# process just killed may hold its flocks a moment longer (its io_uring is
# torn down asynchronously): a held one is retried for up to 3 s, once per
# folder in a process. A folder with no swap file goes only an hour after
# its last change (its engine may be about to make them, its pid unknown
# here).
#
# Only this host's folders, of this pid namespace: the name carries a key of
# both (_host_key), and a folder with another key, or none, is never
# touched. On a file system several hosts share (BeeGFS by default, Lustre
# with localflock, NFS with local_lock=flock) flock is each host's own and
# another host's pid looks gone here: without the key, a live engine of
# another host lost its swap files.

# offload_module's strata-<key>-<pid>-<id>, OffloadAdam's strata-<key>-<pid>-<id>-<group>-<n>
# (<key>: _host_key())
_ENGINE_FOLDER = re.compile(r"strata-([0-9a-f]{12})-([1-9][0-9]{0,9})-[0-9]{1,20}(?:-[0-9]{1,9}-[0-9]{1,20})?\Z")
# The engine's swap files: strata-swap.r<rank>.s<i>.bin, strata-swap.r<rank>.s<i>.g<gen>.bin
_SWAP_FILE = re.compile(r"strata-swap\.r[0-9]{1,9}\.s[0-9]{1,9}(?:\.g[0-9]{1,9})?\.bin\Z")
_EMPTY_FOLDER_AGE_S = 3600
_LOCK_GRACE_S = 3.0
_BUSY = object()  # _remove_if_dead: a swap file's flock is held
_held_after_grace = set()  # (nvme_path, folder) whose flock stayed held for a grace: not waited for again


_HOST_KEY = None


def _host_key():
    """This host's and pid namespace's key in the engines' folder names: 12
    hex digits of a hash of the boot id and the pid namespace, the parts
    io/net/gloo_addresses.cpp's HostKey() reads (it: the net namespace).
    "0" where either cannot be read: no folder with it is ever swept (the
    scheme wants 12 hex digits), nor does its engine sweep."""
    global _HOST_KEY
    if _HOST_KEY is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                boot = f.read().strip()
            ns = os.readlink("/proc/self/ns/pid").encode()
        except OSError:
            boot = ns = b""
        _HOST_KEY = hashlib.sha256(boot + b"/" + ns).hexdigest()[:12] if boot and ns else "0"
    return _HOST_KEY


def _engine_tag(*parts):
    """The name of an engine's swap folder: strata-<key>-<pid>-<parts...>
    (offload_module's parts: its id; OffloadAdam's: its id, group, count)."""
    return "-".join(["strata", _host_key(), str(os.getpid()), *map(str, parts)])


def _boot_time():
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return int(line.split()[1])
    raise ValueError("no btime in /proc/stat")


def _creator_gone(pid, changed):
    """Whether process `pid`, which made a folder last changed at `changed`
    (epoch seconds), is gone: no such process, a zombie, or a process that
    started after the change (the pid reused). Where unsure: not gone."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (another user's: it lives)
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return True
        started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return started > changed + 2  # (btime is whole seconds)
    except (OSError, ValueError, IndexError):
        return False


def _remove_if_dead(parent, name):
    """Removes folder `name` under the open folder `parent` where no engine
    uses it; the bytes of the swap files it held, or None where it stays
    (_BUSY: a swap file's flock is held, by a live engine or one dying)."""
    pid = int(_ENGINE_FOLDER.match(name).group(2))
    fds = []
    try:
        folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        fds.append(folder)
        st = os.fstat(folder)
        files = os.listdir(folder)
        if st.st_uid != os.geteuid() or not all(_SWAP_FILE.match(f) for f in files):
            return None
        if not _creator_gone(pid, st.st_mtime):
            return None
        if not files and time.time() - st.st_mtime < _EMPTY_FOLDER_AGE_S:
            return None
        size = 0
        for f in files:
            fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
            fds.append(fd)
            held = os.fstat(fd)
            if not stat.S_ISREG(held.st_mode):
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _BUSY
            named = os.stat(f, dir_fd=folder, follow_symlinks=False)
            if (named.st_ino, named.st_dev) != (held.st_ino, held.st_dev):
                return None
            size += held.st_size
        for f in files:  # (a checkpoint that links a swap file keeps its data: only this name goes)
            os.unlink(f, dir_fd=folder)
        os.rmdir(name, dir_fd=parent)  # (fails where a file came in since: the folder stays)
        return size
    except OSError:
        return None
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _remove_dead_swap_folders(path, keep):
    """Removes the folders of killed engines under nvme_path `path` (keeping
    `keep`, the new engine's), saying so in one warning. Never raises an
    OSError: what cannot be read or removed stays."""
    removed, size = [], 0
    where = os.path.abspath(path)
    try:
        parent = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        key = _host_key()
        names = sorted(n for n in os.listdir(parent)
                       if n != keep and (m := _ENGINE_FOLDER.match(n)) and m.group(1) == key)
        deadline = time.monotonic() + _LOCK_GRACE_S
        while names:
            busy = []
            for name in names:
                freed = _remove_if_dead(parent, name)
                if freed is _BUSY:
                    busy.append(name)
                elif freed is not None:
                    removed.append(name)
                    size += freed
            names = [n for n in busy if (where, n) not in _held_after_grace]
            if names and time.monotonic() >= deadline:
                _held_after_grace.update((where, n) for n in names)
                break
            if names:
                time.sleep(0.02)
    except OSError:
        pass
    finally:
        os.close(parent)
    if removed:
        warnings.warn(f"strata.torch: removed {len(removed)} swap folder(s) under {path} left by engines whose "
                      f"process is gone (killed before they closed), with {size} bytes of swap files: "
                      f"{', '.join(removed)}", stacklevel=2)


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
