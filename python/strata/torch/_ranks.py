"""offload_module on several ranks: which groups get gradients in a step,
agreed by every rank, so that every rank hands the same groups in the same
order (each grads call is a collective: the ranks' reductions pair in call
order).

A model whose use of a module depends on the batch (a branch one rank's
batch skips, a head whose output one rank's loss leaves out) gives that
module's group a gradient on some ranks only. Before, only those ranks
handed it, and the ranks' reductions paired the wrong groups: COMM
("ranks disagree on this collective"), naming neither the module nor why,
and the communicator was broken for good. Now a group with a gradient on
any rank is handed on every rank, zeros where a rank has none: the step
averages them, as torch DDP's all-reduce averages in the zeros of a rank
that did not use a parameter (find_unused_parameters).

The engine's sum over the ranks is taken only before a step's first
gradient (sum_over_ranks' rule), so the ranks agree there:
  - at each rank's first gradient of the step (in backward, before it is
    staged), on what autograd will give this backward: per trainable
    parameter, whether its AccumulateGrad node will run
    (torch._C._will_engine_execute_node). Where every rank foresees the same
    parameters (the usual step) the gradients go to the engine as backward
    produces them, as on one rank. Where the ranks differ, or one cannot
    tell, none hands any gradient of this step during backward: each rank
    stages them (float32, summed over the step's backward passes), and at
    step() (or clip_grad_norm_) the ranks agree on which groups hold one and
    hand those, in group order, zeros where a rank has none. That costs a
    float32 copy of the step's gradients in memory and the overlap of the
    reductions with backward, in such steps only.
  - at step() or clip_grad_norm_, by a rank that had no gradient in the step
    (its loss reached no offloaded parameter): its part of the first
    agreement, with nothing foreseen.
Not covered: a later backward pass of a step (gradient accumulation) whose
groups differ by rank where the first pass's did not (the gradients of the
first are pending in the engine by then, and the ranks cannot agree again);
and stage 3, where a module one rank skips already misses the forward's
all-gathers of its parameters.
"""

import torch

from .. import Error, STATE
from ._config import _current_stream


class _Agreement:
    """This step's agreement, made for the step whose OffloadedModule._norms
    and _Overlap.hands are `marks` (each is a new dict at every step() and
    zero_grad(): on every rank, whether it had gradients to drop or not);
    `defer`: the step's gradients are staged until step(); `passed`: group
    index -> ids of its parameters whose gradients this backward pass
    staged (deferred)."""
    __slots__ = ("marks", "defer", "passed")

    def __init__(self, marks, defer):
        self.marks, self.defer, self.passed = marks, defer, {}


def _marks(owner):
    return owner._norms, owner._overlap.hands


def _current(owner):
    a = getattr(owner, "_rank_agreement", None)
    return a if a is not None and all(x is y for x, y in zip(a.marks, _marks(owner))) else None


def deferring(owner):
    """Whether this step's gradients are staged until step() (several ranks
    that foresaw different parameters)."""
    a = _current(owner) if owner.world_size > 1 else None
    return a is not None and a.defer


def _trainable(owner):
    return [g for g in owner._groups if not g.frozen]


def _agree(owner, flags, unsure):
    sums = owner.engine.sum_over_ranks(flags + [1.0 if unsure else 0.0])
    w = owner.world_size
    a = _Agreement(_marks(owner), sums[-1] > 0 or any(0 < n < w for n in sums[:-1]))
    owner._rank_agreement = a
    return a


def at_gradient(owner):
    """A gradient reached a parameter (several ranks): at the step's first,
    the ranks agree on what this backward will give."""
    if _current(owner) is not None:
        return
    will = getattr(torch._C, "_will_engine_execute_node", None)
    unsure, flags = will is None, []
    for g in _trainable(owner):
        for i, p in enumerate(g.params):
            hit = False
            if not unsure:
                try:
                    hit = bool(will(g.grad_accs[i]))
                except (RuntimeError, IndexError, TypeError):
                    unsure = True  # (the ranks then stage this step's gradients: always right)
            flags.append(1.0 if hit else 0.0)
    _agree(owner, flags, unsure)


def new_pass(owner):
    """A backward pass begins: none of its gradients is staged yet."""
    a = _current(owner)
    if a is not None:
        a.passed = {}


def staged(owner, g, p):
    """A deferred step staged p's gradient: once every parameter of group g
    has its gradient of this backward pass, g is let go (as a hand would)."""
    done = _current(owner).passed.setdefault(g.index, set())
    done.add(id(p))
    if len(done) == len(g.params):
        owner._pinned.pop(g.index, None)
        owner.release(g)


def settle(owner):
    """Before step() or clip_grad_norm_ (several ranks): a rank that had no
    gradient in this step makes its part of the first agreement; a deferred
    step hands the groups that hold a gradient on any rank, in group order,
    zeros where this rank has none."""
    a = _current(owner)
    groups = _trainable(owner)
    if a is None:
        try:
            a = _agree(owner, [0.0] * sum(len(g.params) for g in groups), False)
        except Error as e:
            if e.status != STATE:
                raise
            return  # a failed step is pending on every rank (the engine agreed it): step() finishes it
    if not a.defer:
        return
    have = owner.engine.sum_over_ranks([1.0 if g.arrived else 0.0 for g in groups])
    a.defer = False  # (handed below: a later settle of this step has nothing to hand)
    for g, n in zip(groups, have):
        if not n:
            continue
        if g.arrived:
            owner._hand(g)
            continue
        # None here, some on another rank: zeros, so that every rank hands it.
        owner._overlap.before_grads(g)
        g.handed_params = set(range(len(g.params)))  # (the other ranks' gradients: none missed)
        g.ever_handed = True
        owner._handed.add(g.index)
        try:
            owner.engine.grads(g.index, torch.zeros(g.numel, dtype=owner.dtype, device=owner.device),
                               stream=_current_stream(owner.device.type))
        except Error as e:
            raise owner._overlap.explain(e, g, "given more gradients") from None
