"""One parameter group of an offloaded module: a module's direct parameters
as one engine group, their placeholders while released, and their
gradients staged until the group's are complete; and _SavedView, a tensor
autograd saved as its place in a fetched group.
"""

import torch

from .. import Error, INVALID
from . import _fetch_on_use as _fou
from ._clip import _torch_norm_of

class _SavedView:
    __slots__ = ("group", "offset", "shape", "stride")

    def __init__(self, group, offset, shape, stride):
        self.group, self.offset, self.shape, self.stride = group, offset, shape, stride


class _LazyNorm:
    """torch's norm of a parameter's gradient, taken when clip_grad_norm_
    asks, from the engine's accumulator (grads_view), which holds it as
    backward gave it: the same elements, shape and dtype, so the same bits."""
    __slots__ = ("group", "index")

    def __init__(self, group, index):
        self.group, self.index = group, index

    def value(self, views):
        g, i = self.group, self.index
        if g.index not in views:
            views[g.index] = g.owner.engine.grads_view(g.index)
        off, n = g.offsets[i], g.numels[i]
        return _torch_norm_of(views[g.index][off:off + n].view(g.shapes[g.params[i]]).float())


class _ModuleGroup:
    """The direct trainable parameters of one module (tied ones only in the
    first module that has them): one engine group."""

    def __init__(self, owner, index, module, named_params, frozen=False):
        self.owner, self.index, self.module, self.frozen = owner, index, module, frozen
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = {p: p.shape for p in self.params}
        self.dtypes = {p: p.dtype for p in self.params}
        self.devices = {p: p.device for p in self.params}
        self.offsets = [owner.engine.add_param(index, n, p.detach()) for n, p in zip(self.names, self.params)]
        if frozen:
            owner.engine.freeze_group(index)
        self.numels = [p.numel() for p in self.params]  # .data is empty while released
        self.numel = sum(self.numels)
        self.flat_numel = None  # the engine's group_numel (after build)
        self.views = None  # (address, flat tensor, per-parameter views) of the last fetch
        self.staged = None
        self.arrived = set()
        self.refused = set()  # ids of the parameters whose gradients an unscaled fp16 backward brought (dropped)
        self.ever_handed = False  # had a gradient in some step (torch would keep a zero .grad for it)
        self.handed_params = set()  # indices of parameters whose gradients went to the engine this step
        self.grad_accs = []  # AccumulateGrad nodes, kept alive so that their hooks stay
        self.grad_hooks = []  # and the hooks' handles: close() removes them
        # Gradients go to the engine a parameter at a time (grads_part), where
        # it takes them (host memory; one rank: straight into its accumulator;
        # several: read by the reduction or packed for it, one group at a
        # time): no staging
        # buffer of the group to fill and copy. in_parts: this hand is.
        self.takes_parts = False
        self.in_parts = False

    def install(self):
        o = self.owner
        # A released parameter is one element expanded to its shape: it costs
        # nothing, and autograd's AccumulateGrad, which shapes .grad after
        # the parameter, still sees the right shape.
        one = torch.zeros(1, dtype=o.dtype, device=o.device)
        # A 0-d parameter cannot be expanded from one element: it gets its own.
        self.placeholders = {p: one.expand(self.shapes[p]) if len(self.shapes[p]) else
                             torch.zeros((), dtype=o.dtype, device=o.device) for p in self.params}
        for p in self.params:
            # The compute dtype first: changing a parameter's dtype gives it a
            # new AccumulateGrad node, which would not have our hook.
            with _fou.quiet():
                p.data = self.placeholders[p]
            if not self.frozen:
                self._hook(p)
        self.takes_parts = (not self.frozen and o.device.type == "cpu" and
                            o.engine.takes_grad_parts(self.index, o.engine.compute_dtype))

    @staticmethod
    def _node(p):
        # The AccumulateGrad node of p: its hook runs once p.grad holds
        # this backward's gradient. (Grad mode on: under no_grad the expand
        # would have no grad_fn.)
        with torch.enable_grad(), _fou.quiet():
            return p.expand_as(p).grad_fn.next_functions[0][0]

    def _hook(self, p, acc=None):
        acc = acc if acc is not None else self._node(p)
        self.grad_hooks.append(acc.register_hook(lambda *_, p=p: self.owner.grad_ready(self, p)))
        self.grad_accs.append(acc)

    def unhook(self):
        """Removes our hooks from the parameters' AccumulateGrad nodes."""
        for h in self.grad_hooks:
            h.remove()
        self.grad_hooks, self.grad_accs = [], []

    def rehook(self):
        """After the parameters' data took another dtype and came back (a
        load_state_dict of values in their own dtype under a bf16/fp16
        config): autograd gave them new AccumulateGrad nodes, without our
        hook, so their gradients would never reach the engine. They get it
        again (the old nodes' removed)."""
        if self.frozen:
            return
        nodes = [self._node(p) for p in self.params]  # (all found before any hook goes)
        self.unhook()
        for p, acc in zip(self.params, nodes):
            self._hook(p, acc)

    def stage(self, p):
        i = next(k for k, q in enumerate(self.params) if q is p)
        off = self.offsets[i]
        grad = p.grad
        if grad.is_sparse:
            raise Error(INVALID, f"{self.names[i]}: a sparse gradient (e.g. nn.Embedding(sparse=True)); "
                        "offload_module takes dense gradients only")
        o = self.owner
        if not self.arrived and self.staged is None:
            # This hand's first gradient: in parts where the engine takes them
            # (a step's first gradients of the group, one backward a step).
            self.in_parts = (self.takes_parts and not o.engine_accumulates and self.index not in o._handed
                             and grad.dtype == o.dtype and grad.device == o.device
                             and (o.world_size == 1 or o._parts_open is None))
            if self.in_parts:
                o._overlap.before_grads(self, count=False)  # (prepare_step comes before any gradient)
                if o.world_size > 1:
                    o._parts_open = self.index
        if self.in_parts:
            if i in self.arrived:  # another backward reached it: the engine adds it to its part
                o._norms_exact = False
            self._part(i, off, grad)
        else:
            self._stage(i, off, grad)
        if i not in self.arrived:
            if id(p) in o._norms:  # handed in parts this step
                o._norms_exact = False
            elif o._norms_exact and not o.engine_accumulates and o.world_size == 1:
                if self.in_parts and grad.is_contiguous() and grad.dtype == o.dtype and not o._scaling.enabled:
                    # In the engine's accumulator as it is: its norm is taken
                    # there if clip_grad_norm_ asks (_LazyNorm), else never.
                    o._norms[id(p)] = _LazyNorm(self, i)
                else:
                    # The norm of the (fp16: unscaled) gradient in float32, as
                    # torch's clip_grad_norm_ would take it of a float32 master's
                    # .grad: a bf16 gradient's own norm would be rounded to bf16.
                    o._norms[id(p)] = _torch_norm_of(grad.float() / o._scaling.scale if o._scaling.enabled else
                                                     grad.float())
        p.grad = None
        self.arrived.add(i)

    def _stage(self, i, off, grad):
        o = self.owner
        # A group of one parameter (an embedding, often half a model) hands
        # the gradient itself: no staging buffer to fill and copy. The
        # engine reads it before grads returns on the CPU; on a GPU, on the
        # stream it is given, so the tensor stays referenced until the hand.
        whole = (self.staged is None and len(self.params) == 1 and grad.dtype == o.dtype and
                 grad.device == o.device and grad.is_contiguous())
        if self.staged is None and not whole:
            # Every element is written below or zeroed at the hand
            # (take_staged): no zero fill of the whole group first.
            self.staged = torch.empty(self.numel, dtype=o.dtype, device=o.device)
        if whole:
            self.staged = grad.reshape(-1)
        elif i in self.arrived:  # another backward reached it (a reentrant checkpoint's, a second loss)
            self.staged[off:off + self.numels[i]].add_(grad.reshape(-1))
            o._norms_exact = False
        else:
            self.staged[off:off + self.numels[i]].copy_(grad.reshape(-1))

    def _part(self, i, off, grad):
        o = self.owner
        # As _stage's copy_ would convert one of another dtype (the hand's
        # first set the dtype its parts go in).
        flat = grad.reshape(-1).to(device=o.device, dtype=o.dtype)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        try:
            # Lent: the step (one rank, the state in host memory) or the
            # reduce-scatter (several) reads it where it is instead of a copy
            # in the middle of backward; the binding holds the tensor until
            # the engine reads it no more (elsewhere: copied, let go at once).
            o.engine.grads_part(self.index, off, flat, lend=True)
        except Error as e:
            raise o._overlap.explain(e, self, "given more gradients") from None

    def complete(self):
        return len(self.arrived) == len(self.params)

    def pending(self):
        return bool(self.arrived)

    def end_parts(self):
        """The hand in parts is complete (the engine's grads_end is next)."""
        self.in_parts, self.arrived = False, set()
        if self.owner._parts_open == self.index:
            self.owner._parts_open = None

    def take_staged(self):
        """The group's gradients, zeros for the parameters that got none
        (stage left their part unwritten)."""
        staged, arrived = self.staged, self.arrived
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            if i not in arrived:
                staged[off:off + n].zero_()
        self.staged, self.arrived = None, set()
        return staged
