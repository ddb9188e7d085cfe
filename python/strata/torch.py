"""PyTorch on Strata: an optimizer whose state lives in Strata's tiers, and
ZeRO-3-style parameter offload with module hooks.

    opt = strata.torch.OffloadAdam(model.parameters(), lr=1e-3, config={...})
    ... loss.backward(); opt.step(); opt.zero_grad()

    off = strata.torch.offload_module(model, config={...})
    ... loss = model(x).sum(); loss.backward(); off.step(lr=1e-3)
"""

import copy
import json
import os
import shutil
import warnings

import torch

from . import Engine, Error, INVALID

__all__ = ["OffloadAdam", "offload_module", "OffloadedModule"]

_DEFAULT_BUCKET_NUMEL = 1 << 24  # elements per engine group (OffloadAdam)


def _config_dict(config):
    if config is None:
        return {}
    return copy.deepcopy(json.loads(config) if isinstance(config, str) else config)


def _separate_swap_folders(cfg, tag):
    """Gives one engine its own swap subfolders: engines in one process must
    not share swap files."""
    zero = cfg.get("zero_optimization", {})
    for section in ("offload_optimizer", "offload_param"):
        sec = zero.get(section)
        if isinstance(sec, dict) and sec.get("nvme_path"):
            sec["nvme_path"] = _subfolder(sec["nvme_path"], tag)
    st = cfg.get("strata", {})
    if st.get("nvme_paths"):
        st["nvme_paths"] = [_subfolder(p, tag) for p in st["nvme_paths"]]
    return cfg


def _subfolder(path, tag):
    sub = os.path.join(path, tag)
    os.makedirs(sub, exist_ok=True)
    return sub


def _swap_folders(cfg):
    zero = cfg.get("zero_optimization", {})
    out = [zero.get(s, {}).get("nvme_path") for s in ("offload_optimizer", "offload_param")]
    return sorted({p for p in out + list(cfg.get("strata", {}).get("nvme_paths", [])) if p})


def _remove_swap_folders(folders):
    """Removes the per-engine subfolders made by _separate_swap_folders, with
    the swap files that the engine leaves in them."""
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)


def _torch_dtype(name):
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]


# ---- OffloadAdam -------------------------------------------------------------

class OffloadAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) whose fp32 master
    weights and moments live in Strata's tiers (host memory or NVMe, as the
    config says). The parameters stay ordinary tensors: step() hands each
    gradient to the engine, steps, and copies the new weights back.

    Hyperparameters are read from param_groups at every step, so LR schedulers
    work. Each param group gets its own engine (and its own swap subfolder).
    A parameter whose .grad is None steps with a zero gradient (its weight
    decay and moments still advance, unlike torch, which skips it).

    `config`: the engine's JSON config (dict or string), e.g.
    {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme",
    "nvme_path": "/mnt/nvme"}}}; the optimizer section is filled in here.
    Do not enable bf16/fp16 in it unless the parameters are that dtype.

    `params` may come named, as model.named_parameters() yields them: the
    engine then registers each under its name (its state_dict key), so that
    strata-export of the engine's checkpoint loads into the model.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, config=None,
                 bucket_numel=_DEFAULT_BUCKET_NUMEL, force_no_gpu=False):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid hyperparameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        self._config = _config_dict(config)
        params, self._param_names = _split_names(params)
        self._bucket_numel = bucket_numel
        self._force_no_gpu = force_no_gpu
        self._engines = []  # one _GroupEngine per param group, in order
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._engines.append(self._new_engine(len(self.param_groups) - 1))

    def _new_engine(self, index):
        # Engines are created here, not at the first step, so that a bad
        # config fails at construction; the initial master weights are the
        # parameters' values now.
        group = self.param_groups[index]
        cfg = _separate_swap_folders(copy.deepcopy(self._config), f"strata-{os.getpid()}-{id(self)}-{index}")
        opt = cfg.setdefault("optimizer", {})
        opt["type"] = "AdamW"
        opt.setdefault("params", {}).update(lr=group["lr"], betas=list(group["betas"]), eps=group["eps"],
                                            weight_decay=group["weight_decay"])
        return _GroupEngine(cfg, group["params"], self._bucket_numel, self._force_no_gpu, self._param_names)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        results = []
        for ge, group in zip(self._engines, self.param_groups):
            ge.hand_grads()
            norm, skipped = ge.engine.step(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                           weight_decay=group["weight_decay"])
            ge.copy_params_back()
            results.append((norm, skipped))
            for p in group["params"]:
                st = self.state[p]
                st["step"] = st.get("step", torch.tensor(0.0)) + (0 if skipped else 1)
        self.last_results = results  # (grad_norm, skipped) per param group
        return loss

    def state_dict(self):
        """torch.optim.AdamW's format, per parameter: "step", "exp_avg",
        "exp_avg_sq", and "master_param" (its fp32 master weights)."""
        for ge, group in zip(self._engines, self.param_groups):
            for p, st in zip(group["params"], ge.read_states()):
                self.state[p].update(st)
                self.state[p]["step"] = torch.tensor(float(ge.engine.steps))
        out = super().state_dict()
        # The returned dict keeps the per-parameter dicts; ours drop the copies.
        for p in list(self.state):
            self.state[p] = {"step": self.state[p]["step"]}
        return out

    def load_state_dict(self, state_dict):
        """Restores param_groups, the master weights, both moments and the
        step count, so training goes on as if it had never stopped."""
        super().load_state_dict(state_dict)
        self.close()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    master = self.state[p].get("master_param")
                    if master is not None:
                        p.copy_(master.to(p.dtype))
        self._engines = [self._new_engine(i) for i in range(len(self.param_groups))]
        for ge, group in zip(self._engines, self.param_groups):
            states = [self.state[p] for p in group["params"]]
            ge.write_states(states)
            steps = [float(st["step"]) for st in states if "step" in st]
            ge.engine.steps = int(max(steps)) if steps else 0
        for p in list(self.state):  # the engine holds them now
            self.state[p] = {"step": self.state[p].get("step", torch.tensor(0.0))}

    def close(self):
        """Frees the engines (and their swap files). step() no longer works."""
        for ge in self._engines:
            ge.close()
        self._engines = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _split_names(params):
    """`params` as torch.optim takes them, and {id(param): name} for those
    given as (name, param) pairs, as model.named_parameters() yields them."""
    names = {}

    def strip(seq):
        out = []
        for x in seq:
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
                names[id(x[1])] = x[0]
                x = x[1]
            out.append(x)
        return out

    params = list(params)
    if params and isinstance(params[0], dict):
        groups = []
        for g in params:
            ps = g["params"]
            groups.append(dict(g, params=[ps] if isinstance(ps, torch.Tensor) else strip(ps)))
        return groups, names
    return strip(params), names


