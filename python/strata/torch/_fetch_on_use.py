"""Parameters that fetch themselves: the placeholder side of offload_module.

An offloaded parameter keeps its Python object (its name in the module,
its AccumulateGrad node, every reference user code holds) but its .data is
a one-element placeholder while the engine holds the values. Module hooks
fetch a module's own parameters around its forward; that is not enough,
because torch code reads parameters outside their module's forward:
nn.MultiheadAttention reads out_proj.weight itself, a parent reads a
child's weight, F.linear(x, other.weight), a head tied by reading the
embedding's weight.

So each offloaded parameter's class becomes _OffloadedParameter, an
nn.Parameter whose __torch_function__ runs before every torch function,
method and attribute access that involves it. One that reads values
fetches the parameter's group first (its owner decides how long it stays);
one that only reads metadata (shape, dtype, .grad, requires_grad) passes;
one that would change the values behind the engine's back (in-place ops,
.data = ..., out=) raises, naming the parameter; a write through what a
call outside every forward handed out (p.data, p.detach(), p.t()) is
refused when the owner next lets the group go (_ModuleHooks.handed_out).
A placeholder therefore never takes part in arithmetic: a read either sees
the real values or fails loudly.

Why not a placeholder tensor subclass (the issue's sketch): .data cannot
change a parameter's Python type, and autograd, optimizers and hooks hold
the parameter object itself; changing the object's class keeps identity,
isinstance(p, nn.Parameter) and the AccumulateGrad node, and costs one
Python call per torch call that involves an offloaded parameter.
"""

import collections
import threading
import weakref

import torch

from .. import Error, INVALID, STATE
from . import _saved_tensors as _saved

try:  # torch >= 2.0: subclasses only; 1.13: every torch function
    _NoTorchFunction = torch._C.DisableTorchFunctionSubclass
except AttributeError:
    _NoTorchFunction = torch._C.DisableTorchFunction

_tls = threading.local()  # .quiet: strata's own code is handling parameters

# id(parameter) -> _Entry. The owner and group are held weakly, so that a
# model dropped without close() is collected with its engine (the owner's
# finalizer, which then moves its live parameters to _ORPHANED). _api and
# _clip read entries by index: [0] the parameter's weakref, [1] its owner and
# [2] its group (weak proxies), [3] its name.
_Entry = collections.namedtuple("_Entry", "param owner group name owner_ref group_ref")
_OFFLOADED = {}

# id(parameter) -> (weakref to it, its name): parameters that outlived their
# collected owner (one kept from a model dropped without close()): they hold
# a placeholder, so a read raises STATE, never computes with it.
_ORPHANED = {}

# Attributes and methods that read no values: a released parameter answers
# them itself. Getters and setters are named "<attribute>.__get__"/"__set__".
_NO_VALUES = frozenset(
    [f"{a}.__get__" for a in (
        "grad", "_grad", "requires_grad", "shape", "dtype", "device", "is_leaf", "grad_fn", "_grad_fn", "layout",
        "ndim", "names", "is_sparse", "is_sparse_csr", "is_cuda", "is_cpu", "is_meta", "is_quantized", "is_mkldnn",
        "is_nested", "is_xpu", "is_mps", "is_vulkan", "is_ipu", "_backward_hooks", "_post_accumulate_grad_hooks",
        "_version", "output_nr", "_base", "name", "retains_grad", "itemsize", "_cdata", "_python_dispatch")]
    + [f"{a}.__set__" for a in ("grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks",
                                "name")]
    + ["size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "get_device",
       "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "__len__",
       "__hash__", "_is_view", "is_inference", "_has_compatible_shallow_copy_type", "is_same_size",
       "_is_zerotensor", "is_neg", "is_conj", "is_signed"])

# In-place methods that do not change values.
_INPLACE_METADATA = frozenset(["requires_grad_", "retain_grad", "share_memory_"])


def _func_key(func):
    name = getattr(func, "__name__", None) or str(func)
    if name in ("__get__", "__set__", "__delete__"):
        return f"{getattr(getattr(func, '__self__', None), '__name__', '?')}.{name}"
    return name


