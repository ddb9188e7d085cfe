"""strata.torch after a review (session 37): offload_module's zero_grad
between a completed backward and step() drops that backward's gradients
and clip, as torch's does; OffloadAdam steps from the values a parameter
holds (a model's load_state_dict after the optimizer was made);
clip_grad_value_ on offloaded parameters is refused, not a silent no-op;
model.half() / .to(torch.bfloat16) that offload_module would ignore is
refused; a KeyboardInterrupt inside a forward leaves nothing held."""
import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}}


def config(**strata_keys):
    cfg = {"zero_optimization": {"stage": 3}, "optimizer": copy.deepcopy(ADAMW)}
    if strata_keys:
        cfg["strata"] = dict(strata_keys)
    return cfg


def bits(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_bits(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _two_layers():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _batches(n):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(5, 6, generator=g) * 4 for _ in range(n)]


# ---- 1. zero_grad after a completed backward, before step() --------------------

@pytest.mark.parametrize("overlap", [False, None], ids=["plain", "overlap"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("accumulation", [None, 2], ids=["one-backward", "two-backwards"])
def test_zero_grad_before_step_drops_the_skipped_batch(overlap, clip, accumulation):
    # The "skip a bad batch" loop: loss.backward(); if bad: zero_grad();
    # continue. The next step must learn from the next batch alone, and
    # without the skipped batch's clip_grad_norm_. Before, zero_grad kept
    # what a completed backward had handed the engine (and the clip): the
    # step summed both batches.
    x0, x1, x2, x3 = _batches(4)
    later = [x2] if accumulation is None else [x2, x3]

    def run(skip):
        model = _two_layers()
        off = st.offload_module(model, config(), force_no_gpu=True, overlap_step=overlap,
                                grad_accumulation_steps=accumulation)
        for _ in range(2):  # (overlap: the third step is the first overlapped one)
            for x in later:
                model(x0 + x).sum().backward()
            off.optimizer.step()
            off.optimizer.zero_grad()
        if skip:
            model(x1).sum().backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            off.optimizer.zero_grad()
        for x in later:
            model(x).sum().backward()
        off.optimizer.step()
        out = bits(model)
        steps = off.engine.steps
        off.close()
        return out, steps

    want, want_steps = run(False)
    got, got_steps = run(True)
    assert got_steps == want_steps == 3
    assert same_bits(got, want), "the step learnt from the skipped batch's gradients (or its clip)"


def test_zero_grad_before_step_says_why_when_the_early_update_is_final():
    # overlap_step without speculation (no clipping, no fp16, nonfinite
    # "apply"): the early updates of the step are final; zero_grad says so
    # (and what to do) instead of keeping the gradients without a word.
    x0, x1 = _batches(2)
    model = _two_layers()
    off = st.offload_module(model, config(nonfinite="apply"), force_no_gpu=True, overlap_step=True)
    for _ in range(2):
        model(x0).sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
    model(x1).sum().backward()
    with pytest.raises(strata.Error, match=r"zero_grad before step\(\).*cannot be dropped.*overlap_step=False"):
        off.optimizer.zero_grad()
    off.optimizer.step()  # as the error says: the step applies them
    assert off.engine.steps == 3
    off.close()


# ---- 2. OffloadAdam: values written into the parameters after construction ------

def _net():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3))


@pytest.mark.parametrize("bucket", [None, 64], ids=["whole", "cut"])
def test_offload_adam_steps_from_values_loaded_after_it_was_made(bucket):
    # opt = OffloadAdam(model.parameters()); model.load_state_dict(pretrained):
    # torch's AdamW steps from the loaded values. Before, OffloadAdam's
    # first step went back to the values it was made with (its masters),
    # and so did a write between steps (an in-place scale under no_grad).
    torch.manual_seed(5)
    pretrained = {k: torch.randn_like(v) for k, v in _net().state_dict().items()}
    x, y = torch.randn(8, 6), torch.randn(8, 3)

    def train(model, opt):
        model.load_state_dict(pretrained)  # after the optimizer was made
        for k in range(3):
            if k == 2:
                with torch.no_grad():
                    model[2].weight.mul_(0.5)  # a write between steps
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return bits(model)

    ref = _net()
    want = train(ref, oracle.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01))
    model = _net()
    opt = st.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.01, bucket_numel=bucket, force_no_gpu=True)
    got = train(model, opt)
    assert same_bits(got, want), "OffloadAdam stepped from other values than the parameters held"
    # The optimizer's own state too: its masters are the parameters (float32).
    for (p, st_) in zip(model.parameters(), opt.state_dict()["state"].values()):
        assert torch.equal(st_["master_param"], p.detach())
    opt.close()


