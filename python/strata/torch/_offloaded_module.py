"""OffloadedModule, what offload_module returns: the state of one offloaded
model. It builds the engine and the groups, installs the hooks
(_module_hooks), owns the step, clipping and close; the model's
state_dict is _module_state's.
"""

import functools
import math
import os
import warnings
import weakref

import torch

from .. import Error, INVALID, STATE
from .._native import at_child_exit
from . import _fetch_on_use as _fou, _saved_tensors as _saved, _signals
from ._clip import _OWNERS, _check_clip_args, _clip_result, _engine_clip_for, _engine_max_norm, _torch_total_norm
from ._config import (_TORCH2, _current_stream, _engine_device, _engine_tag, _new_engine, _remove_swap_folders,
                      _resolve_ranks, _say_autos, _separate_swap_folders, _swap_folders, _torch_dtype)
from ._loss_scale import _LossScaling, _ScalesLoss, _fp16_section
from ._module_group import _LazyNorm, _ModuleGroup
from ._module_hooks import _ModuleHooks, _forward_hooks_always_called
from ._module_state import _ModuleStateDict
from ._offload_optimizer import OffloadOptimizer
from ._overlap import _Overlap


class OffloadedModule(_ScalesLoss, _ModuleHooks, _ModuleStateDict):
    """What offload_module returns: the engine that owns the parameters, the
    optimizer that steps them (`optimizer`, a torch.optim.Optimizer), and
    the model's full state (state_dict / load_state_dict, through the model
    too). close() removes the hooks and gives the module its parameters
    back as ordinary tensors holding the master weights."""

    def __init__(self, module, config, force_no_gpu, grad_accumulation_steps, rank=None, world_size=None,
                 overlap_step=None, loss_scaled=False):
        self.module = module
        self.engine = None
        # What close() and a failed construction undo, empty until set.
        self._handles = []
        self._groups = []  # _ModuleGroup per module with direct trainable parameters of its own
        self._names = []  # (qualified name, parameter) of every offloaded name, tied ones included
        self._loaders = []
        self._fetched = {}  # group index -> (flat tensor, first byte address, end address)
        self._refs = {}  # group index -> running forwards (scopes) that hold it
        self._scopes = []  # _Scope per module forward running, innermost last
        self._pinned = {}  # group index -> group, held until its gradients are in or backward ends
        self._loose = {}  # group index -> group, used outside any forward: held until backward ends or step
        self._handed_out = {}  # id(param) -> _HandedOut: tensors of it handed out outside every forward
        self._scaling = _LossScaling("offload_module", _fp16_section(config).get("enabled") is True, loss_scaled,
                                     self._engine_loss_scale)
        self.rank, self.world_size = _resolve_ranks(rank, world_size, "offload_module")
        if overlap_step not in (None, True, False):
            raise Error(INVALID, f"offload_module: overlap_step={overlap_step!r}; one of None (on, the default), "
                        "True, False")
        config = _separate_swap_folders(config, _engine_tag(id(self)))
        self._folders = _swap_folders(config)
        try:
            # A group that got no gradient in a step (a module unused in it,
            # or whose parameters were all frozen since) is left untouched,
            # with its own step count: torch AdamW's rule for .grad None.
            self.engine = _new_engine(config, self.rank, self.world_size, force_no_gpu=force_no_gpu,
                                      grad_accumulation_steps=grad_accumulation_steps, skip_groups_without_grads=True,
                                      overlap_step=overlap_step is not False)
        except BaseException:
            with _signals.deferred():  # (a second Ctrl-C waits until the undo is done: _signals)
                _remove_swap_folders(self._folders)
                raise
        # The engine is closed and its folders removed by close(), or when
        # this is collected (a model dropped without close(): the module's
        # hooks and this form a cycle the collector frees), or at exit. Not
        # a method of self: the finalizer must not hold it. In a
        # multiprocessing child, at its exit too (its os._exit skips
        # weakref.finalize's exit hook): the same finalizer, which runs once.
        self._finalizer = weakref.finalize(self, _release_engine, self.engine, self._folders, os.getpid())
        at_child_exit(self, self._finalizer)
        originals = {}  # id(parameter) -> its tensor before offload_module: what a failure gives back
        try:
            self._offload(module, config, grad_accumulation_steps, overlap_step, originals)
        except BaseException:
            # A refusal (_check_module, 64 aliases), a failed build, Ctrl-C:
            # the model as it was, the engine closed, its folders removed.
            with _signals.deferred():
                self._teardown(originals)
                raise

    def _offload(self, module, config, grad_accumulation_steps, overlap_step, originals):
        """The groups, the hooks and the optimizer over the engine (see
        __init__); `originals` gets each parameter's tensor before its
        placeholder replaces it."""
        self._check_module(module)
        _say_autos(config, self.engine.config, "offload_module", set())
        owner_of = {}  # id(parameter) -> its group
        users = []  # (module, [groups its forward needs])
        tied = []  # (qualified name, parameter) of a tied parameter's later names
        self._frozen_names = []  # (qualified name, parameter) of the frozen ones
        # Every name a module has (remove_duplicate=False): a module registered
        # under two names (T5's and BART's shared embedding) has its
        # parameters under both in state_dict, which torch walks by name; its
        # later names are aliases of the first, like tied parameters, and its
        # hooks are registered once.
        seen = set()
        for name, m in module.named_modules(remove_duplicate=False):
            again = id(m) in seen
            seen.add(id(m))
            own, frozen, needs = [], [], []
            for n, p in m.named_parameters(recurse=False):
                qual = f"{name}.{n}" if name else n
                self._names.append((qual, p))
                g = owner_of.get(id(p))
                if g is not None:  # tied: one master, in the group of its first module
                    tied.append((qual, p))
                    if g not in needs:
                        needs.append(g)
                elif p.requires_grad:
                    own.append((qual, p))
                else:
                    frozen.append((qual, p))
                    self._frozen_names.append((qual, p))
            # A module's frozen parameters (a LoRA base layer's weight) are
            # a group of their own: P only in the engine, never a gradient.
            for named, is_frozen in ((frozen, True), (own, False)):
                if named:
                    g = _ModuleGroup(self, len(self._groups), m, named, frozen=is_frozen)
                    self._groups.append(g)
                    for _, p in named:
                        owner_of[id(p)] = g
                    needs.insert(0, g)
            if not again:
                users.append((m, needs))  # every module: a scope for the parameters its forward reads
        if not any(not g.frozen for g in self._groups):
            raise Error(INVALID, "offload_module: the module has no trainable parameters")
        for qual, p in tied:  # strata-export writes a tied weight under each name
            g = owner_of[id(p)]
            first = next(n for n, q in zip(g.names, g.params) if q is p)
            self.engine.add_alias(g.index, qual, first)
        self.engine.build()
        # With its index: a tensor's device is cuda:N, and torch.device("cuda")
        # compares unequal to it (saved views of fetched groups went unseen by
        # pack, and backward read released buffers).
        self.device = _engine_device(self.engine)
        self.dtype = _torch_dtype(self.engine.compute_dtype)
        _saved.register(self)  # told when saved-tensor hooks other than ours are entered inside a forward
        self._conversions_said = set()  # the dtypes a conversion of the model was warned of (_ModuleState.convert)
        self._callback_queued = False
        # Activation offload (offload_activations): tensors of at least this
        # many bytes that autograd saves in a forward go to the engine's
        # activation store; None: off.
        self.activation_threshold = None
        self._clip_next = None
        self._norms, self._norms_exact = {}, True  # id(param) -> torch's norm of its staged gradient
        self.engine_accumulates = grad_accumulation_steps != 1
        self._keep_zero_grads = not _TORCH2  # zero_grad()'s default meaning in this torch
        self._handed = set()  # groups handed gradients this step
        # With several ranks the engine packs one group's parts at a time for
        # the reduction: the group whose are open (None: none).
        self._parts_open = None
        self._warned_missed = set()
        self._overlap = _Overlap(self, overlap_step, grad_accumulation_steps)
        self._group_of = owner_of
        for g in self._groups:
            for p in g.params:
                originals[id(p)] = p.data
            g.install()
            for p, qual in zip(g.params, g.names):
                if not g.frozen:
                    _OWNERS[id(p)] = self  # clip_grad_norm_: the trainable ones
                _fou.adopt(p, self, g, qual)
        for qual, p in tied:
            _fou.adopt(p, self, owner_of[id(p)], _fou._OFFLOADED[id(p)][3])
        always = _forward_hooks_always_called()
        for m, needs in users:
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, inp, needs=needs: self._before_forward(needs, mod)))
            self._handles.append(m.register_forward_hook(
                lambda mod, inp, out: self._after_forward(out), **always))
            if not always:  # torch < 2.1: a forward that raises still ends its scope
                self._handles.append(_EndScopeOnRaise(m, self._after_forward))
        self._handles.append(module._register_state_dict_hook(self._state_dict_hook))
        self._in_model_state_dict = False  # within the model's own state_dict (the root's hook reads the masters)
        for m, needs in users:  # a sub-module's own state_dict gives its masters too
            if m is not module and needs:
                self._handles.append(m._register_state_dict_hook(self._sub_state_dict_hook))
        # The model's load_state_dict, and a sub-module's own
        # (model.encoder.load_state_dict): the values given become the
        # masters of the groups under the module it was called on.
        self._loaders = [m for m in module.modules()
                         if m is module or any(id(p) in owner_of for p in m.parameters())]
        self._load_ctx = None
        # torch's hooks are not told whether a load is strict: each such
        # module's load_state_dict says it here (called otherwise, a load is strict).
        self._load_strict = True
        for m in self._loaders:
            self._handles.append(m._register_load_state_dict_pre_hook(self._load_pre_hook, with_module=True))
            self._handles.append(m.register_load_state_dict_post_hook(self._load_post_hook))
            m.load_state_dict = functools.partial(self._load_into, m)
        module.state_dict = self._module_state_dict
        module.__deepcopy__ = self.__deepcopy__  # copy.deepcopy(model) asks the instance first
        opt = self.engine.config["optimizer"]["params"]
        self.optimizer = OffloadOptimizer(self, [g for g in self._groups if not g.frozen], opt)

    def _check_module(self, module):
        """Refuses, naming the parameter, what would train wrongly or fail
        later: float64 (float32 masters), a dtype the config does not
        compute in (the model would run in the compute dtype), sparse
        gradients, a parameter subclass."""
        dtype = _torch_dtype(self.engine.compute_dtype)
        for name, m in module.named_modules():
            if getattr(m, "sparse", False) and isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                raise Error(INVALID, f"offload_module: {name or type(m).__name__}.weight would get sparse gradients "
                            "(sparse=True); offload_module takes dense gradients only")
        for name, p in module.named_parameters():
            if _fou.orphaned_name(p) is not None:
                raise Error(STATE, f"offload_module: parameter '{name}' was '{_fou.orphaned_name(p)}' of a model "
                            "dropped without close(): it holds no values, only a placeholder. close() an "
                            "OffloadedModule before dropping its model to keep its parameters' weights")
            if p.dtype == torch.float64:
                raise Error(INVALID, f"offload_module: parameter '{name}' is float64; the engine keeps float32 "
                            "master weights and would train it in float32: convert the model with .float()")
            if p.dtype != dtype and p.dtype != torch.float32:
                # float32 parameters under bf16/fp16 compute are mixed
                # precision (the model runs in the compute dtype, masters
                # stay float32); a half-precision model under float32
                # compute would run in float32 behind the user's back.
                raise Error(INVALID, f"offload_module: parameter '{name}' is {p.dtype} but the config computes in "
                            f"{dtype}: enable the matching bf16/fp16 section in the config, or convert the model "
                            "to float32")
            if type(p) not in (torch.nn.Parameter, _fou._OffloadedParameter):
                raise Error(INVALID, f"offload_module: parameter '{name}' is a {type(p).__name__}; plain "
                            "nn.Parameter only")

    # -- the optimizer
    def step(self, lr=None, betas=None, eps=None, weight_decay=None, max_grad_norm=None):
        """One optimizer step over every group; None takes the config's
        value (max_grad_norm: the clip_grad_norm_ of this step, else the
        config's gradient_clipping). A group that got no gradient since the
        last step is left alone, as torch leaves a parameter whose .grad is
        None (but see zero_grad). Gradients are
        averaged over the ranks and the grad_accumulation_steps backward
        passes (strata.grad_reduce "mean"). Returns (grad_norm, skipped)."""
        self._check_open("step")
        _fou.unstick_quiet()  # (no strata code runs on this thread: see unstick_quiet)
        self._end_stale_scopes("step")
        self._settle()
        if self._keep_zero_grads:
            for g in self._groups:  # torch would step their zero .grad
                if not g.frozen and g.ever_handed and g.index not in self._handed:
                    self._handed.add(g.index)  # (before the call: zero_grad then drops them with the rest)
                    self.engine.grads(g.index, torch.zeros(g.numel, dtype=self.dtype, device=self.device),
                                      stream=_current_stream(self.device.type))
        clipped = max_grad_norm is None and self._clip_next is not None
        if max_grad_norm is None:
            max_grad_norm = self._clip_next
        # The options as the engine will take them, None as the config's
        # value, so that prepare_step's and step's compare equal.
        opts = self._overlap.options(lr, betas, eps, weight_decay, max_grad_norm)
        # What this step consumes (the gradients handed, the clip and norms,
        # the scaled-loss check) is reset once the engine's step is over,
        # not before: a raise before it steps (Ctrl-C in the Python on the
        # way) leaves it as it was, so that zero_grad() drops the handed
        # gradients (before, it believed none were given and the next step added them to its own)
        # and a step() run again clips. An Error from the engine's step ends the step as before;
        # another raise (Ctrl-C delivered as the native step returns) ends it where the engine
        # stepped (its counts moved).
        counts = self.engine._step_counts()
        try:
            result = self.engine.step(**opts)
        except BaseException as e:
            with _signals.deferred():  # (a second Ctrl-C waits until the step is ended: _signals)
                try:
                    stepped = isinstance(e, Error) or self.engine._step_counts()[0] != counts[0]
                except Error:
                    stepped = False
                if stepped:
                    self._end_step(opts, clipped)
                raise
        self._end_step(opts, clipped)
        return result

    def _end_step(self, opts, clipped):
        """What a step consumed, reset (whole: _signals) once the engine stepped (or its step failed)."""
        with _signals.deferred():
            self._clip_next = None
            self._norms, self._norms_exact = {}, True
            self._handed = set()
            for g in self._groups:
                g.handed_params = set()
            self._scaling.stepped()
            self._overlap.after_step(opts, clipped)

    # -- fp16 loss scaling (see offload_module)
    def _engine_loss_scale(self):
        if self.engine is None:
            raise Error(STATE, "offload_module: closed; it has no loss scale")
        return self.engine.loss_scale

    def zero_grad(self, set_to_none=None):
        """Gradients go to the engine and never stay in .grad; what is
        recorded is torch's meaning of the call for the next step: with
        set_to_none=False (torch 1.x's default) a parameter that had a
        gradient keeps a zero one, so a step it gets no new gradient in
        still updates it (decay, moments), as torch would; with True (torch
        2.x's default) it is skipped. Gradients given since the last step
        (a batch skipped after its backward, a backward that raised) are
        dropped, with clip_grad_norm_'s clip for them, as torch's zero_grad
        drops .grad."""
        _fou.unstick_quiet()  # (no strata code runs on this thread: see unstick_quiet)
        self._end_stale_scopes("zero_grad")
        self._keep_zero_grads = not (_TORCH2 if set_to_none is None else bool(set_to_none))
        self._drop_grads()

    def _drop_grads(self):
        """What the backward passes since the last step gave goes, as torch's
        zero_grad drops .grad: the gradients staged here, and those already
        handed to the engine (discard_grads; STATE where overlap_step's
        early updates are final already), with the clip and the norms
        clip_grad_norm_ took of them. A backward that raised part-way (a
        hook, a NaN check, an OOM) never reaches its end, where autograd
        runs our queued callback: its groups are let go here, and the hooks
        start the next backward afresh. Before, a backward that completed
        kept its gradients: the next step summed a skipped batch's in."""
        raised = self._callback_queued or self._scaling.in_backward
        given = raised or bool(self._handed) or any(g.in_parts or g.staged is not None or g.arrived
                                                      for g in self._groups)
        if not given:  # (after a step, or between a forward and its backward: nothing to drop, nothing held to let go)
            self._clip_next = None
            self._norms, self._norms_exact = {}, True
            return
        self._callback_queued = False
        self._scaling.in_backward = False
        in_engine = bool(self._handed)
        for g in self._groups:
            if g.in_parts:  # an open hand in parts: closed, then dropped with the rest
                g.end_parts()
                self.engine.grads_end(g.index)
                in_engine = True
            g.staged, g.arrived = None, set()
            g.refused.clear()
        self._drop_holds()  # (the engine drops nothing while a group is fetched)
        for g in self._groups:
            self.release(g)
        if in_engine:
            try:
                self.engine.discard_grads()
            except Error as e:
                when = "after a backward that raised" if raised else "before step()"
                raise Error(e.status, f"offload_module: zero_grad {when}: the gradients it gave the engine cannot "
                            f"be dropped ({e.message}); step() applies them, or load a checkpoint to go back "
                            "(with offload_module(overlap_step=False) zero_grad can always drop them)") from None
            self._handed = set()
            for g in self._groups:
                g.handed_params = set()
        # (Kept where the engine kept the gradients: step() applies them.)
        self._clip_next = None
        self._norms, self._norms_exact = {}, True
        self._overlap.after_discard()  # (after a step: nothing of the next began, this changes nothing)

    def _settle(self):
        """Between backward and step: a backward that ended without our
        callback (no gradient reached a group) leaves nothing held; a frozen
        parameter made trainable since offload_module is refused, naming it;
        one that got no gradient beside others of its group is warned of."""
        self._hand_pending_and_let_go()
        for name, p in self._frozen_names:
            if p.requires_grad or p.grad is not None:
                raise Error(INVALID, f"offload_module: frozen parameter '{name}' was made trainable after "
                            "offload_module; its gradients would be dropped: close() and offload the module "
                            "again")
        missed = [n for g in self._groups if g.index in self._handed
                  for i, n in enumerate(g.names) if i not in g.handed_params]
        if missed and not self._warned_missed.issuperset(missed):
            self._warned_missed.update(missed)
            warnings.warn(f"offload_module: {len(missed)} parameter(s) got no gradient this step while others of "
                          f"their module did ({', '.join(missed[:5])}{', ...' if len(missed) > 5 else ''}); the "
                          "engine steps a module's parameters together, so these step with zero gradients "
                          "(weight decay and moments advance), where torch AdamW would skip them")

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, params=None):
        """torch.nn.utils.clip_grad_norm_ for the offloaded parameters (which
        the torch function, patched by strata.torch, sends here): returns the
        total L2 norm of this step's gradients (averaged over the ranks) and
        clips them to max_norm at the coming step. On one rank with one
        backward per step it is torch's arithmetic, bitwise (`params`: the
        order torch was given them); else the engine's norm (in double). A
        collective."""
        self._check_open("clip_grad_norm_")
        _check_clip_args(max_norm, norm_type)
        self._settle()
        norm = self.engine.grad_norm()
        exact = self._exact_norms(params)
        if exact is not None:
            # torch's own arithmetic over the gradients as they were staged
            # (one rank, one backward per step): its norm, and its float32
            # coefficient, which the engine then applies exactly.
            total = _torch_total_norm(exact)
            if error_if_nonfinite and not torch.isfinite(total):
                _clip_result(float("inf"), norm_type, True)
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            if not (torch.isfinite(total) and math.isfinite(norm)):
                # An overflow (fp16) or a NaN: the step skips it (or, with
                # strata.nonfinite "apply", applies it unclipped).
                self._clip_next = 0.0
            else:
                self._clip_next = _engine_clip_for(float(coef), norm) if float(coef) < 1.0 else 0.0
            self._overlap.clip_unclipped = 0.0  # what this path gives a step it does not clip
            return total
        result = _clip_result(norm, norm_type, error_if_nonfinite)  # raises before anything is set
        # (0 clips to exact zeros, infinity not at all, as torch's: _engine_max_norm)
        self._clip_next = self._overlap.clip_unclipped = _engine_max_norm(max_norm)
        return result

    def _exact_norms(self, params):
        """torch's per-parameter norms, in the order clip_grad_norm_ was
        given the parameters, where they are exact: one rank, and every
        gradient of this step staged once. Else None."""
        if not self._norms_exact or self.world_size != 1 or self.engine_accumulates or not self._norms:
            return None
        order = params if params is not None else [p for g in self._groups if not g.frozen for p in g.params]
        views = {}  # group index -> its accumulator (grads_view), for the norms taken from it
        return [n.value(views) if isinstance(n, _LazyNorm) else n
                for n in (self._norms[id(p)] for p in order if id(p) in self._norms)] or None

    def _clip_ids(self):
        return {id(p) for g in self._groups if not g.frozen for p in g.params}

    def __deepcopy__(self, memo):
        """copy.deepcopy of the model, of this, or of its optimizer: refused,
        saying what to do (the engine that holds the values is not copied)."""
        raise Error(INVALID, f"copy.deepcopy of a {type(self.module).__name__} under offload_module: not supported "
                    "(its parameters' values live in the Strata engine, which is not copied). deepcopy the model "
                    "before offload_module; or build a fresh model and load_state_dict(model.state_dict()) into it "
                    "(the master weights); close() gives the model back as an ordinary one")

    def close(self):
        """Removes the hooks; the parameters become ordinary tensors holding
        the master weights (in their original dtype); the engine is freed,
        or, while a tensor handed out outside every forward (p.detach(),
        p.data, p.t()) still views its memory, when the last one goes.
        Where a master cannot be read now (a failed step pending, or early
        updates of a step not made yet) close() raises STATE naming them and
        closes nothing: the weights are kept for step() (or a checkpoint
        load), then close(). (A model dropped without close() is freed all
        the same, by the collector or at exit.)"""
        if self.engine is None:
            return
        while self._scopes:  # a forward that raised: its scopes never ended
            scope = self._scopes.pop()
            if scope.ctx is not None:
                scope.ctx.__exit__(None, None, None)
        # A write through a tensor handed out outside every forward is said
        # once the model is closed (raised before, it would leave it open):
        # the reads of the masters below must not refuse it.
        handed = self._handed_out
        written = self._writes() if handed else None
        viewed = any(h.alive() for h in handed.values())
        self._handed_out = {}
        values, lost = self._masters_for_close()
        if lost is not None:
            self._handed_out = handed  # (open still: its writes are watched as before)
            raise lost
        self._teardown(values, keep_engine=viewed)
        if written is not None:
            raise written

    def _masters_for_close(self):
        """{id(parameter): its master in its own dtype and device} of every
        group whose masters can be read, and the Error naming the others'
        parameters (None: none). A group updated early by the overlapped
        step, whose update is final (strata.nonfinite "apply"), cannot be
        read until step()."""
        self._between_passes()
        values, names, why = {}, [], None
        for g in self._groups:
            try:
                masters = self._masters_of([g])
            except Error as e:
                why = why or e.message
                names += g.names
                continue
            for p in g.params:
                values[id(p)] = masters[id(p)].to(dtype=g.dtypes[p], device=g.devices[p])
        if not names:
            return values, None
        return values, Error(STATE, f"offload_module: close(): the master weights of {', '.join(names[:5])}"
                             f"{', ...' if len(names) > 5 else ''} cannot be read now ({why}); nothing was closed, "
                             "the weights are kept: call step() (a backward's gradients, once the overlapped step "
                             "applied them early, leave the masters readable only after it; a failed step is "
                             "finished by step() too), or zero_grad() where it can drop them (always with "
                             "offload_module(overlap_step=False)), or load a checkpoint; then close()")

    def _teardown(self, values, keep_engine=False):
        """Undoes offload_module (the engine is freed whatever fails on the
        way): each parameter gets values[id(p)] as its data (not given: it keeps
        its data) and
        is an ordinary nn.Parameter again, the hooks go, and the engine is
        closed with its folders removed (keep_engine: when the last tensor
        viewing its memory goes, see _close_when_unviewed)."""
        self._pinned.clear()
        self._loose.clear()
        try:
            for g in self._groups:
                self._refs[g.index] = 0
                try:
                    self.release(g)
                except Error:
                    pass  # (the engine is freed below: nothing stays held)
                self._fetched.pop(g.index, None)
                g.views = None  # (tensors of the fetched memory: they would keep the engine alive)
                with _fou.quiet():
                    for p in g.params:
                        if id(p) in values:
                            p.data = values[id(p)]
                        _OWNERS.pop(id(p), None)
                        _fou.disown(p)
            for h in self._handles:
                h.remove()
            self._handles = []
            for g in self._groups:  # a parameter that keeps its dtype keeps its AccumulateGrad node, and our hook on it
                g.unhook()
            for m in self._loaders:
                m.__dict__.pop("load_state_dict", None)
            self.module.__dict__.pop("state_dict", None)
            self.module.__dict__.pop("__deepcopy__", None)
        finally:
            self._fetched.clear()
            engine, self.engine = self.engine, None
            if keep_engine:
                self._finalizer.detach()
                _close_when_unviewed(engine, self._folders)
            else:
                self._finalizer()  # (engine.close(), the folders removed)

    def _check_open(self, what):
        """STATE after close(), naming the call."""
        if self.engine is None:
            raise Error(STATE, f"offload_module: {what} after close(): the module was closed (its "
                        "engine freed; the model holds ordinary parameters again). offload_module the model again "
                        "to train it offloaded, or use a torch optimizer on it")


