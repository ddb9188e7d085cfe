"""Python values as the C API takes them: integers checked against their C
types, buffers' addresses, dtype codes, streams, shapes, counts, the step's
options, and a device buffer for torch.as_tensor. The binding (__init__.py)
calls these (and OffloadAdam, _step_options over its param groups before any
engine steps)."""

import ctypes
import math
import operator

from ._capi import (DTYPE_BF16, DTYPE_F16, DTYPE_F32, INVALID, Error, _DTYPE_NAMES, _StepOptions, _sized)

# The C integer types the binding hands the library, as (lowest, highest):
# ctypes wraps a Python int outside them silently (2**64 + 5 to 5, 2**32 + 1
# to 1), so _c_integer refuses it first.
C_INT = (-2**31, 2**31 - 1)
INT64 = (-2**63, 2**63 - 1)
UINT64 = (0, 2**64 - 1)
POINTER = (0, 2**(8 * ctypes.sizeof(ctypes.c_void_p)) - 1)  # an address, a CUDA stream


def _bound_text(b):
    """A range's bound as a message says it: 2^64-1, -2^31, 2^40, else the number."""
    for k in (64, 63, 40, 32, 31):
        for text, v in ((f"2^{k}", 2**k), (f"2^{k}-1", 2**k - 1), (f"2^{k}-2", 2**k - 2), (f"-2^{k}", -2**k)):
            if b == v:
                return text
    return str(b)


def _c_integer(value, call, name, ctype=UINT64, allowed=None):
    """`value` as the Python int that `call` hands the library as `name`, a C
    integer of type `ctype` ((lowest, highest): C_INT, INT64, UINT64,
    POINTER). As _group (__init__.py): what operator.index takes (an int,
    numpy's and torch's integer scalars) and nothing else (a float, a numeric
    string, a bool: int() would cut 2.9 to 2), and only what the type holds
    (ctypes would wrap the rest); else INVALID naming the call, the argument
    and the value, with the range the API takes (`allowed`, (lowest,
    highest); the type's by default). A value the type holds but the API
    does not take (world_size -1, steps 2^63-1) is the library's to refuse,
    with its own message."""
    try:
        v = (None if isinstance(value, bool) or str(getattr(value, "dtype", "")).endswith("bool")
             else operator.index(value))
    except TypeError:
        v = None
    if v is None:
        raise Error(INVALID, f"{call}: {name} {value!r} is not an integer")
    if not ctype[0] <= v <= ctype[1]:
        lo, hi = allowed or ctype
        raise Error(INVALID, f"{call}: {name} {v} is outside {_bound_text(lo)}..{_bound_text(hi)}")
    return v


_OPTION_LOWEST = {"rank": 0, "world_size": 0, "grad_accumulation_steps": 1, "device": -1}


def _option_ints(**values):
    """strata.Engine's integer options (C ints in strata_engine_options_t),
    checked; the library refuses the rest of the type (world_size -1, a rank
    past the world size), as before."""
    return {n: _c_integer(v, "Engine", n, C_INT, (_OPTION_LOWEST[n], C_INT[1])) for n, v in values.items()}


def _step_count(value, call, name="steps", allowed=(0, INT64[1] - 1)):
    """A step count (an int64_t): set_steps' and set_group_steps' (the API
    takes 0..2^63-2 and refuses the rest of the type itself), adam_step's
    options.step (1-based: `allowed` (1, 2^63-1))."""
    return _c_integer(value, call, name, INT64, allowed)


def _address(x, call="address", name="address"):
    """The address of a buffer: a torch tensor (contiguous), a numpy array or
    an int (in 0..2^64-1: INVALID naming `call` and `name` otherwise)."""
    if x is None:
        return None
    if isinstance(x, int):
        return _c_integer(x, call, name, POINTER)
    if hasattr(x, "data_ptr"):  # torch.Tensor
        if not x.is_contiguous():
            raise Error(INVALID, "the tensor must be contiguous")
        return x.data_ptr()
    if hasattr(x, "ctypes"):  # numpy.ndarray
        if not x.flags["C_CONTIGUOUS"]:
            raise Error(INVALID, "the array must be contiguous")
        return x.ctypes.data
    raise Error(INVALID, f"expected a tensor, an array or an address, not {type(x).__name__}")


_DTYPE_CODES = {v: k for k, v in _DTYPE_NAMES.items()}  # "f32" -> DTYPE_F32, ...


