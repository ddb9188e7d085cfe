"""OffloadAdam's state dict: torch.optim.AdamW's format out, and a load that
builds the loaded state's engines before the old ones go (a mixin of
OffloadAdam, before torch.optim.Optimizer in its bases: super() here is the
Optimizer's).
"""

import torch

from .. import Error, NOMEM, NOSPACE
from . import _signals
from ._adam_options import _check_group_options
from ._group_engine import _check_saved_shapes, _close_all
from ._loss_scale import _Scaler


class _AdamStateDict:
    def state_dict(self):
        """torch.optim.AdamW's format, per parameter that has been stepped:
        "step", "exp_avg", "exp_avg_sq", and "master_param" (its float32
        master weights; torch AdamW loads the dict and ignores it)."""
        self._check_open("state_dict")
        self._take_written("state_dict")
        for ge in self._engines:
            if ge.engine.steps == 0:
                continue  # torch has no state for a parameter before its first step
            for p, st in zip(ge.params, ge.read_states()):
                self.state[p].update(st)
                self.state[p]["step"] = torch.tensor(float(ge.engine.steps))
        out = super().state_dict()
        # The returned dict keeps the per-parameter dicts; ours drop the copies.
        for p in list(self.state):
            self.state[p] = {"step": self.state[p]["step"]}
        if self._scaler is not None:
            out["loss_scaler"] = self._scaler.state_dict()  # fp16 (torch AdamW ignores it)
        return out

    def load_state_dict(self, state_dict):
        """Restores param_groups, the master weights, both moments and the
        step count (and fp16's loss scaler), so training goes on as if it had
        never stopped. Each saved tensor must have its parameter's shape
        (checked before anything changes, naming the parameter). New engines
        are built for the loaded state before the old are closed: a load
        that fails (NOSPACE, NOMEM) leaves the optimizer as it was."""
        self._check_open("load_state_dict")
        _check_saved_shapes(self.param_groups, state_dict, self._param_names)
        scaler = None
        if self._scaler is not None and "loss_scaler" in state_dict:
            scaler = _Scaler.parse_state(state_dict["loss_scaler"])  # refused before anything changes
        for k, group in enumerate(state_dict.get("param_groups", [])):  # (e.g. torch AdamW(amsgrad=True)'s)
            _check_group_options(group, f"OffloadAdam.load_state_dict: param group {k}", defaults=self.defaults)
        old_state, old_groups = self.state, self.param_groups
        super().load_state_dict(state_dict)
        # torch casts floating-point state to its parameter's dtype: the
        # float32 masters and moments of bf16/fp16 parameters would be
        # rounded. They are taken from the given dict as they are.
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, (p for g in self.param_groups for p in g["params"])):
            for k, v in saved.get(i, {}).items():
                if k in ("master_param", "exp_avg", "exp_avg_sq") and isinstance(v, torch.Tensor):
                    self.state[p][k] = v
        # The new engines are built beside the old ones, which are closed
        # only once all the new exist: a failure building one (NOSPACE,
        # NOMEM) closes those built and leaves the optimizer as it was (its
        # engines, param_groups, state, the parameters' values and the loss
        # scale). Before, the old were closed first and such a failure lost
        # their state. The cost: both sets of engines, for that moment.
        overwritten = []  # (what _copy_masters_into_params changes: it undoes itself when it raises)
        cohorts = None
        try:
            overwritten = self._copy_masters_into_params()
            cohorts = self._build_cohorts()
        except Error as e:
            if e.status not in (NOSPACE, NOMEM) or not self._engines:
                with _signals.deferred():
                    self._undo_load(old_state, old_groups, overwritten)
                    raise
            # No room for both sets (every rank agreed: building is
            # collective): the old engines go first, the loaded state is
            # in hand; if the build still fails the optimizer is broken
            # until a load succeeds, and says so.
            self._close_engines()
            try:
                cohorts = self._build_cohorts()
            except Error as again:
                self._cohorts = [[] for _ in self.param_groups]
                self._broken = (f"load_state_dict could not build the loaded state's engines ({again.message}), "
                                "even after letting the old state go for room: the optimizer holds no state")
                raise Error(again.status, f"OffloadAdam.load_state_dict: {self._broken}; load_state_dict again "
                            "once there is room") from None
        except BaseException:
            with _signals.deferred():  # (a second Ctrl-C waits until the undo is done: _signals)
                self._undo_load(old_state, old_groups, overwritten)
                raise
        # The loaded state in place first, then the old engines closed: an
        # interrupt while one is closed left the cohorts holding closed
        # engines and the loaded ones dropped.
        old = self._engines
        self._cohorts = cohorts
        if scaler is not None:
            self._scaler.set_state(scaler)
        for p in list(self.state):  # the engine holds them now
            self.state[p] = {"step": self.state[p].get("step", torch.tensor(0.0))}
        self._broken = None  # fresh engines: nothing held
        _close_all(old)

    def _undo_load(self, old_state, old_groups, overwritten):
        """A load that failed with the old engines open: torch's
        load_state_dict gave the optimizer new state and group objects; the
        old ones, and the parameters' values, are put back."""
        self.state, self.param_groups = old_state, old_groups
        with torch.no_grad():
            for p, value in overwritten:
                p.copy_(value)

    @torch.no_grad()
    def _copy_masters_into_params(self):
        """Each parameter whose loaded state has a master (bf16/fp16 ones)
        gets its value, before the engines are built over the parameters.
        Returns [(parameter, its value before)], for a load that fails."""
        overwritten = []
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    master = self.state[p].get("master_param")
                    if master is not None:
                        overwritten.append((p, p.detach().clone()))
                        p.copy_(master.to(p.dtype))
        except BaseException:
            with _signals.deferred():
                for p, value in overwritten:
                    p.copy_(value)
                raise
        return overwritten

    def _build_cohorts(self):
        """Cohorts for the loaded state: the parameters with state, by their
        step count, one new engine each; those without (never stepped) join
        one at their first gradient. All built or, on a failure, none (those
        built are closed, their swap folders removed)."""
        built, cohorts = [], []
        try:
            for index, group in enumerate(self.param_groups):
                by_step = {}
                for p in group["params"]:
                    st = self.state.get(p, {})
                    if "exp_avg" in st or "master_param" in st:
                        by_step.setdefault(int(float(st.get("step", 0))), []).append(p)
                cohorts.append([])
                for steps, ps in sorted(by_step.items()):
                    ge = self._new_engine(index, ps)
                    built.append(ge)
                    ge.write_states([self.state[p] for p in ps])
                    ge.engine.steps = steps
                    cohorts[-1].append(ge)
        except BaseException:
            with _signals.deferred():
                for ge in built:
                    ge.close()
                raise
        return cohorts
