"""The public functions: offload_module and is_fetched."""

from .. import Error, INVALID
from . import _fetch_on_use as _fou
from ._config import (_accumulation_steps, _config_dict, _refuse_auto_lr, _resolve_ranks, _with_state_format,
                      _with_torch_moment)
from ._offloaded_module import OffloadedModule


def is_fetched(p):
    """Whether a parameter under offload_module holds its values now (its
    group is fetched) rather than its one-element placeholder. Reads
    nothing, fetches nothing. A parameter not under offload_module: True."""
    ent = _fou._OFFLOADED.get(id(p))
    if ent is None or ent[0]() is not p:
        return True
    return ent[2].index in ent[1]._fetched


def offload_module(module, config, force_no_gpu=False, grad_accumulation_steps=None, *, rank=None, world_size=None,
                   state_format=None, overlap_step=None, loss_scaled=False):
    """ZeRO-3-style offload of `module`'s trainable parameters into a Strata
    engine configured by `config` (dict or JSON string): each module's direct
    parameters form one group, fetched before its forward (and again in
    backward, when autograd needs them) and released after; gradients go to
    the engine as autograd produces them and never stay in .grad. Returns an
    OffloadedModule; step with its `optimizer` (or its step()) after
    backward. The optimizer is the config's (AdamW by default).

    Tied parameters (a GPT's embedding and head) keep one master, in the
    first module that has them, and their gradients are summed over the
    uses. With several ranks (rank=/world_size=, torch.distributed or the
    launcher's variables) each rank runs its own batch; gradients are
    averaged over the ranks and the grad_accumulation_steps backward passes
    of a step (strata.grad_reduce "mean"), as torch DDP with a loss divided
    by the accumulation steps. grad_accumulation_steps None (the default)
    takes the config's count, as deepspeed.initialize does:
    gradient_accumulation_steps, else train_batch_size over
    train_micro_batch_size_per_gpu x ranks, else 1; given, it must agree.

    `state_format`: "compact" keeps the optimizer state in about 5 bytes a
    parameter instead of 12 (strata.state_format; needs bf16 in the config);
    None keeps the config's (fp32 by default).

    `overlap_step`: None (the default) or True updates each group while
    backward goes on, as soon as its gradients of the step are complete
    (the last micro-batch's backward with grad_accumulation_steps), so that
    step() has little left to do; the result is bitwise that of False,
    which updates every group in step(). The engine speculates that the
    step is not clipped and its gradients are finite: after backward it
    redoes the update when clipping applies (clip_grad_norm_, the config's
    gradient_clipping) or step() gets other options (a scheduler stepped
    between backward and step()), which costs one more update of the
    groups, and drops it when the step is skipped (an fp16 overflow, a
    NaN). The first step is not overlapped, nor any after a step that
    fetched a group again after its gradients were complete (a forward
    between backward and step()) or handed a group more gradients than
    grad_accumulation_steps says (several backward passes summed into one
    step): an overlapped step cannot do that (docs/pytorch.md). True warns
    when that turns it off. The engine's stats() count what it did
    (speculated_steps, committed_steps, replayed_steps, discarded_steps,
    early_updates, exposed_step_s).

    fp16 (the config's fp16.enabled): the engine divides each step's
    gradients by its loss scale (DeepSpeed's semantics), so the loss must be
    scaled: `off.backward(loss)` (DeepSpeed's engine.backward), or
    `off.scale_loss(loss).backward()` (loss.float() * off.loss_scale, as
    torch's GradScaler.scale; off.optimizer has both too). A backward that
    reaches the offloaded parameters from an unscaled loss raises INVALID
    (nothing of it reaches the engine), unless `loss_scaled=True` says the
    code multiplies each loss by `off.loss_scale` itself. The engine skips a
    step whose gradients overflowed and lowers the scale; `off.loss_scale`
    is the scale for the next loss at any time. clip_grad_norm_ clips the
    unscaled gradients (on one rank, one backward a step, torch's
    arithmetic over gradient.float() / loss_scale).
    """
    _refuse_offloaded_twice(module)
    config = _config_dict(config)
    _refuse_auto_lr(config, "offload_module")
    _, world = _resolve_ranks(rank, world_size, "offload_module")  # (OffloadedModule resolves them alike)
    accumulation = _accumulation_steps(config, grad_accumulation_steps, world, "offload_module")
    config.pop("gradient_accumulation_steps", None)  # taken here: the engine would call it "left to the trainer"
    return OffloadedModule(module, _with_torch_moment(_with_state_format(config, state_format)), force_no_gpu,
                           accumulation, rank, world_size, overlap_step, loss_scaled)


def _refuse_offloaded_twice(module):
    """Refuses a module with a parameter under offload_module already (the
    model again, a part of it, or a whole around an offloaded part): a
    second engine would take over the first one's parameters, and the
    first backward would fail inside strata."""
    for name, p in module.named_parameters():
        ent = _fou._OFFLOADED.get(id(p))
        if ent is not None and ent[0]() is p:
            first = ent[1].module
            if first is module:
                whose = "its own"
            elif any(m is module for m in first.modules()):
                whose = f"that of the {type(first).__name__} it is part of"
            else:
                whose = f"that of the {type(first).__name__} inside it"
            raise Error(INVALID, f"offload_module: this {type(module).__name__} is under offload_module already (its "
                        f"parameter '{name}' is in an engine: {whose}). Offload a model once and keep its "
                        "OffloadedModule, or close() that one first")
