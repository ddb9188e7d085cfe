"""How OffloadAdam cuts a param group into engine groups, and where it homes
the engine's copy of the parameters, so that its host memory follows the
model and the host budget instead of a fixed bucket.

Where OffloadAdam's host memory goes with its state on NVMe (no GPU), per
engine group of n elements (fp32) and for the whole model of N:

  step staging   slots x (W, M, V, G [, P]) x 4 n   (engine/layout/staging_plan.cpp
                 PlanStaging: every slot holds the LARGEST group's states;
                 slots = offload_optimizer.buffer_count, 3..16, default 4)
  grad staging   4 n      (G is not addressable in place)
  hand_grads     4 n      (_GroupEngine's flat bucket tensor, one at a time)
  P              4 N      (offload_param "none": the device tier, without a
                 GPU a host arena, holds a full copy of the parameters)

torch AdamW adds 8 N (two moments) and a temporary or two. A fixed 4M bucket
makes the step staging 4 slots x 4 states x 16 MiB = 256 MiB whatever the
model (measured on resnet18: the host tier's peak 257 MiB, P 45 MiB, peak
RSS 334 MiB above the model's own, torch AdamW's 104); and a parameter
larger than the bucket makes its own group, so the largest parameter sets
the slot size (resnet18: 2.4M; a 4096 x 4096 Linear: 16.8M, 1 GiB of
slots). And P alone is half of torch's 8 N. Hence the three parts here:

  auto_bucket_numel  the group size from the model's size and the host
                     budget, so the staging stays a small share of 8 N;
  split_buckets      the groups, with parameters larger than the bucket cut
                     across groups (AdamW is elementwise, so the cut changes
                     no result), so no parameter sets the slot size;
  lean_host_config   P homed on NVMe beside the state (no GPU, one rank), with
                     a device budget of a few groups: OffloadAdam's own
                     parameters are the model's copy; the engine's is one
                     group at a time (it costs a P write and read a step:
                     4 + 4 bytes a parameter on 32 for W, M, V and G).
"""

import copy
import re

from .. import CONFIG, Error

DEFAULT_BUCKET_NUMEL = 1 << 22  # the largest group: 16 MiB a fp32 state block
MIN_BUCKET_NUMEL = 1 << 16  # the smallest: 256 KiB blocks still keep a disk busy
# The step's staging may take this share of the parameters' fp32 bytes: with
# 4 slots about 1.5 bytes a parameter, a fifth of torch AdamW's 8.
STAGING_SHARE = 0.375
# And at most this share of the host budget.
BUDGET_SHARE = 0.25
# Device-tier copies of P that lean_host_config leaves room for: the one a
# fetch uses, and prefetched ones.
P_COPIES = 3


def _section(config, *keys):
    d = config
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d if isinstance(d, dict) else {}


def _device(config, section):
    d = _section(config, "zero_optimization", section).get("device", "none")
    return str(d).lower() if d is not None else "none"


def _slots(config):
    n = _section(config, "zero_optimization", "offload_optimizer").get("buffer_count", 4)
    try:
        return min(max(int(n), 3), 16)  # engine/layout/staging_plan.cpp StepSlots
    except (TypeError, ValueError):
        return 4  # the engine refuses it, naming it


def _choice(config, section, key):
    """A choice as the engine reads it: lower-cased (ObjectReader::Choice)."""
    v = _section(config, *section).get(key)
    return v.lower() if isinstance(v, str) else v


def _half(config):
    """Whether P is 2 bytes: bf16 (or its other spelling, bfloat16) or fp16
    enabled. Only true is: the engine reads "auto" (or null) as absent,
    false by default; anything else it refuses, naming it."""
    return any(_section(config, key).get("enabled") is True for key in ("bf16", "bfloat16", "fp16"))


def _staged_bytes_per_element(config):
    """Host bytes a group's element costs at the step when the optimizer
    state is on NVMe: the staging slots (W, M, V, G and P, each in every
    slot), the gradient staging, hand_grads' flat tensor and the device
    tier's copies of P."""
    compact = _choice(config, ("strata",), "state_format") == "compact"
    p = 2 if _half(config) else 4
    state = 6 if compact else 12  # W, M, V
    g = 2 if _choice(config, ("data_types",), "grad_accum_dtype") == "bf16" else 4
    return _slots(config) * (state + g + p) + g + 4 + P_COPIES * p