def _release_engine(engine, folders, pid):
    """An OffloadedModule's engine closed and its swap folders removed: by
    close(), when the OffloadedModule is collected, or at exit. In a forked
    child (a DataLoader worker) the engine and folders are the parent's:
    the folders are left alone, and the Engine's close() only drops its
    handle there (the child's copy has none of the engine's threads)."""
    _fou.orphan_collected()
    engine.close()  # (in a forked child the Engine only drops its handle: strata.Engine.close)
    if os.getpid() == pid:
        _remove_swap_folders(folders)


def _close_when_unviewed(engine, folders):
    """close() while tensors handed out outside every forward view the
    engine's memory: the engine is freed when the last tensor viewing it
    goes (each holds the Engine object: Engine.as_tensor; its __del__
    closes it), its folders removed then; or at exit (a multiprocessing
    child's too: at_child_exit)."""
    at_child_exit(engine, weakref.finalize(engine, _release_unviewed, weakref.ref(engine), folders, os.getpid()))


def _release_unviewed(engine_ref, folders, pid):
    engine = engine_ref()
    if engine is not None:  # at exit
        _release_engine(engine, folders, pid)
    elif os.getpid() == pid:  # the Engine object went (closed by its __del__)
        _remove_swap_folders(folders)


class _EndScopeOnRaise:
    """Where torch's forward hooks cannot be always called (before 2.1), a
    module's forward that raises would leave its scope open: its groups
    fetched for good, so every later step fails ("group N is fetched and
    not released"), and its saved-tensor hooks entered. This wraps the
    module's forward (an instance attribute, which Module.__call__ calls)
    so that a raise ends the scope, as always_call's hook does with no
    output, then propagates. remove() restores what was there."""

    def __init__(self, module, end):
        self._module = module
        self._had = "forward" in module.__dict__
        self._old = module.__dict__.get("forward")
        inner = module.forward

        # The model's own signature, name and docstring (functools.wraps):
        # Hugging Face's Trainer reads inspect.signature(model.forward) to
        # pick the batch's columns, and a bare (*args, **kwargs) dropped them.
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except BaseException:
                with _signals.deferred():  # (a second Ctrl-C waits until the scope is ended: _signals)
                    end(None)
                    raise

        module.forward = forward

    def remove(self):
        if self._had:
            self._module.forward = self._old
        else:
            self._module.__dict__.pop("forward", None)
