"""The C library under strata: its status codes and Error, the structs of
include/strata/strata.h as ctypes sees them, and the library loaded with
every function's signature. strata.Engine and strata.adam_step call it.
"""

import ctypes
import ctypes.util
import os

# strata_status_t, in order.
STATUS_NAMES = ("OK", "INVALID", "CONFIG", "NOMEM", "IO", "NOSPACE", "CORRUPT", "COMM", "TIMEOUT",
                "UNSUPPORTED", "STATE", "INTERNAL", "NOT_FOUND")
(OK, INVALID, CONFIG, NOMEM, IO, NOSPACE, CORRUPT, COMM, TIMEOUT, UNSUPPORTED, STATE,
 INTERNAL, NOT_FOUND) = range(len(STATUS_NAMES))

# strata_dtype_t
DTYPE_F32, DTYPE_BF16, DTYPE_F16 = 0, 1, 2
_DTYPE_NAMES = {DTYPE_F32: "f32", DTYPE_BF16: "bf16", DTYPE_F16: "f16"}


class Error(RuntimeError):
    """A failed Strata call: `status` (an int, e.g. strata.CONFIG), `status_name`
    ("CONFIG") and the library's detailed `message`."""

    def __init__(self, status, message):
        self.status = status
        self.status_name = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else "UNKNOWN"
        self.message = message
        super().__init__(f"{self.status_name}: {message}")



# ---- The C structs (the fields of strata.h, in order) -----------------------

class _EngineOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("rank", ctypes.c_int), ("world_size", ctypes.c_int),
                ("grad_accumulation_steps", ctypes.c_int), ("force_no_gpu", ctypes.c_int),
                ("overlap_step", ctypes.c_int), ("device", ctypes.c_int),
                ("skip_groups_without_grads", ctypes.c_int)]


class _StepOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("lr", ctypes.c_double), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("max_grad_norm", ctypes.c_double)]


class _StepResult(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("grad_norm", ctypes.c_double), ("skipped", ctypes.c_int),
                ("loss_scale", ctypes.c_double)]


class _TierStats(ctypes.Structure):
    _fields_ = [("budget", ctypes.c_uint64), ("used", ctypes.c_uint64), ("peak", ctypes.c_uint64)]


class _Stats(ctypes.Structure):
    _fields_ = ([("struct_size", ctypes.c_size_t)] +
                [(t, _TierStats) for t in ("device", "host", "nvme")] +
                [(n, ctypes.c_uint64) for n in ("nvme_to_host", "host_to_nvme", "host_to_device",
                                                "device_to_host", "fetches", "prefetch_hits", "fetch_stalls")] +
                [(n, ctypes.c_double) for n in ("fetch_stall_s", "disk_busy_s", "copy_busy_s", "cpu_optimizer_s",
                                                "step_wall_s", "overlap_efficiency")] +
                [(n, ctypes.c_uint64) for n in ("steps", "skipped_steps", "device_cached", "device_raw_allocs",
                                                "device_pool_hits")] +
                [(n, ctypes.c_int) for n in ("gpu_device", "numa_node")] +
                [(n, ctypes.c_uint64) for n in ("speculated_steps", "committed_steps", "replayed_steps",
                                                "discarded_steps", "early_updates")] +
                [("exposed_step_s", ctypes.c_double), ("unspeculated_steps", ctypes.c_uint64)] +
                [(n, ctypes.c_uint64) for n in ("act_host_bytes", "act_nvme_bytes", "act_redeemed",
                                                "act_prefetch_hits", "act_stalls")] +
                [("act_stall_s", ctypes.c_double), ("act_live_bytes", ctypes.c_uint64),
                 ("p_gathers", ctypes.c_uint64), ("step_read_ahead_bytes", ctypes.c_uint64),
                 ("write_behind_steps", ctypes.c_uint64)] +
                [(n, ctypes.c_double) for n in ("comm_s", "comm_cpu_s")] +
                [(n, ctypes.c_uint64) for n in ("reduced_bytes", "gathered_bytes")] +
                [("behind_wait_s", ctypes.c_double), ("lent_reduced_bytes", ctypes.c_uint64)] +
                [("cpu_kernel_threads", ctypes.c_int)])


class _AdamOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("lr", ctypes.c_double), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("step", ctypes.c_int64), ("mode", ctypes.c_int), ("grad_scale", ctypes.c_double),
                ("grad_dtype", ctypes.c_int), ("param_copy_dtype", ctypes.c_int)]



# ---- The library ------------------------------------------------------------

_lib = None


def _installed_library():
    """The libstrata.so that `cmake --install` put beside this package (its
    _installed.py says where, relative to here); None for a source tree."""
    try:
        from . import _installed
    except ImportError:
        return None
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), _installed.LIBRARY))