# base/sizes.cpp ParseByteSize's grammar (docs/config.md): ASCII whitespace
# anywhere is dropped and letters lower-cased; digits, an optional fraction,
# an optional exponent (e, a sign, digits: else the e is the unit's), a unit.
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"([0-9]*)(?:\.([0-9]*))?(?:e([+-]?[0-9]+))?(.*)", re.S)
_MAX_BYTES = (1 << 63) - 1
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _byte_size(text):
    """The bytes a size string says, exactly as the engine reads it; a str
    saying why not where the engine refuses it."""
    if len(text.encode("utf-8", "surrogatepass")) > 64:
        return "expected a byte size (a number of bytes or a string like \"8GiB\") or \"auto\""
    s = "".join(c for c in text if c not in " \t\n\v\f\r").translate(_ASCII_LOWER)
    if s.startswith("-"):
        return f"byte size '{text}' is negative"
    whole, frac, exp, unit = _SIZE.fullmatch(s).groups()
    if not whole and not frac:
        return f"byte size '{text}' is not a number with an optional unit (e.g. 64MiB, 2GB, 1e8, 4.1GB)"
    if unit not in _UNITS:
        return f"byte size '{text}' has an unknown unit '{unit}' (use B, KB, KiB, MB, MiB, GB, GiB, TB, TiB)"
    e10 = max(min(int(exp or 0), 100000), -100000) - len(frac or "")  # (the engine's exponent saturates)
    raw = (whole or "") + (frac or "")
    digits = int(raw or "0") * _UNITS[unit]
    if digits == 0:
        return 0
    significant = raw.strip("0")
    if len(significant) > 38:  # as the engine: exact up to 38 significant digits
        magnitude = len(raw.lstrip("0")) + e10 + (len(str(_UNITS[unit])) - 1 if _UNITS[unit] % 10 == 0 else 0)
        return f"byte size '{text}' is {'too large' if magnitude > 19 else 'not a whole number of bytes'}"
    if e10 > 40:  # at least 10^40 bytes: too large without computing it
        return f"byte size '{text}' is too large"
    num, den = (digits * 10**e10, 1) if e10 >= 0 else (digits, 10**-e10)
    if num % den:
        return f"byte size '{text}' is not a whole number of bytes"
    return num // den if num // den <= _MAX_BYTES else f"byte size '{text}' is too large"


def _host_budget(config):
    """strata.host_budget in bytes as the engine reads it (a number, or a
    size string such as "1GiB"); None for "auto" (absent, null). What the
    engine refuses is refused here, CONFIG naming the key, as the engine's
    would: the bucket is not sized by a budget the engine does not have."""
    b = _section(config, "strata").get("host_budget")
    if b is None or b == "auto":
        return None
    if isinstance(b, str):
        n = _byte_size(b)
    elif isinstance(b, bool) or not isinstance(b, (int, float)):
        n = "expected a byte size (a number of bytes or a string like \"8GiB\") or \"auto\", got " + repr(b)
    elif not b >= 0:  # (NaN too)
        n = f"{b!r} is negative; expected a non-negative integer"
    elif b > _MAX_BYTES:  # (exact: a float is compared with the int as it is)
        n = f"{b!r} is out of range; allowed: from 0 to {_MAX_BYTES}"
    elif b != int(b):
        n = f"{b!r} is not a whole number; expected a non-negative integer"
    else:
        n = int(b)
    if isinstance(n, str):
        raise Error(CONFIG, f"strata.host_budget: {n}")
    if n < 1:
        raise Error(CONFIG, f"strata.host_budget: {b!r} is too small; allowed: at least 1 bytes, or \"auto\"")
    return n


def auto_bucket_numel(total_numel, config, *, host_ram_bytes=None, ranks_on_host=None):
    """Elements per engine group for a param group of `total_numel`
    elements under `config` (the engine's config, as OffloadAdam passes it).

    With the optimizer state on NVMe every group's W, M, V, G pass through
    host staging slots sized to the largest group (see the module's
    docstring), so the group is sized to keep that staging at about
    STAGING_SHARE of the parameters' fp32 bytes (1.5 bytes a parameter with
    the default 4 slots; torch AdamW adds 8) and at most BUDGET_SHARE of the
    host budget (strata.host_budget when given, in bytes or as a size
    string such as "1GiB", read as the engine reads it, CONFIG where the
    engine would refuse it; else the engine's
    "auto": half of `host_ram_bytes` shared by `ranks_on_host`; None reads
    them as the engine does, strata.host_memory(): RAM under any cgroup
    memory limit, and the launcher's ranks on this host),
    rounded down to a power of two, and kept within
    [MIN_BUCKET_NUMEL, DEFAULT_BUCKET_NUMEL]: below 64K elements (256 KiB
    blocks) the disk's requests get too small to keep it busy, and above 4M
    a larger block moves no faster. resnet18 (11.7M) gets 128K, a 300M model
    4M. Other placements stage nothing a group (host-homed state is updated
    in place) and keep DEFAULT_BUCKET_NUMEL."""
    total_numel = int(total_numel)
    if total_numel < 0:
        raise ValueError(f"auto_bucket_numel: total_numel {total_numel} is negative")
    if ranks_on_host is not None and int(ranks_on_host) < 1:
        raise ValueError(f"auto_bucket_numel: ranks_on_host {ranks_on_host} is not at least 1")
    if _device(config, "offload_optimizer") != "nvme":
        return DEFAULT_BUCKET_NUMEL
    per = _staged_bytes_per_element(config)
    want = int(STAGING_SHARE * 4 * total_numel / per)
    budget = _host_budget(config)
    if budget is None:
        if host_ram_bytes is None or ranks_on_host is None:
            ram, ranks = _host_memory()
            host_ram_bytes = ram if host_ram_bytes is None else host_ram_bytes
            ranks_on_host = ranks if ranks_on_host is None else ranks_on_host
        budget = host_ram_bytes // 2 // int(ranks_on_host) if host_ram_bytes else None
    if budget is not None:
        want = min(want, int(BUDGET_SHARE * budget / per))
    want = min(max(want, MIN_BUCKET_NUMEL), DEFAULT_BUCKET_NUMEL)
    return 1 << (want.bit_length() - 1)


