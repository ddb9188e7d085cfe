"""The offloaded module's hooks, on the state OffloadedModule holds: a scope
per module forward, the groups fetched and released around it (and on use,
through _fetch_on_use), saved tensors packed as places in a group, and
each gradient staged and handed to the engine as autograd produces it.
"""

import weakref

import torch

from .. import Error, INVALID, STATE
from . import _fetch_on_use as _fou
from . import _signals
from ._config import _current_stream
from . import _activations as _acts
from ._module_group import _SavedView
from . import _saved_tensors as _saved


class _ModuleHooks:
    """OffloadedModule's forward and backward hooks (a mixin: the state is
    OffloadedModule's, set in its __init__: engine, module, device, _groups,
    _fetched, _refs, _scopes, _pinned, _loose, _callback_queued, _handed,
    _overlap, _scaling)."""

    # -- forward: a scope per module forward; parameters fetched on use
    #
    # A group is fetched (once; the engine counts nothing else) when a
    # forward that needs it starts (its module's own parameters, a tied
    # one's first module) or when torch code reads one of its parameters
    # (_fetch_on_use: nn.MultiheadAttention's out_proj, a parent reading a
    # child's weight, F.linear on another module's weight). It is held by
    # the innermost running forward (its scope) and released when that
    # forward ends, unless the forward's output aliases it (then the
    # enclosing forward holds it). A use outside every forward holds it
    # "loose", until backward ends or the step. While a forward runs, the
    # tensors autograd saves pass this module's pack first (_saved_tensors):
    # a view of a fetched group is saved as its place, so that backward
    # fetches the group again rather than read a released buffer; any other
    # tensor goes to the saved-tensor hooks the forward started under
    # (torch.utils.checkpoint's, in its first forward and in its
    # recomputation inside backward), or with none, to the activation store
    # or as it is. A pair of hooks other than ours entered while a forward
    # runs (checkpoint around a function inside it) sees the tensors saved
    # under it first: the groups held by the forwards then running stay
    # "pinned" until their gradients are in or backward ends.
    def _before_forward(self, needs, module):
        if _fou.compiling():
            _fou.refuse_compile(type(self.module).__name__)
        # No module's forward starts inside strata's own quiet() blocks: a
        # flag left on here is one an interrupt left (see unstick_quiet).
        # (Not only at the outermost forward: with torch 2.1+ a forward
        # ended by Ctrl-C leaves its scope open until step or zero_grad.)
        _fou.unstick_quiet()
        scope = _Scope(module)
        below = _saved.top()
        if _saved.owner_of(below) is not self:
            scope.ctx = _saved.owner_hooks(self, below)
            scope.ctx.__enter__()
        self._scopes.append(scope)
        try:
            for g in needs:
                self._hold(scope, g)
                self.fetch(g)
        except BaseException:
            with _signals.deferred():  # (a second Ctrl-C waits until the scope is ended: _signals)
                self._after_forward(None)  # a fetch refused: the scope ends with the forward that will not run
                raise

    def foreign_hooks_entered(self):
        """_saved_tensors: saved-tensor hooks other than ours were entered
        on this thread; tensors saved under them bypass our pack, so the
        groups the running forwards hold stay until their gradients."""
        for scope in self._scopes:
            scope.pin = True

    def _after_forward(self, output):
        if not self._scopes:
            return
        scope = self._scopes.pop()
        if scope.ctx is not None:
            scope.ctx.__exit__(None, None, None)
        escaping = self._aliased(output, scope.held) if scope.held and not scope.pin else ()
        for idx, g in scope.held.items():
            self._refs[idx] -= 1
            if scope.pin:
                self._pinned[idx] = g
            elif idx in escaping:
                if self._scopes:
                    self._hold(self._scopes[-1], g)
                else:
                    self._loose[idx] = g
            self.release(g)

    def _end_stale_scopes(self, what):
        """Where no forward of the model may run (`what`: step, zero_grad, a
        load): a scope still open is a forward running (one of its hooks,
        or another thread, called `what`: refused, INVALID, as it would pull
        the groups from under it), or one that a BaseException that is not
        an Exception ended (KeyboardInterrupt, SystemExit), for which torch
        2.1+ runs no always-called forward hook: its module's call is on no
        thread's stack any more. Those end now, innermost first, as their
        forwards' ends would have: their groups let go and their
        saved-tensor hooks exited. Before, their groups stayed fetched and
        every later step failed ("group N is fetched and not released").
        Costs nothing while no scope is open (every step of a plain loop)."""
        if not self._scopes:
            return
        running = _modules_running()
        for scope in self._scopes:
            if id(scope.module) in running:
                raise Error(INVALID, f"{what}: a forward is running (the model's {type(scope.module).__name__}); "
                            f"call {what} outside the model's forward: not from the forward itself or one of its "
                            "hooks, nor while another thread runs one")
        with _signals.deferred():  # (a Ctrl-C waits until they are ended: _signals)
            while self._scopes:
                self._after_forward(None)

    def _hold(self, scope, g):
        if g.index not in scope.held:
            scope.held[g.index] = g
            self._refs[g.index] = self._refs.get(g.index, 0) + 1

    def _aliased(self, output, held):
        """Indices of the held groups whose buffer a tensor of `output` views."""
        out = set()
        with _fou.quiet():
            for t in _fou._each_tensor(output, []):  # tensors, tuples, lists, dicts (HF's ModelOutput)
                if t.device != self.device:
                    continue
                ptr = t.data_ptr()
                for idx in held:
                    f = self._fetched.get(idx)
                    if f is not None and f[1] <= ptr < f[2]:
                        out.add(idx)
        return out

    def use(self, g, name):
        """_fetch_on_use: torch code reads a parameter of group g; the
        innermost running forward holds it, or with none, it is loose."""
        if self._scopes:
            self._hold(self._scopes[-1], g)
        else:
            self._loose[g.index] = g
        self.fetch(g)

    def fetch(self, g):
        if g.index in self._fetched:
            return
        self._overlap.before_fetch(g)
        stream = _current_stream(self.device.type)
        try:
            # (Undone by Engine.fetch if it raises; again where a second
            # Ctrl-C cuts that undo short: _signals.fetch.)
            address = _signals.fetch(self.engine, g.index, stream)
        except Error as e:
            raise self._overlap.explain(e, g, "fetched") from None
        # From here the group is fetched: anything that raises before it is
        # recorded in _fetched (a Ctrl-C delivered as a call below returns)
        # undoes the fetch, or nothing would ever release it (every later
        # step: STATE "group N is fetched and not released").
        try:
            # The same address as the last fetch (a group fetched where it lives,
            # or its copy where it was): the tensors that view it are reused.
            # Made outside inference_mode (a validation pass under it, as
            # Lightning's): views made inside are inference tensors, and the
            # parameters given them could not be saved for backward afterwards.
            with torch.inference_mode(False):
                if g.views is None or g.views[0] != address:
                    if g.flat_numel is None:
                        g.flat_numel = self.engine.group_numel(g.index)
                    flat = self.engine.as_tensor(address, g.flat_numel)
                    g.views = (address, flat, [flat[off:off + n].view(g.shapes[p])
                                               for p, off, n in zip(g.params, g.offsets, g.numels)])
                _, flat, views = g.views
                with _fou.quiet():
                    for p, v in zip(g.params, views):
                        p.data = v
                self._fetched[g.index] = (flat, address, address + flat.numel() * flat.element_size())
        except BaseException:
            with _signals.deferred():  # (a second Ctrl-C waits until the fetch is undone: _signals)
                with _fou.quiet():
                    for p in g.params:
                        p.data = g.placeholders[p]
                self._fetched.pop(g.index, None)
                self.engine._release_held(g.index, stream=stream)
                raise

    def release(self, g):
        """Releases g unless something still holds it: a running forward, a
        pin until its gradients, a use outside every forward."""
        idx = g.index
        if idx not in self._fetched or self._refs.get(idx, 0) > 0 or idx in self._pinned or idx in self._loose:
            return
        with _fou.quiet():
            for p in g.params:
                p.data = g.placeholders[p]
        # Released in the engine, then no longer recorded, whatever raises
        # between: the record went first before, and a Ctrl-C delivered at
        # the release's start left the group fetched with nothing recording
        # it (every later step: STATE "group N is fetched and not released").
        # (release_held releases again where a second Ctrl-C cuts short
        # Engine's own second try.)
        try:
            _signals.release_held(self.engine, idx, _current_stream(self.device.type))
        finally:
            del self._fetched[idx]

    def _between_passes(self):
        """Before reading or writing the engine's state outside a pass: a
        group held by a use outside every forward is let go (no forward runs;
        a backward in flight keeps its pinned groups); a write through what
        such a use handed out is refused. After close(): STATE."""
        self._check_open("a read or write of the engine's state")
        if not self._scopes:
            held = list(self._loose.values())
            self._loose.clear()
            for g in held:
                self.release(g)
        self._refuse_writes()

    # -- tensors handed out outside every forward (p.data, p.detach(), p.t(),
    # p[0]): they view the group's fetched copy, until it is released. An
    # in-place op on p itself is refused by _fetch_on_use; one on such a
    # tensor reaches no torch function of p's, but moves the version counter
    # it shares with p (p.data is p.detach() there). So each such parameter
    # is recorded with its version, and checked where the engine's state is
    # read or stepped and loose groups are let go: a write is refused then,
    # naming the parameter. Where it lands depends on placement (without a
    # GPU, in float32, on one rank the fetch hands out the masters' own
    # memory: it changed them behind the optimizer; elsewhere the copy: lost
    # at the next fetch), so silently it was wrong either way.
    def views_of(self, g, result):
        """The tensors of `result` (a tensor, or tensors in a list or
        tuple) that view group g's fetched memory: those a write could
        reach it through. Not an offloaded parameter itself (an in-place op
        on one is refused where it is called)."""
        f = self._fetched.get(g.index)
        if f is None:
            return []
        _, start, end = f
        if isinstance(result, torch.Tensor):
            result = (result,)
        out = []
        for t in result:
            if isinstance(t, torch.Tensor):
                if type(t) is not _fou._OffloadedParameter and t.device == self.device and \
                        start <= _data_ptr(t) < end:
                    out.append(t)
            elif isinstance(t, (list, tuple)):
                out.extend(self.views_of(g, t))
        return out

    def handed_out(self, p, name, views):
        """_fetch_on_use: a call outside every forward read parameter p and
        returned `views` of its group's fetched memory (p.data, p.detach(),
        p.t(), p[0]): p is watched while one of them lives."""
        h = self._handed_out.get(id(p))
        if h is None:
            h = self._handed_out[id(p)] = _HandedOut(p, name)
        for t in views:
            h.track(t)

    def _writes(self):
        """The Error for the parameters written through a tensor handed out
        since the last check (None: none); each is said once. A parameter
        whose handed-out tensors are all gone is no longer watched."""
        written = []
        for key, h in list(self._handed_out.items()):
            version = h.param._version
            if version != h.version:
                written.append(h.name)
                h.version = version
            if not h.alive():
                del self._handed_out[key]
        if not written:
            return None
        return Error(INVALID, f"{', '.join(written)}: written in place through a tensor taken from the offloaded "
                     "parameter outside a forward (p.data, p.detach(), or a view such as p.t() or p[i]); that "
                     "tensor views the engine's fetched copy of the parameter, not its master weights, so the "
                     "write was lost or changed the masters behind the optimizer, depending on placement. An "
                     "offloaded parameter changes only through the optimizer's step and load_state_dict: to "
                     "change weights (WGAN's weight clipping), change the values of state_dict() and "
                     "load_state_dict them; to clip gradients, clip_grad_norm_ or gradient_clipping")

    def _refuse_writes(self):
        if self._handed_out:
            err = self._writes()
            if err is not None:
                raise err

    def _rewatch(self, params):
        """A load wrote `params` (its copy moved their version counters)."""
        for p in params:
            h = self._handed_out.get(id(p))
            if h is not None:
                h.version = p._version

    def _drop_holds(self):
        """Backward has ended (or the step came): nothing is pinned or loose."""
        held = list(self._pinned.values()) + list(self._loose.values())
        self._pinned.clear()
        self._loose.clear()
        for g in held:
            self.release(g)

    # -- saved tensors (_saved_tensors.owner_hooks): a view of a fetched
    # group is saved as (group, place); any other tensor goes to the hooks
    # below ours, or to keep.
    def place(self, t):
        """t's place in a fetched group (a _SavedView), or None."""
        if self._fetched and t.device == self.device:
            with _fou.quiet():
                ptr = t.data_ptr()
            for index, (flat, start, end) in self._fetched.items():
                if start <= ptr < end and t.dtype == flat.dtype:
                    return _SavedView(index, (ptr - start) // flat.element_size(), tuple(t.shape), t.stride())
        return None

    def keep(self, t):
        """A saved tensor with no hooks below ours: to the activation store
        (offload_activations), or kept as it is."""
        if self.activation_threshold is not None and t.device == self.device and \
                _acts.should_stash(t, self.activation_threshold):
            return _acts.stash(self.engine, t)
        return t

    def unpack(self, saved):
        if isinstance(saved, _acts._Stashed):
            return _acts.unstash(saved)
        if not isinstance(saved, _SavedView):
            return saved
        if self.engine is None:
            raise Error(STATE, "backward needs an offloaded parameter, but its offload_module was closed")
        self._queue_end_of_backward()
        g = self._groups[saved.group]
        held = g.index in self._fetched
        self.fetch(g)  # backward: bring the group back
        flat = self._fetched[g.index][0]
        view = flat.as_strided(saved.shape, saved.stride, saved.offset)
        # A backward with create_graph=True (a gradient penalty, whose graph
        # is differentiated again) runs with grad mode on: the nodes it
        # records save what they are given as it is (no hooks of ours run
        # in a backward), and the group is released when it ends, so the
        # second backward would read a view of released memory (another
        # group's values, or NaN): they get a copy of their own. So does a
        # frozen group's op, as no gradient will say when the group is done
        # with: it goes at once.
        if torch.is_grad_enabled() or (g.frozen and not held):
            view = view.clone()
        if g.frozen and not held:
            self.release(g)
        elif not g.frozen:
            # Pinned until its gradients are in: a forward that runs inside
            # backward (checkpoint's recomputation) and holds the group too
            # must not release it when it ends.
            self._pinned[g.index] = g
        return view

    # -- backward: gradients to the engine as they are produced
    def _queue_end_of_backward(self):
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def grad_ready(self, g, p):
        """A parameter's gradient is in .grad (a tied one's summed over its
        uses; once more for each backward that reaches it, e.g. a reentrant
        checkpoint's): stage it; a group whose every gradient is in goes to
        the engine and is released."""
        if self._scaling.checked and not self._scaling.in_backward:
            self._refuse_unscaled(g, p)
            return
        self._queue_end_of_backward()
        g.stage(p)
        if g.complete():
            self._hand(g)

    def _refuse_unscaled(self, g, p):
        """fp16, and a backward from a loss that did not go through
        scale_loss reached parameter p of group g: the gradient is dropped
        (none of this backward's reach the engine), g is let go once all of
        its are, and the backward ends with the error, raised by a callback
        at its end. Raised here, inside autograd's hook, it would leave the
        graph's other nodes queued in the thread's ready queue, which torch
        frees at the thread's exit, after Python: a crash at exit."""
        p.grad = None  # the refused gradient (the next backward would add to it)
        g.refused.add(id(p))
        if len(g.refused) == len(g.params):
            g.refused.clear()
            self._pinned.pop(g.index, None)
            self.release(g)
        # One callback a refused gradient: the first raises, which ends the
        # callbacks of this backward; one that errs before its end runs none.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_refused_backward)

    def _end_refused_backward(self):
        """The end of a refused backward: lets go of what it fetched and
        raises the refusal (the callbacks queued after this one do not run)."""
        self._callback_queued = False
        for g in self._groups:
            g.refused.clear()
        self._drop_holds()
        for g in self._groups:
            self.release(g)
        raise self._scaling.refusal("backward reached the offloaded parameters from",
                                    "Call off.backward(loss) (or off.scale_loss(loss).backward(); off.optimizer "
                                    "has both)")

    def _hand(self, g):
        # The engine adds every grads call of a step to the group's
        # accumulator, so a group handed in parts (a backward that ended
        # early: a reentrant checkpoint's inner one) sums right.
        parts = g.in_parts
        if parts:  # (prepare_step came before its first gradient)
            self._overlap.counted(g)
        else:
            self._overlap.before_grads(g)
        g.handed_params |= g.arrived
        g.ever_handed = True
        self._handed.add(g.index)
        try:
            if parts:
                g.end_parts()
                self.engine.grads_end(g.index)
            else:
                self.engine.grads(g.index, g.take_staged(), stream=_current_stream(self.device.type))
        except Error as e:
            raise self._overlap.explain(e, g, "given more gradients") from None
        self._pinned.pop(g.index, None)
        self.release(g)

    def _end_of_backward(self):
        self._callback_queued = False
        self._hand_pending_and_let_go()

    def _hand_pending_and_let_go(self):
        # A group with a parameter that got no gradient (unused in this
        # forward) goes with zeros there; groups still fetched are released.
        for g in self._groups:
            if g.pending():
                self._hand(g)
        self._drop_holds()
        for g in self._groups:
            self.release(g)
        self._refuse_writes()


def _data_ptr(t):
    """t's first byte (-1: it has no storage of its own: sparse, meta)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return -1


class _HandedOut:
    """A parameter whose tensors were handed out outside every forward: its
    version when recorded (or last checked), and weak references to the
    views of its memory handed out, once each (id -> reference, dropped as
    each dies: as many as are alive; while one is, a write through it may
    still come)."""
    __slots__ = ("param", "name", "version", "refs")

    def __init__(self, p, name):
        self.param, self.name, self.version, self.refs = p, name, p._version, {}

    def track(self, t):
        key = id(t)
        r = self.refs.get(key)
        if r is not None and r() is t:
            return
        refs = self.refs

        def gone(ref, key=key, refs=refs):
            if refs.get(key) is ref:
                del refs[key]

        refs[key] = weakref.ref(t, gone)

    def alive(self):
        return bool(self.refs)


class _Scope:
    """One module forward running: its module, the groups it holds
    (index -> group), the saved-tensor hooks it entered (where ours were not
    on top), and whether its groups stay pinned after it (hooks other than
    ours were entered while it ran)."""
    __slots__ = ("module", "held", "ctx", "pin")

    def __init__(self, module):
        self.module, self.held, self.ctx, self.pin = module, {}, None, False


_CALL_CODES = frozenset(c for c in (getattr(getattr(torch.nn.Module, n, None), "__code__", None)
                                    for n in ("_call_impl", "_wrapped_call_impl")) if c is not None)


def _modules_running():
    """ids of the modules whose call (nn.Module._call_impl, where the
    forward hooks run) is on some thread's stack now."""
    import sys
    out = set()
    for top in sys._current_frames().values():
        f = top
        while f is not None:
            if f.f_code in _CALL_CODES:
                m = f.f_locals.get("self")
                if m is not None:
                    out.add(id(m))
            f = f.f_back
    return out


def _forward_hooks_always_called():
    """register_forward_hook's always_call=True where torch has it (2.1+):
    a forward that raises still ends its scope."""
    import inspect
    try:
        return {"always_call": True} if "always_call" in inspect.signature(
            torch.nn.Module.register_forward_hook).parameters else {}
    except (TypeError, ValueError):
        return {}
