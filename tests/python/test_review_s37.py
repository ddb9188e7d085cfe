"""strata.torch after a review (session 37): offload_module's zero_grad
between a completed backward and step() drops that backward's gradients
and clip, as torch's does; OffloadAdam steps from the values a parameter
holds (a model's load_state_dict after the optimizer was made), taking
only the elements that changed (a bf16 parameter rewritten with its own
values keeps its float32 master), decided together by every rank;
clip_grad_value_ on offloaded parameters is refused, not a silent no-op;
model.half() / .to(torch.bfloat16) makes an offloaded model that dtype (its
state_dict and close()), a dtype the engine does not compute in is
refused; a KeyboardInterrupt inside a forward leaves nothing held, and a
load_state_dict, step or zero_grad while a forward runs is refused.
Run as a script, it is one rank of the two-rank test."""
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

from test_module_review import ADAMW, bits, config, same_bits  # noqa: E402,F401  (the same helpers)
from two_ranks import run_two_ranks  # noqa: E402


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


def _masters(opt):
    return [v["master_param"].clone() for v in opt.state_dict()["state"].values()]


@pytest.mark.parametrize("compute", ["f32", "bf16"])
@pytest.mark.parametrize("how", ["copy_", "load_state_dict", "data", "renorm"])
def test_offload_adam_bf16_a_write_of_the_same_values_keeps_the_float32_master(how, compute):
    # bf16 parameters, float32 masters: a write that moves a parameter's
    # version (or memory) but not its values (an EMA swap copying the
    # weights back, a load of the weights it holds, nn.Embedding(max_norm)
    # renormalising rows it leaves alone) keeps the masters bitwise, and the
    # training is the one without the write. Before: every such parameter's
    # master became its bf16 rounding.
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(4))

    def run(write):
        model = _net().to(torch.bfloat16)
        opt = st.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.01, force_no_gpu=True,
                             config={"bf16": {"enabled": True}} if compute == "bf16" else None)
        for k in range(4):
            if k == 2 and write:
                before = _masters(opt)
                assert any(not torch.equal(m, m.bfloat16().float()) for m in before)  # (so that this can fail)
                saved = [p.detach().clone() for p in model.parameters()]
                with torch.no_grad():
                    if how == "copy_":
                        for p, v in zip(model.parameters(), saved):
                            p.copy_(v)
                    elif how == "load_state_dict":
                        model.load_state_dict(model.state_dict())
                    elif how == "data":
                        for p, v in zip(model.parameters(), saved):
                            p.data = v
                    else:  # what nn.Embedding(max_norm=...) does: embedding_renorm_ on rows within the norm
                        w = model[0].weight
                        torch.embedding_renorm_(w, torch.tensor([0, 1]), 1e6, 2.0)
                assert any(p._version != v._version or p.data_ptr() != v.data_ptr()
                           for p, v in zip(model.parameters(), saved))
                after = _masters(opt)
                assert all(torch.equal(a, b) for a, b in zip(before, after)), "a master dropped to bf16"
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
        out = bits(model), _masters(opt)
        opt.close()
        return out

    (want, want_m), (got, got_m) = run(False), run(True)
    assert same_bits(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_m, want_m))


def test_offload_adam_bf16_a_changed_element_is_taken_the_others_keep_their_master():
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    model = _net().to(torch.bfloat16)
    opt = st.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.01, force_no_gpu=True)
    for _ in range(2):
        opt.zero_grad()
        model(x.bfloat16()).float().square().mean().backward()
        opt.step()
    before = _masters(opt)
    with torch.no_grad():
        model[0].weight[1, 2] = 3.0
        model[2].bias.data = model[2].bias.detach().clone()  # new memory, the same values
        model[2].bias.data[0] = -5.0
    after = _masters(opt)
    want = before[0].clone()
    want[1, 2] = 3.0
    assert torch.equal(after[0], want)
    want = before[3].clone()
    want[0] = -5.0
    assert torch.equal(after[3], want)
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
    opt.close()


def test_offload_adam_state_dict_takes_a_write_after_the_last_step():
    # A write after the last step (a model.load_state_dict of other weights,
    # then saving the optimizer): state_dict()'s masters are those values,
    # as the next step would start from them. (The loaded test above ends
    # on a step, whose copy back makes the masters the parameters anyway.)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    model = _net()
    opt = st.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.01, force_no_gpu=True)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    got = opt.state_dict()["state"]
    for (i, p) in enumerate(model.parameters()):
        assert torch.equal(got[i]["master_param"], p.detach()), i
    opt.close()


