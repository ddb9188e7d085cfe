"""Activation offload: the tensors autograd saves for backward go to a
Strata engine's activation store (host memory, and NVMe past
strata.activation_host_bytes) and come back when backward needs them,
read ahead in reverse order (engine/activations/activation_store.h).

    off = st.offload_module(model, cfg)          # cfg's strata.activation_* size the store
    with st.offload_activations(off):
        loss = model(x)
    loss.backward()

or, without offload_module, on an engine of its own:

    e = strata.Engine(cfg)
    e.add_param(0, "unused", torch.zeros(4))            # an engine has a group
    acts = st.offload_activations(e)                    # built here
    with acts:
        loss = model(x)
    loss.backward()

Tensors below `threshold` bytes stay where they are, as do views of an
offloaded parameter (they come back by fetch). A stash not redeemed (a graph
freed without backward) is dropped when autograd lets go of it. A saved
tensor comes back contiguous, with its values bit for bit: a run with
activation offload is bitwise the run without.

Under torch.utils.checkpoint the innermost saved-tensor hooks decide: inside
a checkpointed segment they are checkpoint's (offload_module's own hand
them every tensor that is not a view of a parameter), so only what
checkpoint keeps from the forward is stashed, its segments' inputs (torch
2; torch 1.13 keeps them in a closure no hook sees), never what its
recomputation saves. Nor, under offload_module, what a forward saves while
a backward runs (a reentrant checkpoint's recomputation)."""
import torch

from .. import Error, INVALID

DEFAULT_THRESHOLD = 1 << 20  # bytes


class _Stashed:
    """One saved tensor in the store: its handle and how to rebuild it. Drops
    the stash if autograd lets go of it unread; keeps the tensor once read (a
    retained graph's second backward reads it again)."""

    __slots__ = ("engine", "handle", "shape", "dtype", "device", "tensor")

    def __init__(self, engine, t, stream):
        self.engine, self.shape, self.dtype, self.device, self.tensor = engine, t.shape, t.dtype, t.device, None
        self.handle = None
        self.handle = engine.stash(t.contiguous(), stream=stream)

    def get(self, stream):
        if self.tensor is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.engine.redeem(self.handle, out, stream=stream)
            self.handle, self.tensor = None, out
        return self.tensor

    def __del__(self):
        if self.handle is not None and getattr(self.engine, "_h", None) is not None:
            try:
                self.engine.drop_stash(self.handle)
            except Exception:  # the engine closed first: its store went with it
                pass


def _stream(device):
    return torch.cuda.current_stream() if device.type == "cuda" else None


def should_stash(t, threshold):
    return t.numel() * t.element_size() >= threshold and not t.is_sparse and t.layout == torch.strided


def stash(engine, t):
    return _Stashed(engine, t, _stream(t.device))


def unstash(saved):
    return saved.get(_stream(saved.device))


class offload_activations:
    """A context manager (and a switch) for activation offload, on an
    OffloadedModule (its engine; its parameter views stay out) or on a
    strata.Engine of its own (built here if it is not). `threshold`: tensors
    of fewer bytes stay put."""

    def __init__(self, target, threshold=DEFAULT_THRESHOLD):
        if not isinstance(threshold, int) or threshold < 0:
            raise Error(INVALID, f"offload_activations: threshold {threshold!r} is not a byte count >= 0")
        self.threshold = threshold
        self._module = target if hasattr(target, "_groups") and hasattr(target, "engine") else None
        self.engine = target.engine if self._module is not None else target
        if self.engine is None or not hasattr(self.engine, "stash"):
            raise Error(INVALID, f"offload_activations: {type(target).__name__} is neither an offload_module result "
                        "nor a strata.Engine")
        if self._module is None and not getattr(self.engine, "_built", False):
            self.engine.build()
        self._ctx, self._was = None, None

    def __enter__(self):
        if self._module is not None:
            # offload_module's own saved-tensor hooks take the activations
            # too (they see every tensor first, views of its parameters
            # included), read when a module forward puts them on.
            self._was = self._module.activation_threshold
            self._module.activation_threshold = self.threshold
            return self
        engine, threshold = self.engine, self.threshold
        self._ctx = torch.autograd.graph.saved_tensors_hooks(
            lambda t: stash(engine, t) if should_stash(t, threshold) else t,
            lambda s: unstash(s) if isinstance(s, _Stashed) else s)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._module is not None:
            self._module.activation_threshold = self._was
        else:
            self._ctx.__exit__(*exc)
        return False