def _each_tensor(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _each_tensor(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _each_tensor(y, out)
    return out


class quiet:
    """Context: strata's own code touches offloaded parameters (sets .data,
    reads placeholders) without fetching them."""

    def __enter__(self):
        self.prev = getattr(_tls, "quiet", False)
        _tls.quiet = True

    def __exit__(self, *exc):
        _tls.quiet = self.prev
        return False


def unstick_quiet():
    """Turns quiet off where no strata code is inside a quiet() block on
    this thread: an offloaded module's forward starting, step(), zero_grad().
    CPython checks for signals at the start of a Python function, so a
    Ctrl-C can be delivered on entry to quiet.__exit__, before it restores
    the flag: it stayed on for good, and every later read of an offloaded
    parameter outside its module's forward computed with the placeholder
    (zeros) instead of fetching it, silently. Now it holds until one of
    those."""
    _tls.quiet = False


def compiling():
    c = getattr(torch, "compiler", None)
    if c is not None and hasattr(c, "is_compiling"):
        return c.is_compiling()
    d = getattr(torch, "_dynamo", None)
    return bool(d is not None and hasattr(d, "is_compiling") and d.is_compiling())


def refuse_compile(what):
    raise Error(INVALID, f"torch.compile of {what}: not supported on a module under strata.torch.offload_module "
                "(its parameters are fetched and released by the engine around every use, at run time, which a "
                "compiled graph would skip); compile the model without offload_module, or offload without "
                "torch.compile")


_CONVERSIONS = frozenset(["to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type"])


def _same_device(want, have):
    """Whether .to(want) leaves a tensor on `have` where it is: "cuda" without
    an index means the current GPU (torch.device("cuda") != cuda:0)."""
    if want.type != have.type:
        return False
    if want.index is None and want.type == "cuda":
        return have.index == torch.cuda.current_device()
    return want.index is None or want.index == have.index


_DTYPE_OF = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def _conversion(key, t, args, kwargs):
    """What t.<key>(...) asks: (in place, dtype). In place: t stays where it
    is (its device, no memory format, no copy=True), so that the call
    returns t itself where the dtype is t's too (torch does: no values are
    read). dtype: the one asked for (None: none)."""
    rest = args[1:]
    if key == "to":
        try:
            device, dtype, _, fmt = torch._C._nn._parse_to(*rest, **kwargs)
        except Exception:
            return False, None
        return (device is None or _same_device(torch.device(device), t.device)) and fmt is None \
            and not kwargs.get("copy", False), dtype
    if key == "cpu":
        return t.device.type == "cpu" and not rest and not kwargs, None
    if key in ("cuda", "type"):
        return False, None
    return not rest and not kwargs, _DTYPE_OF.get(key)


_APPLY_CODE = torch.nn.Module._apply.__code__


def _in_module_apply():
    """Whether the call being handled comes from nn.Module._apply's fn
    (model.to(dtype), model.half(), model.float(), a subclass's to() that
    calls torch's): _apply sets p.data to what fn returned, next."""
    import sys
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            return False
        if f.f_code is _APPLY_CODE:
            return True
        f = f.f_back
    return False


class _OffloadedParameter(torch.nn.Parameter):
    """An nn.Parameter whose values live in a Strata engine (see the module's
    docstring). Only offload_module makes them, by changing the class of the
    model's own parameters; close() changes it back."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if not getattr(_tls, "quiet", False):
            mine = [t for t in _each_tensor(kwargs, _each_tensor(args, [])) if type(t) is cls]
            if mine:
                key = _func_key(func)
                if key not in _NO_VALUES:
                    result = _use(func, key, mine, args, kwargs)
                    if result is not None:
                        return result[0]
        with _NoTorchFunction():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        # An ordinary Parameter holding the values (Parameter's own would
        # make another _OffloadedParameter, owned by no engine).
        with torch.no_grad():
            data = self.detach().clone()
        with quiet():
            out = torch.nn.Parameter(data, self.requires_grad)
        memo[id(self)] = out
        return out


def _use(func, key, mine, args, kwargs):
    """Fetches the groups of the offloaded parameters among a call's
    arguments, or refuses the call. Returns (result,) when the call is
    answered here, else None (the caller runs it)."""
    owners = []
    outside = None  # (owner, parameter, name) of those whose owner runs no forward: handed out, see below
    # The no-op conversion of the call just before, if that was one: only
    # the call right after it (Module._apply's p.data = p) reads it.
    asked = getattr(_tls, "converted", None)
    if asked is not None:
        _tls.converted = None
    for t in mine:
        ent = _OFFLOADED.get(id(t))
        if ent is None or ent.param() is not t:
            _refuse_orphaned(t)
            continue  # a parameter of a closed offload_module, or a copy
        owner, group, name = ent.owner_ref(), ent.group_ref(), ent.name
        if owner is None:  # (collected; orphan_collected() has not run yet)
            _refuse_orphaned(t, name)
        target = args[0] if args else None
        if target is t:
            if key in _CONVERSIONS:
                in_place, dtype = _conversion(key, t, args, kwargs)
                # A conversion that returns t itself: one to its own dtype
                # (a forward's p.to(compute dtype) reads no values), or to
                # another where Module._apply asks it (model.to(dtype),
                # model.half()): no values are read; _apply's p.data = p,
                # next, records the dtype asked for.
                if in_place and (dtype is None or dtype == t.dtype or (not owner._scopes and _in_module_apply())):
                    _tls.converted = (id(t), dtype)
                    return (t,)
            if key == "data.__set__" and len(args) > 1 and args[1] is t:
                # p.data = p: Module._apply after a conversion of p answered
                # above (model.half(), model.to(torch.bfloat16)). The model
                # becomes that dtype as torch's would: the parameter's own
                # dtype, which state_dict, save_pretrained and close() give
                # its master in; the placeholder stays in the compute dtype.
                # (Before, a conversion to the compute dtype changed nothing,
                # without a word: state_dict kept float32.)
                if asked is not None and asked[0] == id(t) and asked[1] is not None:
                    owner.convert(group, t, name, asked[1])
                return (None,)
            if key == "data.__set__" or key == "__setitem__" or key in ("set_", "resize_", "resize_as_") or (
                    key.endswith("_") and not key.endswith("__") and "." not in key and key not in _INPLACE_METADATA):
                raise Error(INVALID, f"{name}: '{key}' would change an offloaded parameter in place, behind the "
                            "engine that holds its values (the change would be lost at the next fetch); load new "
                            "values with load_state_dict, or change the model before offload_module")
        if kwargs.get("out") is not None and any(o is t for o in _each_tensor(kwargs["out"], [])):
            raise Error(INVALID, f"{name}: '{key}' writes into an offloaded parameter (out=); not supported")
        if owner.engine is None:
            raise Error(STATE, f"{name}: its offload_module was closed, but the parameter was kept from before")
        if compiling():
            refuse_compile(f"a function that reads the offloaded parameter {name}")
        owner.use(group, name)
        if owner not in owners:
            owners.append(owner)
        if not owner._scopes:
            outside = outside or []
            outside.append((owner, t, group, name))
    if not owners:
        return None
    if outside is not None:
        # Outside every forward of its owner (the training loop, a logging
        # hook, weight clipping): what the call returns may view the group's
        # fetched copy (p.data, p.detach(), p.t(), p[0]), where a write would
        # change that copy behind the engine, kept or lost depending on
        # placement. The owner records the parameter and checks its version
        # counter, which such tensors share with it, when it lets the group
        # go (handed_out). p.data is p.detach() here, whose counter is
        # shared (p.data's own is not: a write through it went unseen).
        # Only a result that views the group's memory is recorded: a new
        # tensor (p * 2, p.norm(), torch._foreach_sub(ema, params)), an
        # in-place op's own target (ema.lerp_(p, w)) or p itself
        # (p.contiguous()) never is, so an EMA or logging loop adds nothing.
        if key == "data.__get__" and args and any(t is args[0] for _, t, _, _ in outside):
            func, args, kwargs = torch.Tensor.detach, (args[0],), {}
        result = _call(func, args, kwargs, owners[0])
        if isinstance(result, (torch.Tensor, list, tuple)):
            for owner, t, group, name in outside:
                views = owner.views_of(group, result)
                if views:
                    owner.handed_out(t, name, views)
        return (result,)
    if not torch.is_grad_enabled():
        return None
    top = _saved.top()
    if _saved.owner_of(top) is owners[0]:
        return None
    with _saved.owner_hooks(owners[0], top):
        with _NoTorchFunction():
            return (func(*args, **kwargs),)


def _call(func, args, kwargs, owner):
    """Runs a call that reads offloaded parameters of `owner` outside its
    forwards. With grad enabled, what autograd saves passes the owner's
    pack first (unless its hooks are on top already), so that a view of the
    group comes back by fetch and no other hook keeps it."""
    if torch.is_grad_enabled():
        top = _saved.top()
        if _saved.owner_of(top) is not owner:
            with _saved.owner_hooks(owner, top):
                with _NoTorchFunction():
                    return func(*args, **kwargs)
    with _NoTorchFunction():
        return func(*args, **kwargs)


def adopt(p, owner, group, name):
    """Makes p an offloaded parameter of `owner` (held weakly)."""
    _OFFLOADED[id(p)] = _Entry(weakref.ref(p), weakref.proxy(owner), weakref.proxy(group), name,
                               weakref.ref(owner), weakref.ref(group))
    _ORPHANED.pop(id(p), None)
    if type(p) is torch.nn.Parameter:
        p.__class__ = _OffloadedParameter
    elif type(p) is not _OffloadedParameter:
        raise Error(INVALID, f"{name}: a parameter of type {type(p).__name__} (a subclass of nn.Parameter); "
                    "offload_module takes plain nn.Parameter only")


def disown(p):
    _OFFLOADED.pop(id(p), None)
    if type(p) is _OffloadedParameter:
        p.__class__ = torch.nn.Parameter


def orphan_collected():
    """An owner was collected (its finalizer): its parameters' entries go,
    and those still alive are orphaned (a read raises STATE). Entries of
    parameters gone are dropped too."""
    for key, ent in list(_OFFLOADED.items()):
        if ent.owner_ref() is None or ent.param() is None:
            del _OFFLOADED[key]
            if ent.param() is not None:
                _ORPHANED[key] = (ent.param, ent.name)
    for key, (ref, _) in list(_ORPHANED.items()):
        if ref() is None:
            del _ORPHANED[key]


def orphaned_name(p):
    """p's name where p outlived its collected owner, else None."""
    ent = _ORPHANED.get(id(p))
    return ent[1] if ent is not None and ent[0]() is p else None


def _refuse_orphaned(t, name=None):
    name = name or orphaned_name(t)
    if name is not None:
        raise Error(STATE, f"{name}: its offload_module was collected (its model dropped without close()) while "
                    "this parameter was kept: it holds no values, only a placeholder. close() "
                    "the OffloadedModule before dropping the model to keep ordinary parameters holding the "
                    "master weights")


def is_offloaded(p):
    ent = _OFFLOADED.get(id(p))
    return ent is not None and ent[0]() is p


# An optimizer other than offload_module's own refuses its parameters: their
# gradients go to the engine, never to .grad, so it would step nothing, with
# no error (a transformers.Trainer given no optimizers= builds torch's AdamW).
_torch_add_param_group = torch.optim.Optimizer.add_param_group
if not getattr(_torch_add_param_group, "_strata_checked", False):
    def _add_param_group(self, param_group):
        if not getattr(self, "_strata_offloaded_ok", False):
            ps = param_group.get("params") if isinstance(param_group, dict) else None
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps or ())
            for p in ps:
                p = p[1] if isinstance(p, tuple) else p
                if is_offloaded(p):
                    raise Error(INVALID, f"{type(self).__name__}: parameter {_OFFLOADED[id(p)][3]} is under "
                                "strata.torch.offload_module, whose gradients go to the engine and never to .grad: "
                                "this optimizer would step nothing. Step with the OffloadedModule's .optimizer "
                                "(transformers.Trainer: optimizers=(off.optimizer, scheduler))")
        return _torch_add_param_group(self, param_group)

    _add_param_group._strata_checked = True
    torch.optim.Optimizer.add_param_group = _add_param_group


# torch.compile (and nn.Module.compile, which calls it) refuses a module
# under offload_module, naming why, instead of compiling its placeholders.
_torch_compile = getattr(torch, "compile", None)
if _torch_compile is not None and not getattr(_torch_compile, "_strata_checked", False):
    def _compile(model=None, *args, **kwargs):
        if model is None:
            return lambda m: _compile(m, *args, **kwargs)
        target = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
        if isinstance(target, torch.nn.Module) and any(is_offloaded(p) for p in target.parameters()):
            refuse_compile(f"{type(target).__name__}")
        return _torch_compile(model, *args, **kwargs)

    _compile.__doc__ = _torch_compile.__doc__
    _compile._strata_checked = True
    torch.compile = _compile
