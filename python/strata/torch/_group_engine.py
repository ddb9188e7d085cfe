"""OffloadAdam's group engines: one torch param group's parameters on one
engine, packed in buckets (_sizing.split_buckets), with the gradients
handed in and the new weights and states read back; and the checks and
names of the parameters OffloadAdam is given.
"""

import torch

from .. import Error, INVALID
from . import _signals, _sizing
from ._config import _current_stream, _new_engine, _remove_swap_folders, _swap_folders, _torch_dtype
from ._loss_scale import _unscale_factor

# An integer dtype as wide as a floating one: its bits, compared exactly.
_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _param_label(p, names, where=""):
    name = (names or {}).get(id(p))
    return f"parameter '{name}'" if name else f"parameter{where} of shape {tuple(p.shape)}"


def _check_params(params, names, who, earlier=()):
    """Refuses, naming the parameter, what the engine would train wrongly:
    a parameter listed twice (torch 2.x refuses it too), a float64 one
    (the engine's masters are float32: it would train in float32 without a
    word), a sparse or non-floating one."""
    seen = {id(p) for p in earlier}
    for j, p in enumerate(params):
        label = _param_label(p, names, f" {j}")
        if id(p) in seen:
            raise ValueError(f"{who}: {label} appears more than once (in a group or across groups); "
                             "give each parameter once")
        seen.add(id(p))
        if p.dtype == torch.float64:
            raise Error(INVALID, f"{who}: {label} is float64; the engine keeps float32 master weights and "
                        "would train it in float32 precision: convert the model with .float() (or keep torch's "
                        "optimizer for float64)")
        if not p.dtype.is_floating_point:
            raise Error(INVALID, f"{who}: {label} is {p.dtype}, not a floating-point parameter")
        if p.is_sparse:
            raise Error(INVALID, f"{who}: {label} is a sparse tensor; dense parameters only")


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
    """One torch param group on one engine: parameters packed in buckets of
    bucket_numel elements (_sizing.split_buckets: a parameter larger than the
    room left continues in the next bucket), one engine group per bucket."""

    def __init__(self, cfg, params, bucket_numel, force_no_gpu, rank=0, world_size=1, names=None):
        self.params = list(params)
        self.folders = _swap_folders(cfg)
        self.handed = False  # this step's gradients are in the engine (clip_grad_norm_)
        try:
            self.engine = _new_engine(cfg, rank, world_size, force_no_gpu=force_no_gpu)
        except BaseException:
            with _signals.deferred():  # (a second Ctrl-C waits until the undo is done: _signals)
                _remove_swap_folders(self.folders)
                raise
        # Anything that raises once the engine exists (a refusal, a failed
        # build, Ctrl-C) closes it and removes its folders, then propagates.
        try:
            self._register(bucket_numel, world_size, names)
        except BaseException:
            with _signals.deferred():
                self.close()
                raise

    def _register(self, bucket_numel, world_size, names):
        """The parameters into the engine's groups, built; with several
        ranks every rank starts from rank 0's values."""
        self.names = names or {}
        dtype = _torch_dtype(self.engine.compute_dtype)
        if dtype != torch.float32:
            for p in self.params:
                if p.dtype != dtype:
                    raise Error(INVALID, f"OffloadAdam: the config computes in {dtype} (bf16/fp16 enabled) but "
                                f"{_param_label(p, names)} is {p.dtype}: the parameters must be that dtype (convert "
                                "the model), or leave bf16/fp16 off (float32 masters of any parameter dtype)")
        # [(group, [(param index, first element, count, offset in the group)])]
        self.buckets = []
        for g, bucket in enumerate(_sizing.split_buckets([p.numel() for p in self.params], bucket_numel)):
            entries = []
            for k, (i, start, count) in enumerate(bucket):
                p = self.params[i]
                # The model's name (its state_dict key) where the parameters
                # came named, so that strata-export's file loads into the
                # model; a piece of a parameter cut over groups is named
                # "name[first:end]" and exported flat.
                name = (names or {}).get(id(p), f"p{g}.{k}")
                if count == p.numel():
                    off = self.engine.add_param(g, name, p.detach())
                else:
                    piece = p.detach().reshape(-1)[start:start + count]
                    off = self.engine.add_param(g, f"{name}[{start}:{start + count}]", piece)
                entries.append((i, start, count, off))
            self.buckets.append((g, entries))
        self.engine.build()
        self.device = "cuda" if self.engine.on_gpu else "cpu"
        self._remember()
        if world_size > 1:
            with torch.no_grad():
                self.copy_params_back()  # every rank starts from rank 0's values

    def _remember(self):
        """What each parameter holds now is its master (in its own dtype): a
        later write into it shows as another version (an in-place op, a
        copy_, the model's load_state_dict) or other memory (p.data = ...)."""
        self._seen = [(p._version, p.data_ptr()) for p in self.params]

    def written(self):
        """Indices of the parameters written since the engine last set them
        (their version or memory moved): a list, empty for none."""
        return [i for i, (p, seen) in enumerate(zip(self.params, self._seen))
                if p._version != seen[0] or p.data_ptr() != seen[1]]

    def take_written(self, changed):
        """The values written into parameters `changed` (indices, from
        written()) since the engine last set them become their masters
        (write_state), as torch's AdamW steps from whatever a parameter
        holds: a model's load_state_dict after the optimizer was made, an
        in-place change between steps. Before, the next step went on from
        the old masters and overwrote the new values without a word. Only
        the elements that differ from the master in the parameter's dtype
        (bit for bit) are taken: a parameter of bf16 or fp16 written with
        the values it held (p.copy_(saved) after an EMA swap, a load of the
        weights it has, nn.Embedding(max_norm) renormalising rows it leaves
        alone) keeps its float32 master, not its rounding. A write through
        p.data (p.data.copy_(...)) is not seen: .data has a version counter
        of its own."""
        changed = set(changed)
        with torch.no_grad():
            for g, entries in self.buckets:
                if not any(i in changed for i, _, _, _ in entries):
                    continue
                flat = self.engine.read_state(g, "master")
                for i, start, count, off in entries:
                    if i not in changed:
                        continue
                    p = self.params[i]
                    new = p.detach().reshape(-1)[start:start + count].to("cpu")
                    old = flat[off:off + count]
                    if p.dtype == torch.float32:
                        old.copy_(new)
                        continue
                    ints = _SAME_WIDTH_INT[p.element_size()]
                    differ = new.view(ints) != old.to(p.dtype).view(ints)
                    old.copy_(torch.where(differ, new.to(torch.float32), old))
                self.engine.write_state(g, "master", flat)
        self._remember()

    def hand_grads(self, negate=False, scale=1.0, coef=None, poison=False):
        """Hands .grad to the engine, unscaled by fp16's loss `scale` (times
        the float32 1/scale, as the engine and torch's GradScaler unscale)
        and multiplied by torch's clip coefficient `coef` (a float32 tensor;
        None: 1), in float32, as torch would over float32 masters;
        `poison`: with a NaN, so that the engine skips the step. All the
        buckets or none: one that raises part-way (Ctrl-C delivered as a
        native grads call returns, a refusal) drops those handed before it."""
        # Marked before the first grads call: a raise after it (a Ctrl-C
        # delivered as bucket 0's native call returns) left gradients in the
        # engine that nothing recorded, so zero_grad() kept them and the next
        # step added them to its own. (A discard_grads with none pending, for
        # a raise before it, changes nothing.)
        self.handed = True
        try:
            self._hand_buckets(negate, scale, coef, poison)
        except BaseException:
            with _signals.deferred():  # (a second Ctrl-C waits until they are dropped)
                self.drop_handed()
                raise

    def _hand_buckets(self, negate, scale, coef, poison):
        for g, entries in self.buckets:
            numel = self.engine.group_numel(g)
            flat = torch.zeros(numel, dtype=torch.float32, device=self.device)
            for i, start, count, off in entries:
                p = self.params[i]
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise Error(INVALID, f"OffloadAdam: {_param_label(p, self.names)} has a sparse gradient "
                                    "(e.g. nn.Embedding(sparse=True)); dense gradients only")
                    flat[off:off + count].copy_(p.grad.reshape(-1)[start:start + count])
            if scale != 1.0:
                flat.mul_(_unscale_factor(scale))
            if coef is not None:
                flat.mul_(coef.to(flat.device))
            if poison:
                flat[0] = float("nan")
            if negate:  # maximize: torch steps with -grad
                flat.neg_()
            self.engine.grads(g, flat, stream=_current_stream(self.device))
            del flat  # one bucket's at a time

    def drop_handed(self, quiet=True):
        """Drops the gradients this engine was handed for a step that did
        not come (discard_grads). True when it holds none now. An engine
        that refuses (its failed step is pending: the same step again
        finishes it, with them) keeps them; `quiet=False` raises that."""
        if self.handed:
            try:
                self.engine.discard_grads()
            except Error:
                if not quiet:
                    raise
                return False
            self.handed = False
        return True

    def copy_params_back(self):
        """The engine's new weights into the parameters. Idempotent: a copy
        that raised part-way (Ctrl-C) may be run again whole."""
        pending = {}  # param index -> flat copy of a non-contiguous parameter cut over groups
        seen = self._seen
        for g, entries in self.buckets:
            stream = _current_stream(self.device)
            # (Released where it raises, also where a second Ctrl-C cuts
            # Engine's own undo short: _signals.fetch.)
            buf = _signals.fetch(self.engine, g, stream, tensor=True)
            # Released whatever raises from here (Ctrl-C among the copies):
            # a group left fetched fails every later step ("group N is
            # fetched and not released").
            try:
                for i, start, count, off in entries:
                    p = self.params[i]
                    if count == p.numel():
                        p.copy_(buf[off:off + count].view_as(p))
                    elif p.is_contiguous():
                        p.view(-1)[start:start + count].copy_(buf[off:off + count])
                    else:
                        flat = pending.setdefault(i, torch.empty(p.numel(), dtype=p.dtype, device=p.device))
                        flat[start:start + count].copy_(buf[off:off + count])
                        if start + count == p.numel():
                            p.copy_(pending.pop(i).view(p.shape))
                    seen[i] = (p._version, p.data_ptr())  # (our copy moved it: not a write)
            finally:
                _signals.release_held(self.engine, g, stream)

    def _per_param(self, reads):
        """Per parameter, shaped like it: {key: values} from `reads(group)`,
        {key: the group's flat values}, over the pieces in every group."""
        out = [{} for _ in self.params]
        for g, entries in self.buckets:
            full = reads(g)
            for i, start, count, off in entries:
                for k, v in full.items():
                    out[i].setdefault(k, []).append(v[off:off + count])
        return [{k: torch.cat(v).view_as(p) if len(v) > 1 else v[0].view_as(p).clone() for k, v in st.items()}
                for p, st in zip(self.params, out)]

    def read_states(self):
        """Per parameter: {"master_param", "exp_avg", "exp_avg_sq"} as tensors shaped like it."""
        return self._per_param(lambda g: {k: self.engine.read_state(g, w) for k, w in
                                          (("master_param", "master"), ("exp_avg", "exp_avg"),
                                           ("exp_avg_sq", "exp_avg_sq"))})

    def write_states(self, states):
        """The inverse of read_states (a missing key keeps the engine's value)."""
        for g, entries in self.buckets:
            for key, which in (("master_param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                if not all(key in states[i] for i, _, _, _ in entries):
                    continue
                flat = self.engine.read_state(g, which)
                for i, start, count, off in entries:
                    flat[off:off + count] = states[i][key].reshape(-1)[start:start + count].to(torch.float32).cpu()
                self.engine.write_state(g, which, flat)

    def read_masters(self):
        return [st["m"] for st in self._per_param(lambda g: {"m": self.engine.read_master(g)})]

    def close(self):
        self.engine.close()
        _remove_swap_folders(self.folders)


def _check_saved_shapes(groups, state_dict, names):
    """A saved exp_avg, exp_avg_sq or master_param whose shape is not its
    parameter's is refused, naming both (torch's own load would cut or
    broadcast it, or fail only after the engines were freed)."""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    saved = state_dict.get("state") if isinstance(state_dict, dict) else None
    if not isinstance(saved_groups, list) or not isinstance(saved, dict) or len(saved_groups) != len(groups):
        return  # (torch's load_state_dict says what is wrong)
    for k, (sg, g) in enumerate(zip(saved_groups, groups)):
        ids = sg.get("params", []) if isinstance(sg, dict) else []
        if len(ids) != len(g["params"]):
            return
        for i, p in zip(ids, g["params"]):
            for key, v in (saved.get(i) or {}).items():
                if key in ("exp_avg", "exp_avg_sq", "master_param") and isinstance(v, torch.Tensor) and \
                        tuple(v.shape) != tuple(p.shape):
                    raise Error(INVALID, f"OffloadAdam.load_state_dict: param group {k}: "
                                f"{_param_label(p, names)}'s saved {key} has shape {tuple(v.shape)}, not the "
                                f"parameter's {tuple(p.shape)}")


def _nonfinite(ge):
    """The engine's strata.nonfinite policy, as it resolved it."""
    section = ge.engine.config.get("strata")
    return section.get("nonfinite", "skip") if isinstance(section, dict) else "skip"


def _overflowed(engines):
    """Whether any of these engines' parameters has a gradient that is not
    finite (this rank's): one read back per device."""
    by_device = {}
    for ge in engines:
        for p in ge.params:
            if p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(torch.isfinite(p.grad).all())
    return not all(bool(torch.stack(flags).all()) for flags in by_device.values())


def _close_all(engines):
    """Closes each _GroupEngine of `engines` (in a forked child, drops its handle only)."""
    for ge in engines:
        if ge.engine.forked:
            # A process forked from the optimizer's (a DataLoader worker):
            # the engines and their swap folders are the parent's, still
            # in use there. Only the handle is dropped (never destroyed here).
            ge.engine.close()
        else:
            ge.close()


def _step_marks(engine):
    """What tells whether `engine` stepped, read right before its step():
    its stats' step counters (finished steps, skipped ones) and the updates
    it applied. For _skipped_since, where step() raised other than with the
    engine's Error (a Ctrl-C delivered as the native call returned)."""
    steps, skipped = engine._step_counts()
    return steps, skipped, engine.steps


def _skipped_since(engine, before):
    """Whether the engine's step since _step_marks() gave `before` was
    skipped (a bool), or None where it did not step (or cannot say). The
    stats' step counter moves on every step that got as far as its
    gradients, a failed one too (left pending: IO, NOSPACE, a lost peer;
    or the engine's discard_grads, a skipped step to it): a step finished
    where it moved and either an update was applied or the skipped counter
    moved. (A refusal after the gradients were read, strata.nonfinite
    "error", reads as skipped: its gradients are dropped as a skip's.)"""
    try:
        steps, skipped, applied = _step_marks(engine)
    except Error:
        return None
    if steps == before[0] or (applied == before[2] and skipped == before[1]):
        return None
    return skipped != before[1]