# ---- 3. clip_grad_value_ -----------------------------------------------------------

def test_clip_grad_value_on_offloaded_parameters_is_refused():
    # The gradients are in the engine, never in .grad: torch's
    # clip_grad_value_ clipped nothing, without a word.
    model = _two_layers()
    off = st.offload_module(model, config(), force_no_gpu=True)
    model(_batches(1)[0]).sum().backward()
    with pytest.raises(strata.Error, match="clip_grad_value_.*gradient_clipping.*clip_grad_norm_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    with pytest.raises(strata.Error, match="clip_grad_value_"):
        torch.nn.utils.clip_grad.clip_grad_value_(model[2].weight, 0.1)
    off.optimizer.step()
    off.close()
    # Any other parameters are torch's, as before.
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([-2.0, 0.05, 3.0])
    torch.nn.utils.clip_grad_value_([p], 0.1)
    assert torch.equal(p.grad, torch.tensor([-0.1, 0.05, 0.1]))


# ---- 4. a dtype conversion that offload_module would ignore ----------------------

@pytest.mark.parametrize("section, convert", [
    ("bf16", lambda m: m.to(torch.bfloat16)),
    ("bf16", lambda m: m.bfloat16()),
    ("fp16", lambda m: m.half()),
], ids=["to-bfloat16", "bfloat16", "half"])
def test_converting_a_mixed_precision_model_to_the_compute_dtype_is_refused(section, convert):
    # A float32 model under a bf16/fp16 config computes in that dtype: the
    # placeholders are in it already, so the conversion looked like a no-op,
    # and state_dict, save_pretrained and close() kept float32.
    model = _two_layers()
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}, section: {"enabled": True}},
                            force_no_gpu=True)
    # A forward's own p.to(compute dtype) stays a no-op (it reads the values).
    assert model[0].weight.to(torch.float16 if section == "fp16" else torch.bfloat16) is model[0].weight
    with pytest.raises(strata.Error, match=r"0\.weight.*float32.*before offload_module"):
        convert(model)
    off.close()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # A model already in the compute dtype converts to it as before (a no-op).
    model = _two_layers().to(torch.bfloat16)
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
                            force_no_gpu=True)
    model.to(torch.bfloat16)
    off.close()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# ---- 5. KeyboardInterrupt in the middle of a forward ------------------------------

class _Armed(nn.Module):
    """A layer of its own weight (its group, held by its forward) whose
    forward raises KeyboardInterrupt (a BaseException) when armed, inside
    the forward of the model around it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6) / 3)
        self.armed = False

    def forward(self, x):
        h = x @ self.weight
        if self.armed:
            raise KeyboardInterrupt
        return h


def _interruptible():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 6), _Armed(), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("then", ["train", "load", "zero_grad"])
def test_a_keyboard_interrupt_in_a_forward_leaves_nothing_held(then):
    # torch >= 2.1's always-called forward hooks run on an Exception only:
    # a KeyboardInterrupt left the forwards' scopes open, their groups
    # fetched, and every later step() failed ("group N is fetched and not
    # released"); a load_state_dict said a forward was running.
    xs = _batches(4)

    def run(interrupt):
        model = _interruptible()
        off = st.offload_module(model, config(), force_no_gpu=True)
        for x in xs[:2]:
            model(x).sum().backward()
            off.optimizer.step()
            off.optimizer.zero_grad()
        if interrupt:
            model[1].armed = True
            with pytest.raises(KeyboardInterrupt):
                model(xs[2]).sum().backward()
            model[1].armed = False
            if then == "load":
                model.load_state_dict(model.state_dict())
            elif then == "zero_grad":
                off.optimizer.zero_grad()
        model(xs[3]).sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
        assert not any(st.is_fetched(p) for p in model.parameters())
        out = bits(model)
        off.close()
        return out

    assert same_bits(run(True), run(False))
