"""OffloadOptimizer, an OffloadedModule's `optimizer`: the torch.optim
face of the engine's step (LR schedulers drive its one param group) and
its state in torch's format.
"""

import torch

from .. import Error, INVALID
from ._adam_options import _check_group_options
from ._config import _TORCH2

class OffloadOptimizer(torch.optim.Optimizer):
    """The optimizer of an OffloadedModule (its `optimizer`): one param group
    whose lr, betas, eps, weight_decay (the config's at first) each step()
    uses, so torch LR schedulers drive it. zero_grad() drops the gradients
    the engine was given since the last step, as torch's drops .grad
    (OffloadedModule.zero_grad). state_dict() gives torch's format
    ({"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": ...},
    read from the engine's tiers: a collective) and load_state_dict() puts
    it back, bitwise. With Adam or AdamW the group says the engine's decay
    (torch 2.x's decoupled_weight_decay: the config's adam_w_mode); a group
    loaded or edited to say the other, with a weight_decay, is refused."""

    def __init__(self, owner, groups, opt):
        self._strata_offloaded_ok = True  # its parameters are offload_module's (see _fetch_on_use)
        self._owner = owner
        self._groups = groups  # the trainable engine groups (_ModuleGroup), in order
        group_params = [g.params for g in groups]
        self._group_params = group_params  # per trainable group, its parameters in order
        params = [p for ps in group_params for p in ps]
        betas = tuple(opt.get("betas", (0.9, 0.999)))
        defaults = dict(lr=opt["lr"], betas=betas, eps=opt["eps"], weight_decay=opt["weight_decay"])
        # The engine's decay, where torch's Adam and AdamW have one to say:
        # decoupled (AdamW, adam_w_mode true) or L2. None: neither optimizer.
        self._kind = str(owner.engine.config["optimizer"]["type"]).lower()
        self._decoupled = (self._kind == "adamw" or bool(opt.get("adam_w_mode", True))
                           if self._kind in ("adam", "adamw") else None)
        if _TORCH2 and self._decoupled is not None:
            defaults["decoupled_weight_decay"] = self._decoupled
        super().__init__(params, defaults)
        self.last_result = None

    def __deepcopy__(self, memo):
        return self._owner.__deepcopy__(memo)  # refused, saying what to do

    def add_param_group(self, param_group):
        if self.param_groups:
            raise Error(INVALID, "OffloadOptimizer has one param group: the engine steps every parameter with the "
                        "same options (per-group options need one offload_module per group)")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        self._owner._check_open("optimizer.step")
        loss = _closure_loss(closure)
        g = self.param_groups[0]
        _check_group_options(g, "OffloadOptimizer.step: the param group", self._decoupled, self._kind)  # (as edited)
        self.last_result = self._owner.step(lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                            weight_decay=g["weight_decay"])
        self._owner._overlap.via_optimizer = True  # the next step's options: the group's (after a scheduler)
        return loss

    def zero_grad(self, set_to_none=None):
        """See OffloadedModule.zero_grad: gradients are in the engine; the
        call drops those given since the last step and says what torch
        would keep in .grad."""
        self._owner.zero_grad(set_to_none)

    @property
    def loss_scale(self):
        """OffloadedModule.loss_scale: the scale for the next loss (fp16)."""
        return self._owner.loss_scale

    def scale_loss(self, loss):
        """OffloadedModule.scale_loss."""
        return self._owner.scale_loss(loss)

    def backward(self, loss, **kwargs):
        """OffloadedModule.backward: scale_loss(loss).backward(**kwargs)."""
        self._owner.backward(loss, **kwargs)

    def state_dict(self):
        owner = self._owner
        owner._check_open("optimizer.state_dict")
        owner._between_passes()
        owner._overlap.check_readable("optimizer.state_dict")
        state, i = {}, 0
        for g in self._groups:
            gi = g.index
            steps = torch.tensor(float(owner.engine.group_steps(gi)))
            if float(steps) == 0:
                i += len(g.params)  # torch has no state for a parameter before its first step
                continue
            full = {k: owner.engine.read_state(gi, w) for k, w in (("exp_avg", "exp_avg"),
                                                                   ("exp_avg_sq", "exp_avg_sq"))}
            for p, off, n in zip(g.params, g.offsets, g.numels):
                st = {"step": steps.clone()}
                for k, v in full.items():
                    st[k] = v[off:off + n].view(g.shapes[p]).clone()
                state[i] = st
                i += 1
        groups = [{k: v for k, v in self.param_groups[0].items() if k != "params"}]
        groups[0]["params"] = list(range(i))
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        owner = self._owner
        owner._check_open("optimizer.load_state_dict")
        owner._between_passes()
        groups = state_dict.get("param_groups")
        n = sum(len(ps) for ps in self._group_params)
        if not isinstance(groups, list) or len(groups) != 1 or len(groups[0].get("params", ())) != n:
            raise Error(INVALID, f"load_state_dict: expected one param group of {n} parameters, got "
                        f"{[len(g.get('params', ())) for g in groups] if isinstance(groups, list) else groups!r}")
        saved = state_dict["state"]
        order = groups[0]["params"]
        # Check everything before changing anything: options the step would
        # not honour (a torch AdamW's amsgrad or maximize), each tensor's
        # shape, and each group's state whole or absent (one step count and
        # one set of moments per group, where torch keeps them per parameter).
        _check_group_options(groups[0], "OffloadOptimizer.load_state_dict: the param group", self._decoupled,
                             self._kind)
        if groups[0].get("maximize"):
            raise Error(INVALID, "OffloadOptimizer.load_state_dict: the param group has maximize=True, which "
                        "offload_module's step does not do; leave it off")
        i = 0
        for params in self._group_params:
            ids = order[i:i + len(params)]
            i += len(params)
            has = [bool(saved.get(pi)) for pi in ids]
            if any(has) and not all(has):
                raise Error(INVALID, f"load_state_dict: parameters {[j for j, h in zip(ids, has) if h]} have "
                            f"state and {[j for j, h in zip(ids, has) if not h]} none, in one engine group (one "
                            "module's parameters, stepped together): give all of them state, or none")
            for pi in ids:
                missing = [k for k in ("exp_avg", "exp_avg_sq") if saved.get(pi) and k not in saved[pi]]
                if missing:
                    raise Error(INVALID, f"load_state_dict: parameter {pi}'s state has no {' or '.join(missing)}")
        for k in ("exp_avg", "exp_avg_sq"):
            for j, (pi, p) in enumerate(zip(order, (p for ps in self._group_params for p in ps))):
                st = saved.get(pi, {})
                if k in st and tuple(st[k].shape) != tuple(p.shape):
                    raise Error(INVALID, f"load_state_dict: parameter {j}'s {k} has shape {tuple(st[k].shape)}, "
                                f"not {tuple(p.shape)}")
        i = 0
        for g, params in zip(self._groups, self._group_params):
            gi = g.index
            for k in ("exp_avg", "exp_avg_sq"):
                ids = order[i:i + len(params)]
                flat = owner.engine.read_state(gi, k)
                if not any(saved.get(pi) for pi in ids):
                    flat.zero_()  # no state: as torch starts a parameter's, from zero moments (and step 0)
                else:
                    for pi, p, off, cnt in zip(ids, g.params, g.offsets, g.numels):
                        flat[off:off + cnt] = saved[pi][k].reshape(-1).to(device="cpu", dtype=torch.float32)
                owner.engine.write_state(gi, k, flat)
            i += len(params)
        steps = [float(st["step"]) for st in saved.values() if "step" in st]
        if steps:
            owner.engine.steps = int(max(steps))
        i = 0
        for g, params in zip(self._groups, self._group_params):  # each group's own count (torch's per-parameter step)
            ids = order[i:i + len(params)]
            i += len(params)
            gs = [float(saved[pi]["step"]) for pi in ids if "step" in saved.get(pi, {})]
            owner.engine.set_group_steps(g.index, int(max(gs)) if gs else 0)
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        self.param_groups[0].update(hyper)


def _closure_loss(closure):
    """torch.optim's step(closure): the closure's loss, computed with
    gradients on (step runs under no_grad); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