def _load():
    global _lib
    if _lib is not None:
        return _lib
    path = (os.environ.get("STRATA_LIBRARY") or _installed_library() or ctypes.util.find_library("strata")
            or "libstrata.so.0")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise Error(UNSUPPORTED, f"cannot load the Strata library {path!r} ({e}); "
                    "set STRATA_LIBRARY to the path of libstrata.so") from None
    P, I, U64, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int
    sigs = {
        "strata_version": ([], ctypes.c_int),
        "strata_status_name": ([S], ctypes.c_char_p),
        "strata_last_error": ([], ctypes.c_char_p),
        "strata_host_memory": ([ctypes.POINTER(U64), ctypes.POINTER(I)], S),
        "strata_engine_create": ([ctypes.c_char_p, ctypes.POINTER(_EngineOptions), ctypes.POINTER(P)], S),
        "strata_engine_destroy": ([P], S),
        "strata_engine_add_param": ([P, I, ctypes.c_char_p, U64, P, ctypes.POINTER(U64)], S),
        "strata_engine_add_param_shaped": ([P, I, ctypes.c_char_p, I, ctypes.POINTER(ctypes.c_int64), P,
                                            ctypes.POINTER(U64)], S),
        "strata_engine_build": ([P], S),
        "strata_engine_freeze_group": ([P, I], S),
        "strata_engine_group_frozen": ([P, I, ctypes.POINTER(I)], S),
        "strata_engine_add_alias": ([P, I, ctypes.c_char_p, ctypes.c_char_p], S),
        "strata_engine_fetch": ([P, I, P, ctypes.POINTER(P)], S),
        "strata_engine_release": ([P, I, P], S),
        "strata_engine_grads": ([P, I, P, I, P], S),
        "strata_engine_grads_part": ([P, I, U64, U64, P, I], S),
        "strata_engine_grads_part_lend": ([P, I, U64, U64, P, I], S),
        "strata_engine_grads_end": ([P, I], S),
        "strata_engine_grads_lent": ([P, I, ctypes.POINTER(I)], S),
        "strata_engine_grads_view": ([P, I, ctypes.POINTER(P)], S),
        "strata_engine_takes_grad_parts": ([P, I, I, ctypes.POINTER(I)], S),
        "strata_engine_stash": ([P, P, U64, P, ctypes.POINTER(U64)], S),
        "strata_engine_redeem": ([P, U64, P, U64, P], S),
        "strata_engine_drop_stash": ([P, U64], S),
        "strata_engine_prepare_step": ([P, ctypes.POINTER(_StepOptions)], S),
        "strata_engine_step": ([P, ctypes.POINTER(_StepOptions), ctypes.POINTER(_StepResult)], S),
        "strata_engine_grad_norm": ([P, ctypes.POINTER(ctypes.c_double)], S),
        "strata_engine_sum_over_ranks": ([P, ctypes.POINTER(ctypes.c_double), ctypes.c_size_t], S),
        "strata_engine_loss_scale": ([P, ctypes.POINTER(ctypes.c_double)], S),
        "strata_engine_config": ([P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)], S),
        "strata_engine_read_master": ([P, I, P], S),
        "strata_engine_num_groups": ([P, ctypes.POINTER(I)], S),
        "strata_engine_group_numel": ([P, I, ctypes.POINTER(U64)], S),
        "strata_engine_compute_dtype": ([P, ctypes.POINTER(I)], S),
        "strata_engine_device_is_gpu": ([P, ctypes.POINTER(I)], S),
        "strata_engine_placement": ([P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)], S),
        "strata_engine_stats": ([P, ctypes.POINTER(_Stats)], S),
        "strata_adam_step": ([ctypes.POINTER(_AdamOptions), ctypes.c_size_t, P, P, P, P, P], S),
        "strata_checkpoint_save": ([P, ctypes.c_char_p, ctypes.c_char_p, P, U64], S),
        "strata_engine_read_state": ([P, I, I, P], S),
        "strata_engine_write_state": ([P, I, I, P], S),
        "strata_engine_get_steps": ([P, ctypes.POINTER(ctypes.c_int64)], S),
        "strata_engine_set_steps": ([P, ctypes.c_int64], S),
        "strata_engine_group_steps": ([P, I, ctypes.POINTER(ctypes.c_int64)], S),
        "strata_engine_set_group_steps": ([P, I, ctypes.c_int64], S),
        "strata_engine_span_begin": ([P, ctypes.c_char_p, ctypes.POINTER(U64)], S),
        "strata_engine_span_end": ([P, U64], S),
        "strata_engine_write_trace": ([P], S),
        "strata_checkpoint_load": ([P, ctypes.c_char_p, ctypes.c_char_p, P, ctypes.POINTER(U64)], S),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _lib = lib
    return lib


def _check(status):
    if status != 0:
        raise Error(status, _load().strata_last_error().decode("utf-8", "replace"))


def _sized(cls, **fields):
    s = cls(**fields)
    s.struct_size = ctypes.sizeof(cls)
    return s