def _dtype_of(x, what="gradients"):
    """The C dtype of a tensor or array; INVALID naming `what` (the call and
    argument) for another dtype."""
    name = str(getattr(x, "dtype", ""))
    for key, code in (("bfloat16", DTYPE_BF16), ("float16", DTYPE_F16), ("half", DTYPE_F16),
                      ("float32", DTYPE_F32)):
        if name.endswith(key):
            return code
    raise Error(INVALID, f"{what} is {name or type(x).__name__}; it must be float32, bfloat16 or float16")


def _dtype_code(dtype, call):
    """The C dtype of a dtype name ("f32", "bf16", "f16"); INVALID naming the call otherwise."""
    code = _DTYPE_CODES.get(dtype) if isinstance(dtype, str) else None
    if code is None:
        raise Error(INVALID, f"{call}: dtype {dtype!r} is not one of {', '.join(map(repr, _DTYPE_CODES))}")
    return code


def _device_type(x):
    """'cpu' for host memory (an array, an address, a CPU tensor), else the
    tensor's device type ('cuda')."""
    dev = getattr(x, "device", None)
    return getattr(dev, "type", "cpu") if dev is not None and not isinstance(x, int) else "cpu"


def _host_engine_takes(call, name, x, engine):
    """An engine without a GPU reads and writes host memory: a CUDA tensor
    given to it is refused (the engine takes addresses as given, and a CUDA
    pointer read as host memory faults)."""
    if _device_type(x) != "cpu" and not engine.on_gpu:
        raise Error(INVALID, f"{call}: {name} is on {x.device}; this engine has no GPU: its memory is the host's")


def _f32_host(call, name, x):
    """`x` is float32 host memory (an address is taken as such)."""
    if isinstance(x, int):
        return
    if _device_type(x) != "cpu":
        raise Error(INVALID, f"{call}: {name} is on {x.device}; it takes host memory")
    dtype = str(getattr(x, "dtype", ""))
    if not dtype.endswith("float32"):
        raise Error(INVALID, f"{call}: {name} is {dtype or type(x).__name__}; it must be float32 (the kernel "
                    "reads and writes 4-byte floats there)")


def _stream_handle(stream, call="stream"):
    if stream is None or isinstance(stream, int):
        return None if stream is None else _c_integer(stream, call, "stream", POINTER)
    return getattr(stream, "cuda_stream", None)  # torch.cuda.Stream


def _shape_tuple(name, shape):
    """`shape` (a sequence of ints, or a torch.Size) as a tuple of ints; anything
    else is refused naming the tensor."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise Error(INVALID, f"add_param '{name}': shape {shape!r} is not a sequence of ints") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) and not hasattr(d, "__index__"):
            raise Error(INVALID, f"add_param '{name}': shape {shape!r} holds {d!r}, not an int")
    dims = tuple(int(d) for d in dims)
    for i, d in enumerate(dims):
        if d >= 1 << 62:  # ctypes would wrap it silently
            raise Error(INVALID, f"add_param '{name}': dim {i} of shape {list(dims)} is too large")
    return dims


def _numel(x, call="numel"):
    """A tensor's or array's element count, or an int as add_param's numel
    (a uint64_t: INVALID naming `call` beyond it; the API takes 1..2^40)."""
    if isinstance(x, int):
        return _c_integer(x, call, "numel", UINT64, (1, 2**40))
    return int(x.numel()) if callable(getattr(x, "numel", None)) else int(x.size)


def _step_options(lr, betas, eps, weight_decay, max_grad_norm=None):
    """The step's options as the C API takes them: None is "the config's
    value" (the C API's -1). A negative value, NaN or infinity is refused,
    naming it: the C API reads any negative as the config's value, so an LR
    schedule gone below 0 would have trained at the config's lr silently."""
    b1, b2 = (None, None) if betas is None else betas
    values = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    for name, x in values.items():
        if x is None:
            values[name] = -1.0
            continue
        values[name] = f = float(x)
        if not (0 <= f < math.inf):
            allowed = "0 (no clipping) or more" if name == "max_grad_norm" else "a finite number, 0 or more"
            raise Error(INVALID, f"step option {name} is {f!r}; allowed: {allowed}, or None (the config's value)")
    return _sized(_StepOptions, **values)


class _CudaArray:
    """A device buffer described by __cuda_array_interface__ (for torch.as_tensor)."""

    def __init__(self, address, numel, typestr):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (address, False),
                                         "version": 2, "strides": None}


def _as_f32_host(x):
    """x as a contiguous float32 host buffer (torch tensor or numpy array)."""
    if hasattr(x, "detach"):  # torch
        import torch
        return x.detach().to(device="cpu", dtype=torch.float32).contiguous()
    import numpy as np
    return np.ascontiguousarray(x, dtype=np.float32)