def _host_memory():
    """(bytes, ranks on this host) as the engine's "auto" budgets see them
    (strata_host_memory); physical RAM and one rank where the library
    cannot say (launcher variables it refuses: the engine refuses them
    too, at create, naming them)."""
    from .. import Error, host_memory
    try:
        return host_memory()
    except Error:
        import os
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), 1
        except (ValueError, OSError, AttributeError):
            return None, 1


def split_buckets(numels, bucket_numel):
    """Cuts tensors of `numels` elements, in order, into buckets of
    `bucket_numel` elements (the last may be smaller): a list of buckets,
    each a list of (tensor index, first element, count). A tensor larger
    than the room left in a bucket continues in the next, so every bucket
    but the last is full and none is larger than bucket_numel. Empty tensors
    take no room but keep an entry (count 0) in the bucket they fall in."""
    bucket_numel = int(bucket_numel)
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel {bucket_numel} is not a positive number of elements")
    buckets, current, room = [], [], bucket_numel
    for i, n in enumerate(numels):
        n = int(n)
        if n < 0:
            raise ValueError(f"tensor {i} has {n} elements")
        if n == 0 and not current and buckets:
            buckets[-1].append((i, 0, 0))  # no bucket of empty tensors alone
            continue
        start = 0
        while True:
            take = min(n - start, room)
            if take > 0 or n == 0:
                current.append((i, start, take))
            start += take
            room -= take
            if room == 0:
                buckets.append(current)
                current, room = [], bucket_numel
            if start >= n:
                break
    if current:
        buckets.append(current)
    return buckets


def lean_host_config(config, bucket_numel, *, on_gpu, world_size):
    """`config` (not changed) or a copy whose engine keeps its copy of the
    parameters (P) on NVMe, one group at a time in host memory, instead of a
    whole copy in the device tier's host arena. Only where that copy is a
    second one of OffloadAdam's parameters in host memory and the engine
    can home P on NVMe: the optimizer state is on NVMe, no GPU (`on_gpu`
    False: with one, P is on the GPU), one rank (below stage 3 several ranks
    keep every parameter: nvme is refused), and the config says nothing of
    offload_param (nor of DeepSpeed's deprecated cpu_offload_param, which
    the engine reads as offload_param cpu) or strata.device_budget ("auto"
    or null says nothing: the engine reads it as absent). P then goes to the
    optimizer's swap folder and the device tier gets P_COPIES groups of P.
    The stage becomes 3: with one rank the engine partitions nothing at any
    stage, and below 3 it warns that DeepSpeed would ignore offload_param (a
    key the caller never wrote)."""
    if on_gpu or world_size > 1 or _device(config, "offload_optimizer") != "nvme":
        return config
    zero, own = _section(config, "zero_optimization"), _section(config, "strata")
    if any(d.get(k, "auto") not in ("auto", None) for d, k in ((zero, "offload_param"), (zero, "cpu_offload_param"),
                                                               (own, "device_budget"))):
        return config
    path = _section(config, "zero_optimization", "offload_optimizer").get("nvme_path")
    if not path and not _section(config, "strata").get("nvme_paths"):
        return config  # the engine refuses it, naming the missing path
    cfg = copy.deepcopy(config)
    z = cfg["zero_optimization"]
    z["offload_param"] = {"device": "nvme", "nvme_path": path} if path else {"device": "nvme"}
    z["stage"] = 3
    cfg.setdefault("strata", {})["device_budget"] = P_COPIES * int(bucket_numel) * (2 if _half(cfg) else 4) + (1 << 20)
    return cfg
