"""Saved-tensor hooks, strata's and everyone else's: which pair is on top of
this thread's stack, and an offloaded module's own pair, which saves a view
of one of its fetched groups as a place in the group and hands every other
tensor to the pair it is nested in (torch.utils.checkpoint's, save_on_cpu,
offload_activations on an engine of its own, the user's).

Why nest rather than tell checkpoint's phases apart: torch.utils.checkpoint
(non-reentrant) keeps nothing in its first forward and keeps the tensors the
recomputation saves until backward uses them. Both phases run with its
hooks on top; an offloaded module's forward then puts its own pair on top of
those, so a view of a fetched group never reaches checkpoint at all (in
either phase, so both count the same tensors), comes back by fetch, and the
group is released when its forward ends. Everything else reaches checkpoint
as before. It relies on the public saved_tensors_hooks API only (the
innermost pair decides; a pair may call the one below), not on checkpoint's
internals, which differ between torch 1.13 and 2.x.
"""

import threading
import weakref

import torch

_tls = threading.local()  # .stack: (pack, unpack) of every saved_tensors_hooks entered on this thread, innermost last

# torch 2.x says which pair is on top; torch 1.13 does not, and the stack
# kept below (every saved_tensors_hooks context is counted) says it there.
_torch_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

# The live offloaded modules, told when a pair other than theirs is entered.
_owners = weakref.WeakSet()


def top():
    """The (pack, unpack) pair on top of this thread's saved-tensor hooks, or None."""
    if _torch_top is not None:
        try:
            return _torch_top(False)
        except TypeError:  # a torch 2 whose function takes no argument
            return _torch_top()
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


def owner_of(pair):
    """The offloaded module whose own pair `pair` is, or None."""
    return getattr(pair[0], "_strata_owner", None) if pair is not None else None


def register(owner):
    _owners.add(owner)


def _nothing():
    pass


def in_backward():
    """Whether a backward runs on this thread (a forward now is a reentrant
    checkpoint's recomputation, whose saved tensors live only until its
    inner backward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is not None:
        return task() != -1
    try:  # torch 1.13: only a running backward takes a final callback (a raise costs ~0.5 ms)
        torch.autograd.Variable._execution_engine.queue_callback(_nothing)
        return True
    except RuntimeError:
        return False


class _Below:
    """A tensor the pair below ours packed (what that pair's unpack takes)."""
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class owner_hooks:
    """Context: `owner`'s pack and unpack on top, nested in `below` (the pair
    that was on top, or None). A view of one of owner's fetched groups is
    saved as its place; any other tensor goes to `below`, or with no pair
    below, to owner's activation store (owner.keep, with offload_activations
    on and no backward running) or as it is."""

    def __init__(self, owner, below):
        if below is None:
            keep = owner.keep if owner.activation_threshold is not None and not in_backward() else None

            def pack(t):
                place = owner.place(t)
                return place if place is not None else keep(t) if keep is not None else t

            unpack = owner.unpack
        else:
            below_pack, below_unpack = below

            def pack(t):
                place = owner.place(t)
                return place if place is not None else _Below(below_pack(t))

            def unpack(saved):
                return below_unpack(saved.packed) if isinstance(saved, _Below) else owner.unpack(saved)
        pack._strata_owner = owner
        self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def __enter__(self):
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


# Every saved_tensors_hooks context (checkpoint's subclasses, save_on_cpu,
# the user's, strata's) is tracked on entry and exit: the stack for torch
# 1.13's top(), and a pair other than an offloaded module's entered, with
# grad enabled, while one of its forwards runs is told to it (the tensors
# saved under that pair bypass its pack, so the groups those forwards hold
# stay until their gradients).
_sth = torch.autograd.graph.saved_tensors_hooks
if not getattr(_sth, "_strata_tracked", False):
    _orig_enter, _orig_exit = _sth.__enter__, _sth.__exit__

    def _tracked_enter(self):
        r = _orig_enter(self)
        stack = getattr(_tls, "stack", None)
        if stack is None:
            stack = _tls.stack = []
        stack.append((self.pack_hook, self.unpack_hook))
        if torch.is_grad_enabled() and getattr(self.pack_hook, "_strata_owner", None) is None:
            for owner in list(_owners):
                owner.foreign_hooks_entered()
        return r

    def _tracked_exit(self, *exc):
        stack = getattr(_tls, "stack", None)
        if stack:
            stack.pop()
        return _orig_exit(self, *exc)

    _sth.__enter__, _sth.__exit__ = _tracked_enter, _tracked_exit
    _sth._strata_tracked = True