class _GroupEngine:
    """One torch param group on one engine: parameters packed in buckets of up
    to bucket_numel elements, one engine group per bucket."""

    def __init__(self, cfg, params, bucket_numel, force_no_gpu, names=None):
        self.params = list(params)
        self.folders = _swap_folders(cfg)
        try:
            self.engine = Engine(cfg, force_no_gpu=force_no_gpu)
        except Error:
            _remove_swap_folders(self.folders)
            raise
        self.buckets = []  # [(group, [(param, offset)])]
        current, size = [], 0
        for p in self.params:
            if current and size + p.numel() > bucket_numel:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            self.buckets.append(current)
        layout = []
        for g, bucket in enumerate(self.buckets):
            entries = []
            for i, p in enumerate(bucket):
                # The model's name (its state_dict key) where the parameters
                # came named, so that strata-export's file loads into the model.
                name = (names or {}).get(id(p), f"p{g}.{i}")
                entries.append((p, self.engine.add_param(g, name, p.detach())))
            layout.append((g, entries))
        self.buckets = layout
        self.engine.build()
        self.device = "cuda" if self.engine.on_gpu else "cpu"

    def hand_grads(self):
        for g, entries in self.buckets:
            numel = self.engine.group_numel(g)
            flat = torch.zeros(numel, dtype=torch.float32, device=self.device)
            for p, off in entries:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise Error(INVALID, "OffloadAdam does not take sparse gradients")
                    flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
            self.engine.grads(g, flat, stream=_current_stream(self.device))

    def copy_params_back(self):
        for g, entries in self.buckets:
            stream = _current_stream(self.device)
            buf = self.engine.fetch_tensor(g, stream=stream)
            for p, off in entries:
                p.copy_(buf[off:off + p.numel()].view_as(p))
            self.engine.release(g, stream=stream)

    def read_states(self):
        """Per parameter: {"master_param", "exp_avg", "exp_avg_sq"} as tensors shaped like it."""
        out = []
        for g, entries in self.buckets:
            full = {k: self.engine.read_state(g, w) for k, w in
                    (("master_param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))}
            out += [{k: v[off:off + p.numel()].view_as(p).clone() for k, v in full.items()} for p, off in entries]
        return out

    def write_states(self, states):
        """The inverse of read_states (a missing key keeps the engine's value)."""
        i = 0
        for g, entries in self.buckets:
            group_states = states[i:i + len(entries)]
            i += len(entries)
            for key, which in (("master_param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                if not all(key in st for st in group_states):
                    continue
                flat = self.engine.read_state(g, which)
                for (p, off), st in zip(entries, group_states):
                    flat[off:off + p.numel()] = st[key].reshape(-1).to(torch.float32).cpu()
                self.engine.write_state(g, which, flat)

    def read_masters(self):
        out = []
        for g, entries in self.buckets:
            m = self.engine.read_master(g)
            out += [m[off:off + p.numel()].view_as(p).clone() for p, off in entries]
        return out

    def close(self):
        self.engine.close()
        _remove_swap_folders(self.folders)


def _current_stream(device):
    return torch.cuda.current_stream() if device == "cuda" else None


# ---- offload_module ----------------------------------------------------------

class OffloadedModule:
    """What offload_module returns: the engine that owns the parameters, and
    step() to update them. close() removes the hooks and gives the module its
    parameters back as ordinary tensors holding the master weights."""

    def __init__(self, module, config, force_no_gpu, grad_accumulation_steps):
        self.module = module
        config = _separate_swap_folders(config, f"strata-{os.getpid()}-{id(self)}")
        self._folders = _swap_folders(config)
        try:
            self.engine = Engine(config, force_no_gpu=force_no_gpu, grad_accumulation_steps=grad_accumulation_steps)
        except Error:
            _remove_swap_folders(self._folders)
            raise
        self._handles = []
        self._groups = []  # _ModuleGroup per module with direct trainable parameters
        seen = set()
        for name, m in module.named_modules():
            params = [(n, p) for n, p in m.named_parameters(recurse=False) if p.requires_grad]
            for n, p in params:
                if id(p) in seen:
                    raise Error(INVALID, f"offload_module: parameter {name}.{n} is shared with another module; "
                                "shared parameters are not supported")
                seen.add(id(p))
            if params:
                self._groups.append(_ModuleGroup(self, len(self._groups), name, m, params))
        if not self._groups:
            raise Error(INVALID, "offload_module: the module has no trainable parameters")
        self.engine.build()
        self.device = torch.device("cuda" if self.engine.on_gpu else "cpu")
        self.dtype = _torch_dtype(self.engine.compute_dtype)
        self._fetched = {}  # group index -> (flat tensor, first byte address, end address)
        self._saved_hooks = []  # saved_tensors_hooks contexts entered by forward pre-hooks
        self._callback_queued = False
        for g in self._groups:
            g.install()

    # -- forward: fetch before, release after
    def _before_forward(self, g):
        self.fetch(g)
        # While the module runs, every tensor that autograd saves passes
        # _pack, which saves a view of a fetched group (weight.t() in
        # F.linear, ...) as its place, so that backward reads the group
        # fetched again rather than a released buffer.
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._saved_hooks.append(ctx)

    def _after_forward(self, g):
        if self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        self.release(g)

    def fetch(self, g):
        if g.index in self._fetched:
            return
        flat = self.engine.fetch_tensor(g.index, stream=_current_stream(self.device.type))
        start = flat.data_ptr()
        self._fetched[g.index] = (flat, start, start + flat.numel() * flat.element_size())
        for p, off, n in zip(g.params, g.offsets, g.numels):
            p.data = flat[off:off + n].view(g.shapes[p])

    def release(self, g):
        if g.index not in self._fetched:
            return
        for p in g.params:
            p.data = g.placeholders[p]
        del self._fetched[g.index]
        self.engine.release(g.index, stream=_current_stream(self.device.type))

    # -- saved tensors: a view of a fetched group is saved as (group, place)
    def _pack(self, t):
        if self._fetched and t.device == self.device:
            ptr = t.data_ptr()
            for index, (flat, start, end) in self._fetched.items():
                if start <= ptr < end and t.dtype == flat.dtype:
                    return _SavedView(index, (ptr - start) // flat.element_size(), tuple(t.shape), t.stride())
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _SavedView):
            return saved
        g = self._groups[saved.group]
        self.fetch(g)  # backward: bring the group back; it is released when its gradients are in
        flat = self._fetched[g.index][0]
        return flat.as_strided(saved.shape, saved.stride, saved.offset)

    # -- backward: gradients to the engine as they are produced
    def grad_ready(self, g, p):
        """A parameter's gradient is complete: stage it; a group whose every
        gradient is in goes to the engine and is released."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        g.stage(p)
        if g.complete():
            self._hand(g)

    def _hand(self, g):
        self.engine.grads(g.index, g.take_staged(), stream=_current_stream(self.device.type))
        self.release(g)

    def _end_of_backward(self):
        # A group with a parameter that got no gradient (unused in this
        # forward) goes with zeros there; groups still fetched are released.
        self._callback_queued = False
        for g in self._groups:
            if g.pending():
                self._hand(g)
            self.release(g)

    # -- the optimizer
    def step(self, lr=None, betas=None, eps=None, weight_decay=None):
        """One optimizer step over every group; None takes the config's
        value. A group that got no gradient since the last step steps with
        zeros (the engine's rule). Returns (grad_norm, skipped)."""
        for g in self._groups:
            self.release(g)  # e.g. fetched by a backward that produced no gradient for it
        return self.engine.step(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def zero_grad(self, set_to_none=True):
        """Nothing to do: gradients go to the engine, never stay in .grad."""

    def master_parameters(self):
        """{qualified name: fp32 master weights} of every offloaded parameter."""
        out = {}
        for g in self._groups:
            m = self.engine.read_master(g.index)
            for name, p, off, n in zip(g.names, g.params, g.offsets, g.numels):
                out[name] = m[off:off + n].view(g.shapes[p]).clone()
        return out

    def close(self):
        """Removes the hooks; the parameters become ordinary tensors holding
        the master weights (in their original dtype); the engine is freed."""
        if self.engine is None:
            return
        masters = self.master_parameters()
        for g in self._groups:
            self.release(g)
            for name, p in zip(g.names, g.params):
                p.data = masters[name].to(dtype=g.dtypes[p], device=g.devices[p])
        for h in self._handles:
            h.remove()
        self._handles = []
        self.engine.close()
        self.engine = None
        _remove_swap_folders(self._folders)


class _SavedView:
    __slots__ = ("group", "offset", "shape", "stride")

    def __init__(self, group, offset, shape, stride):
        self.group, self.offset, self.shape, self.stride = group, offset, shape, stride


class _ModuleGroup:
    """The direct trainable parameters of one module: one engine group."""

    def __init__(self, owner, index, prefix, module, named_params):
        self.owner, self.index, self.module = owner, index, module
        self.names = [f"{prefix}.{n}" if prefix else n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = {p: p.shape for p in self.params}
        self.dtypes = {p: p.dtype for p in self.params}
        self.devices = {p: p.device for p in self.params}
        self.offsets = [owner.engine.add_param(index, n, p.detach()) for n, p in zip(self.names, self.params)]
        self.numels = [p.numel() for p in self.params]  # .data is empty while released
        self.numel = sum(self.numels)
        self.staged = None
        self.arrived = set()
        self.grad_accs = []  # AccumulateGrad nodes, kept alive so that their hooks stay

    def install(self):
        o = self.owner
        # A released parameter is one element expanded to its shape: it costs
        # nothing, and autograd's AccumulateGrad, which shapes .grad after
        # the parameter, still sees the right shape.
        one = torch.zeros(1, dtype=o.dtype, device=o.device)
        self.placeholders = {p: one.expand(self.shapes[p]) for p in self.params}
        for p in self.params:
            # The compute dtype first: changing a parameter's dtype gives it a
            # new AccumulateGrad node, which would not have our hook.
            p.data = self.placeholders[p]
            # The AccumulateGrad node of p: its hook runs once p.grad holds
            # this backward's gradient.
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda *_, p=p: o.grad_ready(self, p))
            self.grad_accs.append(acc)
        o._handles.append(self.module.register_forward_pre_hook(lambda m, inp: o._before_forward(self)))
        o._handles.append(self.module.register_forward_hook(lambda m, inp, out: o._after_forward(self)))

    def stage(self, p):
        if self.staged is None:
            self.staged = torch.zeros(self.numel, dtype=self.owner.dtype, device=self.owner.device)
        i = next(k for k, q in enumerate(self.params) if q is p)
        off = self.offsets[i]
        self.staged[off:off + self.numels[i]].copy_(p.grad.reshape(-1))
        p.grad = None
        self.arrived.add(i)

    def complete(self):
        return len(self.arrived) == len(self.params)

    def pending(self):
        return bool(self.arrived)

    def take_staged(self):
        staged, self.staged, self.arrived = self.staged, None, set()
        return staged


def offload_module(module, config, force_no_gpu=False, grad_accumulation_steps=1):
    """ZeRO-3-style offload of `module`'s trainable parameters into a Strata
    engine configured by `config` (dict or JSON string): each module's direct
    parameters form one group, fetched before its forward (and again in
    backward, when autograd needs them) and released after; gradients go to
    the engine as autograd produces them and never stay in .grad. Returns an
    OffloadedModule; call its step() after backward. The optimizer is the
    config's (AdamW by default). Shared (tied) parameters are refused.
    """
    return OffloadedModule(module, _config_dict(config), force_no_gpu, grad_accumulation_steps)