def test_offload_adam_writes_around_clip_grad_norm_are_taken():
    # One rank: a write before clip_grad_norm_ and one between it and the
    # step are both what the step starts from, as with torch's AdamW.
    torch.manual_seed(5)
    x, y = torch.randn(8, 6), torch.randn(8, 3)

    def train(model, opt):
        for k in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                if k == 1:
                    model[0].weight.mul_(0.5)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with torch.no_grad():
                if k == 2:
                    model[2].bias.add_(1.0)
            opt.step()
        return bits(model)

    ref = _net()
    want = train(ref, oracle.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01))
    model = _net()
    opt = st.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.01, force_no_gpu=True)
    assert same_bits(train(model, opt), want)
    opt.close()


def _two_rank_worker(out):
    """One of test_offload_adam_on_two_ranks_decides_writes_together's
    ranks (run as a script, the launcher's variables set)."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(5)
    pretrained = {k: torch.randn_like(v) for k, v in _net().state_dict().items()}
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    cfg = {"zero_optimization": {"stage": 1}}
    res = {}

    def make(model):
        return st.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.01, force_no_gpu=True, config=cfg)

    def backward(model):
        torch.nn.functional.mse_loss(model(x), y).backward()

    def attempt(key, call):
        try:
            call()
            res[key] = None
        except strata.Error as e:
            res[key] = (e.status, e.message)

    # Loaded on every rank after the optimizer was made, before
    # clip_grad_norm_ (which hands the gradients: the step cannot take
    # values after it): as if the optimizer had been made after the load.
    for made_after in (False, True):
        model = _net()
        if made_after:
            model.load_state_dict(pretrained)
        opt = make(model)
        for k in range(2):
            if k == 0 and not made_after:
                model.load_state_dict(pretrained)
            opt.zero_grad()
            backward(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        res[f"clip-made-after-{made_after}"] = (bits(model), _masters(opt))
        opt.close()
    # Written on rank 0 alone: refused on both ranks (before: rank 0 read and
    # wrote the masters, collectives rank 1 never joined); written on both
    # then, taken.
    for where in ("step", "clip_grad_norm_"):
        model = _net()
        opt = make(model)
        opt.zero_grad()
        backward(model)
        if rank == 0:
            model.load_state_dict(pretrained)
        attempt(where, opt.step if where == "step" else
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        if rank == 1:
            model.load_state_dict(pretrained)
        opt.step()
        res[f"{where}-then"] = (bits(model), _masters(opt))
        opt.close()
    torch.save(res, out)


def test_offload_adam_on_two_ranks_decides_writes_together(tmp_path):
    run_two_ranks(lambda r: [sys.executable, os.path.abspath(__file__), str(tmp_path / f"rank{r}.pt")], 240)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in range(2):
        (b0, m0), (b1, m1) = got[r]["clip-made-after-False"], got[r]["clip-made-after-True"]
        assert same_bits(b0, b1), f"rank {r}: the load before clip_grad_norm_ was not what the step started from"
        assert all(torch.equal(a, b) for a, b in zip(m0, m1))
        for where in ("step", "clip_grad_norm_"):
            status, message = got[r][where]
            assert status == strata.INVALID and "written on 1 of 2 ranks" in message, message
            assert same_bits(got[r][f"{where}-then"][0], got[0][f"{where}-then"][0])


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


# ---- 4. a dtype conversion of the model under offload_module ---------------------

@pytest.mark.parametrize("section, convert", [
    ("bf16", lambda m: m.to(torch.bfloat16)),
    ("bf16", lambda m: m.to(dtype=torch.bfloat16)),  # HF Trainer's bf16_full_eval
    ("bf16", lambda m: m.to("cpu", dtype=torch.bfloat16)),  # diffusers' vae.to(device, dtype=weight_dtype)
    ("bf16", lambda m: m.to(next(m.parameters()).dtype)),  # HF's model.to(model.dtype): the placeholder's
    ("bf16", lambda m: m.bfloat16()),
    ("fp16", lambda m: m.half()),
], ids=["to-bfloat16", "to-dtype", "to-device-dtype", "to-model-dtype", "bfloat16", "half"])
def test_converting_a_mixed_precision_model_to_the_compute_dtype_makes_it_that_dtype(section, convert):
    # A float32 model under a bf16/fp16 config computes in that dtype; the
    # conversion makes its parameters that dtype, as torch's would:
    # state_dict (save_pretrained) and close() give the masters in it, and
    # training goes on from the float32 masters. Before: refused, which
    # broke HF's evaluate (bf16_full_eval) and diffusers' to(device, dtype).
    dtype = torch.float16 if section == "fp16" else torch.bfloat16
    try:
        torch.nn.functional.linear(torch.ones(1, 1, dtype=dtype), torch.ones(1, 1, dtype=dtype))
    except RuntimeError:
        pytest.skip(f"torch {torch.__version__}: no {dtype} matmul on the CPU")
    model = _two_layers()
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}, section: {"enabled": True},
                                    "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
    x = _batches(1)[0].to(dtype)
    off.backward(model(x).float().sum())
    off.optimizer.step()
    off.optimizer.zero_grad()
    # A forward's own p.to(compute dtype) stays a no-op (it reads no values).
    assert model[0].weight.to(dtype) is model[0].weight
    # Said once: the model gives out that dtype now; it computes as before.
    with pytest.warns(UserWarning, match=r"converted to torch\.(bfloat16|float16).*still computes in"):
        assert convert(model) is model
    assert not any(st.is_fetched(p) for p in model.parameters()), "the conversion fetched (read values)"
    masters = off.master_parameters()
    sd = off.state_dict()
    for k, m in masters.items():
        assert sd[k].dtype == dtype, (k, sd[k].dtype)
        assert torch.equal(sd[k], m.to(dtype)), k
    # Training goes on from the float32 masters, untouched by the conversion.
    off.backward(model(x).float().sum())
    off.optimizer.step()
    # Back to float32: the masters as they are (torch would have rounded them).
    model.float()
    masters = off.master_parameters()
    sd = off.state_dict()
    assert all(sd[k].dtype == torch.float32 and torch.equal(sd[k], m) for k, m in masters.items())
    convert(model)
    off.close()
    assert all(p.dtype == dtype for p in model.parameters())
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), masters[k].to(dtype)), k


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.double(), lambda m: m.to(torch.float16)],
                         ids=["half", "double", "to-float16"])
def test_converting_to_a_dtype_the_engine_does_not_compute_in_is_refused(convert):
    # fp16 under a bf16 config, float64: refused, naming the parameter and
    # the dtypes, as offload_module refuses such a model; nothing changes.
    model = _two_layers()
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
                            force_no_gpu=True)
    with pytest.raises(strata.Error, match=r"0\.weight: converting the model to torch\.float(16|64).*computes in "
                       r"torch\.bfloat16.*before offload_module") as e:
        convert(model)
    assert e.value.status == strata.INVALID
    assert all(v.dtype == torch.float32 for v in off.state_dict().values())
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


# ---- 6. a forward running: load_state_dict, step, zero_grad refuse --------------

def test_load_state_dict_from_inside_a_forward_is_refused_not_a_teardown():
    # A load (or step) from a forward hook, while the model's forward runs:
    # refused, as before the KeyboardInterrupt fix, which ended the running
    # forward's scopes (its groups released under it) and went on.
    xs = _batches(2)

    def run(hooked):
        model = _interruptible()
        off = st.offload_module(model, config(), force_no_gpu=True)
        sd = model.state_dict()
        said = []

        def hook(mod, inp, out):
            for what, call in (("load_state_dict", lambda: model.load_state_dict(sd)),
                               ("step", off.optimizer.step), ("zero_grad", off.optimizer.zero_grad)):
                try:
                    call()
                except strata.Error as e:
                    said.append((e.status, e.message))
                else:
                    said.append(None)
            return out

        h = model[1].register_forward_hook(hook) if hooked else None
        for x in xs:
            model(x).sum().backward()
            off.optimizer.step()
            off.optimizer.zero_grad()
        if h is not None:
            h.remove()
        assert not any(st.is_fetched(p) for p in model.parameters())
        out = bits(model)
        off.close()
        return out, said

    want, _ = run(False)
    got, said = run(True)
    assert len(said) == 6 and all(s is not None and s[0] == strata.INVALID and "a forward is running" in s[1]
                                  for s in said), said
    assert same_bits(got, want)


def test_a_load_while_another_thread_runs_a_forward_is_refused():
    import threading
    inside, go = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def forward(self, x):
            inside.set()
            assert go.wait(60)
            return x

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 6), Waits(), nn.Linear(6, 3))
    off = st.offload_module(model, config(), force_no_gpu=True)
    sd = model.state_dict()
    outs = []
    t = threading.Thread(target=lambda: outs.append(model(_batches(1)[0])))
    t.start()
    try:
        assert inside.wait(60)
        with pytest.raises(strata.Error, match="load_state_dict: a forward is running"):
            model.load_state_dict(sd)
        with pytest.raises(strata.Error, match="zero_grad: a forward is running"):
            off.optimizer.zero_grad()
    finally:
        go.set()
        t.join(60)
    outs[0].sum().backward()
    off.optimizer.step()
    model.load_state_dict(sd)
    off.close()


if __name__ == "__main__":
    _two_rank_worker(sys.argv[1])
