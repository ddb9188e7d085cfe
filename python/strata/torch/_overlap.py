"""The overlap policy of offload_module: when a step is overlapped with
backward (the engine's overlap_step), with which options, and when it
stops being.
"""

import warnings

from .. import Error, INVALID, STATE

class _Overlap:
    """offload_module's overlapped step (the engine's overlap_step): each
    group is updated as soon as its gradients of the step are complete,
    while backward goes on; the engine speculates (no clipping, all finite)
    and, after backward, commits, or discards and redoes the update, so the
    result is bitwise that of a step after backward.

    The engine needs the step's options (prepare_step) before the step's
    first grads call: they are taken at the first gradient handed, from the
    optimizer's param group as it is then (the options step() will pass),
    max_grad_norm as the last step had it when it did not clip. Options that
    differ at step() (a scheduler stepped between backward and step(),
    clipping that triggers) cost a redo of the update, never a wrong one.

    A group updated early that is touched again before step() (a forward
    between backward and step(), more backward passes in a step than
    grad_accumulation_steps says, a read of the state) makes the engine
    undo the step's speculative updates: exact, but that step is not
    overlapped. So the first step is not overlapped, and none is once a
    step has done the first two; where the early updates are final (no
    clipping, no fp16, strata.nonfinite "apply": the engine cannot undo
    them) such a step raises STATE saying so."""

    def __init__(self, owner, overlap_step, accumulation):
        self.owner = owner
        self.wanted = overlap_step is not False
        self.explicit = overlap_step is True
        self.accumulation = accumulation
        self.fits = False  # a step has been seen that an overlapped one would not break
        self.off = None  # why no step is overlapped any more
        self.prepared = None  # this step's prepare_step options; None: not overlapped
        self.hands = {}  # group index -> grads calls this step
        self.began = False  # a gradient of this step has reached the engine (prepare_step is behind)
        self.late = None  # a group fetched after its gradients were complete (its parameter's name)
        self.clip_unclipped = None  # clip_grad_norm_ this step: the max_grad_norm it gives a step it does not clip
        self.last = None  # the last step's options, max_grad_norm as it would have been unclipped
        self.via_optimizer = False  # the last step came from the optimizer (its param group holds the options)
        self.last_clipped = False  # the last step's max_grad_norm came from clip_grad_norm_
        self.final_unclipped = False  # (options(): the config makes unclipped early updates final)
        self.misses = 0  # consecutive overlapped steps whose lr, betas, eps or weight_decay were not foreseen
        self._config = None

    def options(self, lr=None, betas=None, eps=None, weight_decay=None, max_grad_norm=None):
        """The step's options with None as the config's value."""
        if self._config is None:
            c = self.owner.engine.config
            self._config = (c["optimizer"]["params"], float(c.get("gradient_clipping", 0.0)))
            # Without clipping, loss scaling or strata.nonfinite skip/error,
            # nothing after backward can change an early update: the engine
            # makes it final, and a step() with other options is refused.
            self.final_unclipped = (c.get("strata", {}).get("nonfinite", "skip") == "apply" and
                                    not c.get("fp16", {}).get("enabled", False))
        opt, clip = self._config
        return dict(lr=float(opt["lr"] if lr is None else lr),
                    betas=tuple(float(b) for b in (opt.get("betas", (0.9, 0.999)) if betas is None else betas)),
                    eps=float(opt["eps"] if eps is None else eps),
                    weight_decay=float(opt["weight_decay"] if weight_decay is None else weight_decay),
                    max_grad_norm=clip if max_grad_norm is None else float(max_grad_norm))

    def before_grads(self, g, count=True):
        """Before the step's gradients of group g reach the engine: at the
        step's first, prepare_step. `count`: this is the group's grads call
        (a hand in parts counts at its end: counted())."""
        first = not self.began
        self.began = True
        if count:
            self.counted(g)
        if first and self.wanted and self.fits and self.off is None and self.last is not None:
            # The options step() will get: the optimizer's param group as it
            # is now (a scheduler steps it after step()), or, stepped
            # directly, the last step's.
            opts = dict(self.last)
            if self.via_optimizer:
                group = self.owner.optimizer.param_groups[0]
                opts.update(self.options(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                         opts["max_grad_norm"]))
            if self.final_unclipped and opts["max_grad_norm"] <= 0 and (not self.explicit or self.last_clipped):
                # Final early updates: a step() with other options (a
                # clip_grad_norm_ that clips, a scheduler stepped before
                # step()) would be refused, not redone. Only when asked
                # for, and not after a step that clip_grad_norm_ set.
                return
            try:
                self.owner.engine.prepare_step(**opts)
            except Error as e:
                if e.status != INVALID:
                    raise
                return  # options step() will refuse, naming them: this step is not overlapped
            self.prepared = opts

    def counted(self, g):
        self.hands[g.index] = self.hands.get(g.index, 0) + 1

    def before_fetch(self, g):
        if not g.frozen and self.late is None and self.hands.get(g.index, 0) >= self.accumulation:
            self.late = g.names[0]

    def check_readable(self, what):
        """Between backward and step() of an overlapped step a read of the
        state of a group updated early makes the engine undo the step's
        speculative updates first (the read sees the state before the step,
        as without overlap); early updates that are final cannot be undone:
        the engine's STATE then says so."""
        del what

    def explain(self, err, g, what):
        """The engine's STATE for a group the overlapped step updated early,
        as what the user did and what to do."""
        if not (isinstance(err, Error) and err.status == STATE and self.prepared is not None and
                self.hands.get(g.index, 0) >= self.accumulation):
            return err
        self.off = self.off or f"the group of '{g.names[0]}' was {what} after its gradients were complete"
        return Error(STATE, f"offload_module: the group of parameter '{g.names[0]}' was {what} after its "
                     f"gradients of this step were complete ({self.hands[g.index]} backward pass(es), "
                     f"grad_accumulation_steps={self.accumulation}), and the overlapped step had updated it: run "
                     "forwards after step(), give offload_module the backward passes a step has "
                     "(grad_accumulation_steps=), or pass overlap_step=False. Later steps are not overlapped. "
                     f"({err.message})")

    def after_discard(self):
        """The step's gradients were dropped (zero_grad before step(), after
        a backward that completed or raised): nothing of this step is
        learnt; the next begins afresh."""
        self.prepared, self.hands, self.late, self.clip_unclipped, self.began = None, {}, None, None, False

    def after_step(self, opts, clipped):
        extra = [i for i, n in self.hands.items() if n > self.accumulation]
        if self.late is not None or extra:
            if self.off is None:
                self.off = (f"the group of '{self.late}' was fetched after its gradients were complete"
                            if self.late is not None else
                            f"a group took {self.hands[extra[0]]} gradients in a step "
                            f"(grad_accumulation_steps={self.accumulation})")
                if self.explicit:
                    warnings.warn(f"offload_module(overlap_step=True): steps are no longer overlapped: {self.off}, "
                                  "which an overlapped step cannot do (the group is updated once its gradients "
                                  "are in); give grad_accumulation_steps= the backward passes of a step, and run "
                                  "forwards after step()")
        else:
            self.fits = True
        if self.prepared is not None:
            # Options that step() changes after backward every time (a
            # scheduler stepped before step()) make every overlapped update
            # a wasted one: no more overlap. Clipping that triggers is not
            # that (the update would be redone without overlap too).
            same = all(self.prepared[k] == opts[k] for k in ("lr", "betas", "eps", "weight_decay"))
            self.misses = 0 if same else self.misses + 1
            if self.misses >= 2 and self.off is None:
                self.off = "step()'s lr, betas, eps or weight_decay differed from those at backward in 2 steps running"
                if self.explicit:
                    warnings.warn(f"offload_module(overlap_step=True): steps are no longer overlapped: {self.off} "
                                  "(step the LR scheduler after step())")
        # The next step's options as foreseen: these, and the max_grad_norm
        # this step would have had unclipped.
        self.last = dict(opts, max_grad_norm=self.clip_unclipped if clipped else opts["max_grad_norm"])
        self.last_clipped = clipped
        self.via_optimizer, self.prepared, self.hands, self.late, self.clip_unclipped = False, None, {}, None, None
        self.began = False
