"""Strata from Python: a ctypes binding over the C API (include/strata/strata.h).

    import strata
    with strata.Engine({"zero_optimization": {"stage": 1}}) as e:
        e.add_param(0, "fc.weight", torch.randn(32, 1024))  # its shape is kept
        e.build()
        with e.span("forward"):  # in the trace, with "strata": {"trace_path": ...}
            ...

The library is found through $STRATA_LIBRARY, else, in a package that `cmake
--install` put in place, as the library installed with it, else as
libstrata.so.0 on the loader's path. No compile step. strata.torch holds the PyTorch integration
(OffloadAdam, offload_module). The C library as ctypes sees it (statuses,
Error, the structs, the functions' signatures) is _capi.py's.
"""

import ctypes
import json
import operator
import os

from ._capi import (  # noqa: F401  (strata.INVALID, strata.Error, ...: the package's names)
    COMM, CONFIG, CORRUPT, DTYPE_BF16, DTYPE_F16, DTYPE_F32, INTERNAL, INVALID, IO, NOMEM, NOSPACE, NOT_FOUND,
    OK, STATE, STATUS_NAMES, TIMEOUT, UNSUPPORTED, Error, _AdamOptions, _DTYPE_NAMES, _EngineOptions, _Stats,
    _StepOptions, _StepResult, _TierStats, _check, _load, _sized)

from ._args import (_CudaArray, _address, _as_f32_host, _c_integer, _device_type, _dtype_code, _dtype_of, _f32_host,
                    _host_engine_takes, _numel, _option_ints, _shape_tuple, _step_count, _step_options, _stream_handle)

__all__ = ["Engine", "Error", "STATUS_NAMES", "adam_step", "host_memory", "version"]

Error.__module__ = __name__  # strata.Error, as tracebacks and pickles name it


