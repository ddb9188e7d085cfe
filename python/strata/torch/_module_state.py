"""The offloaded model's state_dict and load_state_dict: the master weights
in the offloaded parameters' places, and loaded values written to the
engine as the new masters (the moments stay).
"""

import collections

import warnings

import torch

from .. import Error, INVALID
from . import _fetch_on_use as _fou


# A load between its pre and post hooks: the load's strictness and torch's
# lists, the module it was called on, its groups, their masters before it,
# and each parameter's version once it held its master (a write moves it).
_LoadContext = collections.namedtuple(
    "_LoadContext", "strict missing unexpected error_msgs module groups masters versions")


class _ModuleStateDict:
    """OffloadedModule's model state (a mixin over OffloadedModule's
    engine, module, device, _groups, _names, _group_of, _fetched, _refs,
    _scopes, _overlap, _load_ctx and _load_strict, and _ModuleHooks'
    _between_passes, _drop_holds and _rewatch; its __init__ registers the hooks)."""

    # -- the model's state
    def master_parameters(self):
        """{qualified name: fp32 master weights} of every offloaded parameter
        (tied parameters under each of their names). A collective."""
        self._check_open("master_parameters")
        masters = self._masters_of(self._groups)
        return {name: masters[id(p)] for name, p in self._names}

    def _masters_of(self, groups):
        """{id(parameter): its fp32 master weights, a tensor of its own} of
        these groups' parameters, read in group order (a collective: every
        rank reads the same groups in the same order)."""
        self._between_passes()
        self._overlap.check_readable("master_parameters (state_dict, close)")
        masters = {}
        for g in sorted(groups, key=lambda g: g.index):
            m = self.engine.read_master(g.index)
            for p, off, n in zip(g.params, g.offsets, g.numels):
                masters[id(p)] = m[off:off + n].view(g.shapes[p]).clone()
        return masters

    def state_dict(self, *args, **kwargs):
        """The module's state_dict, with the offloaded parameters' master
        weights (in each parameter's own dtype and device) in their places."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        """The module's load_state_dict: the offloaded parameters' values
        become the master weights (the moments stay)."""
        return self.module.load_state_dict(state_dict, strict=strict)  # (_load_into)

    def _module_state_dict(self, *args, **kwargs):
        self._in_model_state_dict = True  # the root's hook reads every master, once
        try:
            with _fou.quiet():  # the hook puts the masters in the placeholders' places
                return type(self.module).state_dict(self.module, *args, **kwargs)
        finally:
            self._in_model_state_dict = False

    def _load_into(self, module, state_dict, strict=True, **kwargs):
        """`module`'s load_state_dict (the model's, or a sub-module's own:
        model.encoder.load_state_dict), which the hooks see strict or not."""
        if kwargs.get("assign"):
            raise Error(INVALID, "load_state_dict(assign=True) would replace offloaded parameters by the given "
                        "tensors; load the values (assign=False), or change the model before offload_module")
        self._load_strict = bool(strict)
        try:
            with _fou.quiet():  # torch copies the values into the parameters' real tensors (the pre hook's)
                return type(module).load_state_dict(module, state_dict, strict=strict, **kwargs)
        finally:
            self._load_strict = True
            ctx = self._load_ctx
            if ctx is not None and ctx.module is module:  # the load raised between its hooks: nothing written
                self._load_ctx = None
                with _fou.quiet():
                    self._load_commit(True, ctx.groups, ctx.masters, ctx.versions)

    def convert(self, g, p, name, dtype):
        """_fetch_on_use: Module._apply converts parameter p of group g to
        `dtype` (model.to(dtype), model.half(), HF's bf16_full_eval,
        diffusers' vae.to(device, dtype=...)): it becomes p's own dtype, in
        which state_dict, save_pretrained and close() give its master, as
        torch's conversion would make the model that dtype. The engine goes
        on with its float32 master and computes in its compute dtype, as
        before; a dtype that is neither (float64, fp16 under a bf16 config)
        is refused, naming the parameter, as offload_module refuses it."""
        if dtype == g.dtypes[p]:
            return
        if dtype not in (self.dtype, torch.float32):
            raise Error(INVALID, f"{name}: converting the model to {dtype} under offload_module, whose config "
                        f"computes in {self.dtype}: a parameter there is {self.dtype} or float32 (mixed "
                        "precision; its master weights are float32 either way). Convert the model before "
                        "offload_module (with the matching bf16/fp16 section), or after close()")
        g.dtypes[p] = dtype
        said = self._conversions_said
        if dtype not in said:
            # Said once a dtype: the conversion changes what the model gives
            # out, not how it computes (an upcast for fp32 arithmetic, e.g.
            # diffusers' upcast_vae, does not happen), and `model.to(model.dtype)`
            # is one too (a placeholder reports the compute dtype).
            said.add(dtype)
            warnings.warn(f"offload_module: the model was converted to {dtype} ({name} and others): state_dict(), "
                          f"save_pretrained and close() now give {dtype}; the forward still computes in the "
                          f"config's {self.dtype} and the master weights stay float32")

    def _dtype_device(self, p):
        g = self._group_of[id(p)]
        return g.dtypes[p], g.devices[p]

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        if self.engine is None:
            return
        self._put_masters(state_dict, [(prefix + name, p) for name, p in self._names], self._masters_of(self._groups))

    def _sub_state_dict_hook(self, module, state_dict, prefix, local_metadata):
        # A sub-module's own state_dict() (model.encoder.state_dict()): its
        # parameters' fp32 masters in their own dtype, tensors of their own,
        # as the model's state_dict gives them; not the fetched views of the
        # engine's memory (the compute dtype, changed by later steps, freed
        # by close()). Within the model's state_dict the root's hook does it.
        if self.engine is None or self._in_model_state_dict:
            return
        keyed = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)
                 if id(p) in self._group_of and prefix + n in state_dict]
        if keyed:
            self._put_masters(state_dict, keyed, self._masters_of({self._group_of[id(p)] for _, p in keyed}))

    def _put_masters(self, state_dict, keyed, masters):
        """Each (key, parameter) of `keyed` that state_dict has: its master
        (from _masters_of), in the parameter's own dtype and device."""
        for key, p in keyed:
            if key in state_dict:
                dtype, device = self._dtype_device(p)
                state_dict[key] = masters[id(p)].to(dtype=dtype, device=device)

    def _groups_under(self, module):
        """The groups of the offloaded parameters in `module` (recursively)."""
        groups = {self._group_of[id(p)] for p in module.parameters() if id(p) in self._group_of}
        return sorted(groups, key=lambda g: g.index)

    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        # The hook of the module whose load_state_dict was called (the
        # model's, or a sub-module's own) runs before any module under it
        # loads: each offloaded parameter of its groups gets a real tensor
        # holding its master weights, which torch then copies the given
        # values into; its post hook hands them to the engine, or (a refused
        # load) drops them. Within a load the other modules' hooks do nothing.
        if self.engine is None or self._load_ctx is not None:
            return
        self._end_stale_scopes("load_state_dict")  # (a running one: INVALID)
        self._drop_holds()
        for g in self._groups:
            if g.index in self._fetched or self._refs.get(g.index, 0) or g.pending():
                raise Error(INVALID, "load_state_dict: a backward is running, or its gradients wait for the step")
        groups = self._groups if module is self.module else self._groups_under(module)
        masters = self._masters_of(groups)
        versions = {}  # id(p) -> p's version once it holds its master: a load's copy moves it
        with _fou.quiet():
            for g in groups:
                for p in g.params:
                    dtype, _ = self._dtype_device(p)
                    p.data = masters[id(p)].to(dtype=dtype, device=self.device)
                    versions[id(p)] = p._version
        # torch passes strict=True to every hook; the load's own is ours.
        self._load_ctx = _LoadContext(self._load_strict, missing, unexpected, error_msgs, module, groups, masters,
                                      versions)

    def _load_post_hook(self, module, incompatible):
        ctx = self._load_ctx
        if ctx is None or ctx.module is not module:
            return
        self._load_ctx = None
        refused = bool(ctx.error_msgs) or (ctx.strict and (ctx.missing or ctx.unexpected))
        with _fou.quiet():
            self._load_commit(refused, ctx.groups, ctx.masters, ctx.versions)

    def _load_commit(self, refused, groups, masters, versions):
        try:
            if not refused:
                for g in groups:
                    flat = torch.zeros(self.engine.group_numel(g.index), dtype=torch.float32)
                    for p, off, n in zip(g.params, g.offsets, g.numels):
                        # A parameter the load did not write (missing with
                        # strict=False, or a tied one outside the module
                        # loaded) keeps its master exactly: its data holds
                        # it in its own dtype, which may have rounded it.
                        loaded = p._version != versions[id(p)]
                        flat[off:off + n] = (p.data if loaded else masters[id(p)]).reshape(-1).to(
                            device="cpu", dtype=torch.float32)
                    self.engine.write_state(g.index, "master", flat)
        finally:
            for g in groups:
                for p in g.params:
                    p.data = g.placeholders[p]
                g.rehook()  # (the data's dtype changed and back: new AccumulateGrad nodes)
                self._rewatch(g.params)  # (the load's copy moved their versions: not a write behind the engine)