def version():
    """The loaded library's version as (major, minor, patch)."""
    v = _load().strata_version()
    return (v // 10000, v // 100 % 100, v % 100)


# Engine.fetch's address before the call: the library writes it only on
# success, and never this (an odd address).
_UNWRITTEN = 1


def _group(group, what):
    """`group` as the C int the library takes; INVALID naming it outside the C API's 0..1000000 (ctypes
    would wrap 2**32 to group 0 silently, int() cut 1.5 to 1)."""
    try:
        g = None if isinstance(group, bool) else operator.index(group)
    except TypeError:
        g = None
    if g is None or not 0 <= g <= 1_000_000:
        raise Error(INVALID, f"{what}: group {group!r} is not a group index (an integer in 0..1000000)")
    return g


def host_memory():
    """(bytes, local_ranks) as strata_host_memory gives them: the memory this
    process may use (physical RAM, or less under a cgroup's memory limit)
    and the ranks the launcher's variables put on this host (1 without a
    launcher). strata.host_budget "auto" is half of the memory, shared by
    the ranks on the host."""
    b, n = ctypes.c_uint64(), ctypes.c_int()
    _check(_load().strata_host_memory(ctypes.byref(b), ctypes.byref(n)))
    return b.value, n.value


from ._native import _NativeEngine, _live_native_engines, current_pid  # noqa: E402,F401  (the native handle's lease)


class Engine:
    """One Strata engine: parameter groups whose fp32 master weights and
    optimizer state live in the device / host / NVMe tiers.

    `config` is the JSON config (a dict or a string). Every failure raises
    strata.Error. Use it as a context manager, or call close(). One thread at
    a time drives an engine, in the process that made it: a process forked
    from it (a DataLoader worker with the fork start method) may drop it
    (garbage collection, close()), which leaves the parent's engine alone,
    and any other call there raises STATE. world_size 0 (the default) takes
    the ranks from the launcher's variables (torchrun, OpenMPI, Slurm; one
    rank without them); 1 runs alone. `device` is the GPU this process drives (one process
    per GPU): -1 (the default) takes the launcher's local rank (LOCAL_RANK).
    `skip_groups_without_grads`: a group that got no grads() in a step is
    left untouched (torch's rule for a parameter whose .grad is None: no
    weight decay, moments as they were, its own step count, group_steps);
    False (the default) updates it as with zero gradients (DeepSpeed's rule).
    """

    def __init__(self, config, rank=0, world_size=0, grad_accumulation_steps=1, force_no_gpu=False,
                 overlap_step=False, device=-1, skip_groups_without_grads=False):
        self._lib = _load()
        self._h = None  # the native handle (a c_void_p) while open; None once closed
        self._native = None  # the _NativeEngine that destroys it (its Engine's lease)
        self._pid = current_pid()
        # Tensors lent by grads_part(lend=True), by group in the order lent:
        # held until the engine reads none of a group's (grads_lent), step or a load.
        self._lent = {}
        text = config if isinstance(config, str) else json.dumps(config)
        opts = _sized(_EngineOptions, **_option_ints(rank=rank, world_size=world_size, device=device,
                                                     grad_accumulation_steps=grad_accumulation_steps),
                      force_no_gpu=1 if force_no_gpu else 0, overlap_step=1 if overlap_step else 0,
                      skip_groups_without_grads=1 if skip_groups_without_grads else 0)
        h = ctypes.c_void_p()
        try:
            _check(self._lib.strata_engine_create(text.encode(), ctypes.byref(opts), ctypes.byref(h)))
            self._native = _NativeEngine(self._lib, h)
        except BaseException:
            # Ctrl-C while strata_engine_create runs (with ranks: the
            # rendezvous) is delivered as it returns, before _NativeEngine
            # holds the handle: the engine (its threads, memory,
            # communicator) would stay for the life of the process. h is set
            # only on success. (h.value cleared first: a _NativeEngine made
            # part-way shares h, and its destroy then gets NULL, a no-op.)
            if self._native is None and h.value is not None:
                made, h.value = h.value, None
                self._lib.strata_engine_destroy(ctypes.c_void_p(made))
            raise
        self._h = h

    # -- lifetime
    def close(self):
        """Closes the engine: every later call raises STATE. Idempotent.

        The native engine is destroyed now (its threads joined, its memory
        freed, its swap files deleted, the trace written) unless tensors from
        as_tensor, fetch_tensor or grads_view still live: they keep it, with
        the values it held, until the last of them goes (or the interpreter
        exits), so that reading or writing one never touches freed memory.
        The trace is written now either way. In a process forked from the one
        that made the engine, close() only drops it: the parent's engine,
        threads and swap files stay the parent's."""
        native, self._native, self._h = self._native, None, None
        self._lent = {}
        if native is None:
            return
        native.closed = True
        if native.views and native.pid == native.getpid():
            self._lib.strata_engine_write_trace(native.h)  # (destroy writes it again, when the views go)
        del native  # the last reference, but for the views': the engine is destroyed here

    @property
    def forked(self):
        """True in a process forked from the one that made this engine: there
        it can only be dropped (close(), garbage collection), never used."""
        return self._pid != current_pid()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    @property
    def handle(self):
        if self._h is None:
            raise Error(STATE, "the engine is closed")
        if self._pid != current_pid():
            raise Error(STATE, f"the engine was made in process {self._pid} and this process ({os.getpid()}) "
                        "was forked from it: the engine's threads are not here, so it can only be dropped "
                        "here. Make engines in the child itself, or start workers with the 'spawn' or "
                        "'forkserver' method")
        return self._native

    # -- registration
    def add_param(self, group, name, tensor_or_numel, init=None, shape=None):
        """Registers a tensor in `group`; returns its offset (elements) in the
        group's buffer. `tensor_or_numel`: a tensor or array (its values are
        the initial ones unless `init` is given, and its shape is kept unless
        `shape` is given) or an element count (zeros unless `init`; flat
        unless `shape`). The shape is recorded in checkpoints, so that
        strata-export writes the tensor in it."""
        group, numel = _group(group, f"add_param '{name}'"), _numel(tensor_or_numel, f"add_param '{name}'")
        if shape is None and not isinstance(tensor_or_numel, int):
            shape = tuple(tensor_or_numel.shape)
        if shape is not None:
            shape = _shape_tuple(name, shape)
            n = 1
            for d in shape:
                n *= d
            if n != numel and all(d >= 1 for d in shape):  # a dim < 1: the library names it
                raise Error(INVALID, f"add_param '{name}': shape {list(shape)} has {n} elements; "
                            f"the tensor has {numel}")
        if init is None and not isinstance(tensor_or_numel, int):
            init = tensor_or_numel
        keep = None
        if init is not None:
            keep = _as_f32_host(init)
            if _numel(keep) != numel:
                raise Error(INVALID, f"{name}: init has {_numel(keep)} elements, not {numel}")
        off = ctypes.c_uint64()
        if shape is None:
            _check(self._lib.strata_engine_add_param(self.handle, group, name.encode(), numel, _address(keep),
                                                     ctypes.byref(off)))
        else:
            dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
            _check(self._lib.strata_engine_add_param_shaped(self.handle, group, name.encode(), len(shape), dims,
                                                            _address(keep), ctypes.byref(off)))
        return off.value

    def add_alias(self, group, alias, of):
        """Names tensor `of` of `group` also `alias` (a tied weight):
        checkpoints record it and strata-export writes both names."""
        _check(self._lib.strata_engine_add_alias(self.handle, _group(group, "add_alias"), alias.encode(), of.encode()))

    def freeze_group(self, group):
        """Marks `group` frozen, before build(): parameters that forward and
        backward read but that never train (a LoRA fine-tune's base weights).
        The group keeps its parameters alone, in the compute dtype (an fp32
        init is rounded to bf16 under bf16), homed where offload_param says:
        no gradients, master or moments anywhere. fetch()/release() work as
        for any group; grads() on it raises INVALID; step() leaves it bitwise
        unchanged; read_master()/read_state("master") give its parameters as
        fp32 and write_state(group, "master", values) sets them; "exp_avg" and
        "exp_avg_sq" raise INVALID; checkpoints save and load it."""
        _check(self._lib.strata_engine_freeze_group(self.handle, _group(group, "freeze_group")))

    def group_frozen(self, group):
        """Whether freeze_group() marked `group`."""
        out = ctypes.c_int()
        _check(self._lib.strata_engine_group_frozen(self.handle, _group(group, "group_frozen"), ctypes.byref(out)))
        return bool(out.value)

    def build(self):
        _check(self._lib.strata_engine_build(self.handle))
        self._built = True

    # -- the step protocol
    def fetch(self, group, stream=None):
        """The group's full parameters in the compute dtype: a device address
        (an int; host memory without a GPU), valid until release(group)."""
        group, s = _group(group, "fetch"), _stream_handle(stream, "fetch")
        # The library writes the address only on success: still _UNWRITTEN,
        # the call did not fetch (it failed, or never ran).
        p = ctypes.c_void_p(_UNWRITTEN)
        try:
            _check(self._lib.strata_engine_fetch(self.handle, group, s, ctypes.byref(p)))
        except BaseException:
            # Ctrl-C during the native fetch (an NVMe read) is delivered as it
            # returns: the group is fetched but its address never reaches the
            # caller, who could never release it (every later step: STATE
            # "group N is fetched and not released"). That fetch is undone.
            if p.value != _UNWRITTEN:
                self.release(group, stream)
            raise
        return p.value

    def fetch_tensor(self, group, stream=None):
        """fetch() as a torch tensor (1-D, group_numel elements, compute dtype)
        that views the engine's buffer: valid until release(group) (it keeps
        the Engine object alive, not the buffer: see as_tensor)."""
        address = self.fetch(group, stream)
        try:
            return self.as_tensor(address, self.group_numel(group))
        except BaseException:  # (Ctrl-C among these calls: the caller never gets the tensor to release)
            self.release(group, stream)
            raise

    def release(self, group, stream=None):
        _check(self._lib.strata_engine_release(self.handle, _group(group, "release"),
                                               _stream_handle(stream, "release")))

    def _release_held(self, group, stream=None):
        """release() of a group the caller fetched once and holds alone (its
        fetch count 1), also where a KeyboardInterrupt lands in the call:
        CPython delivers it at the entry of a Python function (then the
        native release never ran) or as the native call returns (then it
        ran), with no way to tell which; so the group is released again,
        and the STATE of one released already (its count 0) ignored."""
        try:
            self.release(group, stream)
        except Error:
            raise
        except BaseException:
            try:
                self.release(group, stream)
            except Error:
                pass
            raise

    def grads(self, group, grads, dtype=None, stream=None):
        """Hands the group's full gradients (a contiguous tensor of group_numel
        elements, float32/bfloat16/float16, on the engine's device; or an
        address with `dtype` one of "f32", "bf16", "f16")."""
        group = _group(group, "grads")
        code = _dtype_of(grads, "grads: grads") if dtype is None else _dtype_code(dtype, "grads")
        _host_engine_takes("grads", "the gradients", grads, self)
        if not isinstance(grads, int) and _numel(grads) != self.group_numel(group):
            raise Error(INVALID, f"group {group} has {self.group_numel(group)} elements; "
                        f"grads has {_numel(grads)}")
        _check(self._lib.strata_engine_grads(self.handle, group, _address(grads, "grads", "grads"), code,
                                             _stream_handle(stream, "grads")))

    def grads_part(self, group, first, grads, dtype=None, lend=False):
        """One part of a grads call given in parts (strata_engine_grads_part):
        elements [first, first + numel) of the group's gradients, a contiguous
        host tensor (or an address with `dtype` "f32"/"bf16"/"f16" and then
        grads a (address, numel) pair), copied straight into the engine's
        accumulator. grads_end(group) completes the call.

        lend=True (strata_engine_grads_part_lend): the engine may keep reading
        the part, unchanged, until the next step() or load_checkpoint()
        returns, or close(): the caller keeps it alive until then (a tensor:
        the binding holds a reference, dropped once the engine reads none of
        the group's lent parts: grads_lent, asked at each grads_end)."""
        group, first = _group(group, "grads_part"), _c_integer(first, "grads_part", "first")
        if isinstance(grads, tuple):
            address, count = grads
            address = _address(address, "grads_part", "address")
            count = _c_integer(count, "grads_part", "count")
            code = _dtype_code(dtype, "grads_part")
        else:
            if getattr(grads, "device", None) is not None and grads.device.type != "cpu":
                raise Error(INVALID, f"grads_part: the gradients are on {grads.device}; parts are host memory")
            address, count = _address(grads, "grads_part", "grads"), _numel(grads, "grads_part")
            code = _dtype_of(grads, "grads_part: grads") if dtype is None else _dtype_code(dtype, "grads_part")
        call = self._lib.strata_engine_grads_part_lend if lend else self._lib.strata_engine_grads_part
        lent = lend and not isinstance(grads, tuple)
        if lent:
            # Held before the call: a Ctrl-C delivered as the native call
            # returns would otherwise leave a tensor the engine reads, held by
            # nothing (freed under it). One the engine refused is let go.
            self._lent.setdefault(group, []).append(grads)
        try:
            _check(call(self.handle, group, first, count, address, code))
        except Error:
            if lent:
                held = self._lent.get(group, [])
                if held and held[-1] is grads:
                    held.pop()
                if not held:
                    self._lent.pop(group, None)
            raise

    def grads_end(self, group):
        """Completes the group's grads call in parts: as one grads() of the
        parts given (zeros elsewhere)."""
        _check(self._lib.strata_engine_grads_end(self.handle, _group(group, "grads_end")))
        # This group, where the engine copied its parts by now (one rank); then
        # the groups lent longest ago that the engine no longer reads (several
        # ranks: reduced in the order they were lent), are let go.
        if group in self._lent and not self.grads_lent(group):
            del self._lent[group]
        while self._lent:
            first = next(iter(self._lent))
            if first == group or self.grads_lent(first):  # (group is in use: asked above)
                break
            del self._lent[first]

    def grads_lent(self, group):
        """Whether the engine may still read gradient parts lent to the group
        in this step (strata_engine_grads_lent)."""
        out = ctypes.c_int()
        _check(self._lib.strata_engine_grads_lent(self.handle, _group(group, "grads_lent"), ctypes.byref(out)))
        return bool(out.value)

    def grads_view(self, group):
        """This step's gradients of the group as accumulated: a tensor of
        group_numel compute-dtype elements viewing the engine's accumulator
        (strata_engine_grads_view; where its dtype is the compute dtype),
        valid until step(), the group's next gradients or a checkpoint load.
        Read it only."""
        out = ctypes.c_void_p()
        _check(self._lib.strata_engine_grads_view(self.handle, _group(group, "grads_view"), ctypes.byref(out)))
        if not self.takes_grad_parts(group, self.compute_dtype):
            raise Error(INVALID, f"grads_view: group {group}'s accumulator is not of the compute dtype "
                        f"({self.compute_dtype}); read it with strata_engine_grads_view and its own dtype")
        return self.as_tensor(out.value, self.group_numel(group))

    def takes_grad_parts(self, group, dtype="f32"):
        """Whether the group takes gradients of `dtype` ("f32", "bf16", "f16")
        in parts (no GPU; one rank: its accumulator in host memory and of
        that dtype; several: overlap_comm on, one group's parts at a time)."""
        group, code, out = _group(group, "takes_grad_parts"), _dtype_code(dtype, "takes_grad_parts"), ctypes.c_int()
        _check(self._lib.strata_engine_takes_grad_parts(self.handle, group, code, ctypes.byref(out)))
        return bool(out.value)

    # -- activations (strata.activation_host_bytes, activation_nvme_bytes)
    def stash(self, x, nbytes=None, stream=None):
        """Copies a contiguous tensor (on the engine's device), array or
        address (then `nbytes`) into the engine's activation store: host
        memory, or NVMe when its arena is full. Returns a handle for
        redeem(); `x` may be reused at once."""
        _host_engine_takes("stash", "the tensor", x, self)
        if nbytes is None:
            if isinstance(x, int):
                raise Error(INVALID, "stash: an address needs nbytes (the bytes to copy from it)")
            nbytes = x.numel() * x.element_size() if hasattr(x, "element_size") else x.nbytes
        nbytes, h = _c_integer(nbytes, "stash", "nbytes", allowed=(1, 2**64 - 1)), ctypes.c_uint64()
        _check(self._lib.strata_engine_stash(self.handle, _address(x, "stash", "x"), nbytes,
                                             _stream_handle(stream, "stash"), ctypes.byref(h)))
        return h.value

    def redeem(self, handle, out, nbytes=None, stream=None):
        """Copies stash `handle` back into `out` (a contiguous tensor or
        array of its bytes, on the engine's device; or an address with
        `nbytes`) and frees it. Returns `out`."""
        _host_engine_takes("redeem", "out", out, self)
        if nbytes is None:
            nbytes = out.numel() * out.element_size() if hasattr(out, "element_size") else out.nbytes
        handle, nbytes = (_c_integer(v, "redeem", n) for n, v in (("handle", handle), ("nbytes", nbytes)))
        _check(self._lib.strata_engine_redeem(self.handle, handle, _address(out, "redeem", "out"), nbytes,
                                              _stream_handle(stream, "redeem")))
        return out

    def drop_stash(self, handle):
        """Frees stash `handle` unread."""
        _check(self._lib.strata_engine_drop_stash(self.handle, _c_integer(handle, "drop_stash", "handle")))

    def prepare_step(self, lr=None, betas=None, eps=None, weight_decay=None, max_grad_norm=None):
        """With overlap_step: the coming step's options, before its first
        grads(); step() must then get the same ones."""
        opts = _step_options(lr, betas, eps, weight_decay, max_grad_norm)
        _check(self._lib.strata_engine_prepare_step(self.handle, ctypes.byref(opts)))

    def step(self, lr=None, betas=None, eps=None, weight_decay=None, max_grad_norm=None):
        """One optimizer step; None takes the config's value. max_grad_norm
        clips the global gradient norm as torch's clip_grad_norm_ (0: no
        clipping; None: the config's gradient_clipping). Gradients from
        several ranks and grads() calls are averaged (strata.grad_reduce
        "mean", the default) or summed ("sum"). Returns (grad_norm, skipped),
        the norm being that of the reduced, unclipped gradients.
        `last_loss_scale` is then the scale for the next loss (loss_scale)."""
        opts = _step_options(lr, betas, eps, weight_decay, max_grad_norm)
        res = _sized(_StepResult)
        try:
            _check(self._lib.strata_engine_step(self.handle, ctypes.byref(opts), ctypes.byref(res)))
        finally:
            self._lent = {}  # the engine reads none of them after step returns
        self.last_loss_scale = res.loss_scale
        return res.grad_norm, bool(res.skipped)

    @property
    def loss_scale(self):
        """The scale to multiply the next loss by, at any time (before the
        first step too): with fp16 the dynamic loss scale (2^
        fp16.initial_scale_power at first, halved at each overflow from the
        fp16.hysteresis-th since the start or the last doubling on, doubled
        after fp16.loss_scale_window clean steps) or the static
        fp16.loss_scale; 1 without fp16. With fp16 every step divides
        the gradients it was handed by it (DeepSpeed's semantics): they must
        be those of the loss times this scale, or the update is that much
        too small."""
        out = ctypes.c_double()
        _check(self._lib.strata_engine_loss_scale(self.handle, ctypes.byref(out)))
        return out.value

    def grad_norm(self):
        """The global L2 norm of this step's gradients so far, as step() will
        see it (inf when one is not finite). With several ranks every rank
        calls it at the same point (a collective)."""
        n = ctypes.c_double()
        _check(self._lib.strata_engine_grad_norm(self.handle, ctypes.byref(n)))
        return n.value

    def sum_over_ranks(self, values):
        """`values` (numbers) summed over the engine's ranks, in float64,
        added in rank order (every rank gets the same bits), as a list. A
        collective: every rank calls it with as many values, at the same
        point among the engine's other collectives, with no gradients
        pending (before a step's first grads, or after its step). One rank:
        the values as they are."""
        values = [float(v) for v in values]
        if not values:
            return []
        buf = (ctypes.c_double * len(values))(*values)
        _check(self._lib.strata_engine_sum_over_ranks(self.handle, buf, len(values)))
        return list(buf)

    def discard_grads(self):
        """Drops every gradient given since the last step (torch's zero_grad
        after a backward that raised): nothing is updated, the step count
        and loss scale stay. Several ranks: called where each would step."""
        try:
            _check(self._lib.strata_engine_discard_grads(self.handle))
        finally:
            self._lent = {}  # as after step: the engine reads none of them

    @property
    def config(self):
        """The engine's resolved config (defaults filled in) as a dict."""
        size = ctypes.c_size_t(0)
        _check(self._lib.strata_engine_config(self.handle, None, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _check(self._lib.strata_engine_config(self.handle, buf, ctypes.byref(size)))
        return json.loads(buf.value.decode("utf-8"))

    @property
    def placement(self):
        """Where this process landed: its GPU (the launcher's local rank by
        default, or `device`) and its NUMA binding, as one line."""
        size = ctypes.c_size_t(0)
        _check(self._lib.strata_engine_placement(self.handle, None, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _check(self._lib.strata_engine_placement(self.handle, buf, ctypes.byref(size)))
        return buf.value.decode("utf-8")

    # -- optimizer state (for state_dict / load_state_dict)
    STATES = {"master": 0, "exp_avg": 1, "exp_avg_sq": 2}

    def _state_code(self, which, call):
        code = self.STATES.get(which) if isinstance(which, str) else None
        if code is None:
            raise Error(INVALID, f"{call}: which is {which!r}; one of {', '.join(map(repr, self.STATES))}")
        return code

    def read_state(self, group, which):
        """The group's "master", "exp_avg" or "exp_avg_sq" as a new fp32 tensor."""
        import torch
        code = self._state_code(which, "read_state")
        out = torch.empty(self.group_numel(group := _group(group, "read_state")), dtype=torch.float32)
        _check(self._lib.strata_engine_read_state(self.handle, group, code, out.data_ptr()))
        return out

    def write_state(self, group, which, values):
        """Sets the group's "master", "exp_avg" or "exp_avg_sq" (group_numel floats)."""
        import torch
        group, code = _group(group, "write_state"), self._state_code(which, "write_state")
        v = torch.as_tensor(values, dtype=torch.float32).reshape(-1).contiguous().cpu()
        if v.numel() != self.group_numel(group):
            raise Error(INVALID, f"write_state: {v.numel()} values for a group of {self.group_numel(group)}")
        _check(self._lib.strata_engine_write_state(self.handle, group, code, v.data_ptr()))

    @property
    def steps(self):
        """Optimizer updates applied so far (bias correction counts from it)."""
        n = ctypes.c_int64()
        _check(self._lib.strata_engine_get_steps(self.handle, ctypes.byref(n)))
        return n.value

    @steps.setter
    def steps(self, value):
        _check(self._lib.strata_engine_set_steps(self.handle, _step_count(value, "set_steps")))

    def group_steps(self, group):
        """The updates applied to `group` (its bias correction counts from it):
        `steps`, unless the engine was made with skip_groups_without_grads,
        where a group counts only the steps it got gradients in (torch's
        per-parameter state["step"]); 0 for a frozen group."""
        n = ctypes.c_int64()
        _check(self._lib.strata_engine_group_steps(self.handle, _group(group, "group_steps"), ctypes.byref(n)))
        return n.value

    def set_group_steps(self, group, value):
        """Sets group_steps(group), between steps (skip_groups_without_grads only)."""
        group, value = _group(group, "set_group_steps"), _step_count(value, "set_group_steps")
        _check(self._lib.strata_engine_set_group_steps(self.handle, group, value))

    # -- checkpoints
    def save_checkpoint(self, directory, tag, blob=b""):
        """Saves this rank's state and `blob` (bytes: the trainer's own state)
        to directory/tag and points directory/latest at it."""
        blob = bytes(blob)
        buf = ctypes.create_string_buffer(blob, len(blob)) if blob else None
        _check(self._lib.strata_checkpoint_save(self.handle, os.fsencode(directory), os.fsencode(tag),
                                                buf, len(blob)))

    def load_checkpoint(self, directory, tag=None):
        """Loads directory/tag (None: directory/latest); returns the saved blob."""
        size = ctypes.c_uint64(1 << 16)
        while True:
            buf = ctypes.create_string_buffer(size.value)
            want = ctypes.c_uint64(size.value)
            status = self._lib.strata_checkpoint_load(self.handle, os.fsencode(directory),
                                                      os.fsencode(tag) if tag else None, buf, ctypes.byref(want))
            self._lent = {}  # the engine reads none of them after a load returns
            if status != OK and want.value > size.value:
                size = want  # the state is loaded; only the blob needs a larger buffer
                continue
            _check(status)
            return buf.raw[:want.value]

    # -- queries
    def read_master(self, group):
        """The group's fp32 master weights as a new 1-D torch tensor (host)."""
        import torch
        out = torch.empty(self.group_numel(group := _group(group, "read_master")), dtype=torch.float32)
        _check(self._lib.strata_engine_read_master(self.handle, group, out.data_ptr()))
        return out

    @property
    def num_groups(self):
        n = ctypes.c_int()
        _check(self._lib.strata_engine_num_groups(self.handle, ctypes.byref(n)))
        return n.value

    def group_numel(self, group):
        n = ctypes.c_uint64()
        _check(self._lib.strata_engine_group_numel(self.handle, _group(group, "group_numel"), ctypes.byref(n)))
        return n.value

    @property
    def compute_dtype(self):
        """"f32", "bf16" or "f16": the dtype of fetched parameters."""
        d = ctypes.c_int()
        _check(self._lib.strata_engine_compute_dtype(self.handle, ctypes.byref(d)))
        return _DTYPE_NAMES[d.value]

    @property
    def on_gpu(self):
        """True when fetched buffers and gradients are CUDA device memory."""
        g = ctypes.c_int()
        _check(self._lib.strata_engine_device_is_gpu(self.handle, ctypes.byref(g)))
        return bool(g.value)

    def _step_counts(self):
        """(steps finished, skipped ones) as stats() counts them: a step()
        that raised (Ctrl-C delivered as the native step returns) stepped
        where the first moved."""
        s = _sized(_Stats)
        _check(self._lib.strata_engine_stats(self.handle, ctypes.byref(s)))
        return s.steps, s.skipped_steps

    def stats(self):
        """Tier use, bytes moved and timings, as a dict."""
        s = _sized(_Stats)
        _check(self._lib.strata_engine_stats(self.handle, ctypes.byref(s)))
        out = {}
        for name, _ in _Stats._fields_[1:]:
            v = getattr(s, name)
            out[name] = ({"budget": v.budget, "used": v.used, "peak": v.peak}
                         if isinstance(v, _TierStats) else v)
        return out

    # -- trace (config "strata": {"trace_path": ...})
    def span(self, name):
        """A context manager that records a span named `name` ("forward",
        "backward", ...) in the engine's trace, on this thread's track,
        beside the engine's own fetch, stall, grads and step spans. Spans
        opened on one thread nest. Any thread may use it, also while another
        drives the engine. Without a trace path it records nothing."""
        return _Span(self, name)

    def write_trace(self):
        """Writes the trace file now (it is also written at close()); spans
        still open appear as ending now, marked unfinished."""
        _check(self._lib.strata_engine_write_trace(self.handle))

    def as_tensor(self, address, numel):
        """A torch tensor of `numel` compute-dtype elements viewing `address`
        (device memory when on_gpu, else host memory). It does not own the
        memory, but it (and every view of it) keeps this Engine object and
        the native engine alive: neither going out of scope nor close()
        frees the engine under it (close() leaves the native engine to the
        last such tensor). What the engine does with the memory it views
        still applies: release() of a fetched group or the next step for
        grads_view make it stale (the engine may reuse the memory)."""
        import torch
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[self.compute_dtype]
        if numel == 0:
            return torch.empty(0, dtype=dtype, device="cuda" if self.on_gpu else "cpu")
        typestr = "<f4" if dtype == torch.float32 else "<i2"
        # The object described is what the tensor's storage holds a
        # reference to (torch's deleter for a __cuda_array_interface__; the
        # numpy array's base for from_numpy): it holds the engine and its
        # native engine's lease.
        if self.on_gpu:
            described = _CudaArray(address, numel, typestr)
        else:
            described = _HostArray(address, numel, typestr)
        described.engine, described.native = self, self._native
        self._native.views.add(described)
        if self.on_gpu:
            raw = torch.as_tensor(described, device="cuda")
        else:
            import numpy as np
            raw = torch.from_numpy(np.asarray(described))
        return raw if dtype == torch.float32 else raw.view(dtype)


class _HostArray:
    """Host memory of an engine described by __array_interface__ (for
    numpy.asarray, whose array keeps it as its base); as_tensor gives it the
    engine and its native engine to hold."""

    def __init__(self, address, numel, typestr):
        self.__array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (address, False), "version": 3}


class _Span:
    """What Engine.span returns: begins the span on enter, ends it on exit."""

    def __init__(self, engine, name):
        self._engine, self._name, self._token = engine, name, None

    def __enter__(self):
        if not isinstance(self._name, str):
            raise TypeError(f"a span name is a str, not {type(self._name).__name__}")
        token = ctypes.c_uint64()
        e = self._engine
        _check(e._lib.strata_engine_span_begin(e.handle, self._name.encode("utf-8"), ctypes.byref(token)))
        self._token = token.value
        return self

    def __exit__(self, *exc):
        token, self._token = self._token, None
        _check(self._engine._lib.strata_engine_span_end(self._engine.handle, token))
        return False


def adam_step(param, grad, exp_avg, exp_avg_sq, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
              weight_decay=0.0, adamw=True, grad_scale=1.0, param_copy=None):
    """The optimizer alone: one Adam/AdamW step, in place, over contiguous host
    float32 tensors or arrays (grad may be bf16/f16; param_copy receives the
    new param as bf16/f16)."""
    for name, a in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _f32_host("adam_step", name, a)
    for name, a in (("grad", grad), ("param_copy", param_copy)):
        if a is not None and _device_type(a) != "cpu":
            raise Error(INVALID, f"adam_step: {name} is on {a.device}; it takes host memory")
    n = _numel(param)
    for name, a in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if _numel(a) != n:
            raise Error(INVALID, f"{name} has {_numel(a)} elements, param {n}")
    opts = _sized(_AdamOptions, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                  step=_step_count(step, "adam_step", "step", (1, 2**63 - 1)), mode=0 if adamw else 1,
                  grad_scale=grad_scale,
                  grad_dtype=_dtype_of(grad, "adam_step: grad"),
                  param_copy_dtype=DTYPE_BF16 if param_copy is None else _dtype_of(param_copy, "adam_step: param_copy"))
    _check(_load().strata_adam_step(ctypes.byref(opts), n, *(_address(a, "adam_step", k) for k, a in zip(
        ("param", "exp_avg", "exp_avg_sq", "grad", "param_copy"), (param, exp_avg, exp_avg_sq, grad, param_copy)))))
