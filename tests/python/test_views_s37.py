"""Tensors that view memory Strata owns (session 37 review): a double
backward (create_graph=True, a gradient penalty) under offload_module reads
its own copies of the parameters, not a group released after the first
backward; strata.Engine's fetch_tensor / as_tensor / grads_view keep their
engine alive; a write through p.data, p.detach() or a view of an offloaded
parameter taken outside a forward is refused, naming the parameter, where
before it silently changed the masters or was silently lost."""
import copy
import gc
import os
import sys
import weakref

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402

LR, WD, TOL = 1e-2, 0.01, 5e-6
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.999], "eps": 1e-8}}


def config(budget=None, bf16=False):
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}},
           "optimizer": copy.deepcopy(ADAMW)}
    if budget is not None:
        cfg["strata"] = {"device_budget": budget}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---- 1. double backward (create_graph=True) ---------------------------------

def critic():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def penalized_loss(model, x, how):
    """A critic's loss with a gradient penalty (WGAN-GP): its second
    backward runs through the graph the first one built."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    if how == "autograd.grad":
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    else:  # backward(create_graph=True), then the input's gradient
        out.sum().backward(create_graph=True, inputs=[x])
        g = x.grad
    return out.mean() + 10 * g.square().mean()


@pytest.mark.parametrize("how", ["autograd.grad", "backward"])
def test_gradient_penalty_double_backward_follows_torch(monkeypatch, how):
    """The strict device tier (new and freed blocks NaN, a released copy
    evicted at once): the first backward's graph kept views of the groups it
    fetched, released when it ended; the second backward read NaN (before:
    every step skipped as non-finite, the masters never moved)."""
    if how == "backward" and "inputs" not in torch.Tensor.backward.__code__.co_varnames:
        pytest.skip(f"torch {torch.__version__}: backward() takes no inputs=")
    monkeypatch.setenv("STRATA_STRICT_DEVICE", "1")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref = critic()
    model = critic()
    off = st.offload_module(model, config(budget=4 * 8192), force_no_gpu=True)
    for m, o in ((ref, oracle.AdamW(ref.parameters(), lr=LR, weight_decay=WD)), (model, off.optimizer)):
        for _ in range(3):
            penalized_loss(m, x, how).backward()
            o.step()
            o.zero_grad()
            if o is off.optimizer:
                assert not o.last_result[1], "a step was skipped (non-finite gradients)"
    got = off.state_dict()
    for k, v in ref.state_dict().items():
        assert rel(got[k], v) <= TOL, (k, rel(got[k], v))
    assert not any(st.is_fetched(p) for p in model.parameters())
    off.close()


# ---- 2. strata.Engine's views keep the engine alive --------------------------

@pytest.mark.parametrize("which", ["fetch_tensor", "as_tensor", "grads_view"])
def test_engine_views_keep_their_engine_alive(which):
    """A tensor returned from a function whose engine went out of scope:
    before, the engine's __del__ freed the memory it views (the weakref
    died while the tensor lived)."""
    engines = []
    values = torch.arange(8, dtype=torch.float32)

    def make():
        e = strata.Engine({"optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True, world_size=1)
        engines.append(weakref.ref(e))
        e.add_param(0, "w", values)
        e.build()
        if which == "fetch_tensor":
            return e.fetch_tensor(0)
        if which == "as_tensor":
            return e.as_tensor(e.fetch(0), e.group_numel(0))
        if not e.takes_grad_parts(0, e.compute_dtype):  # (the strict device tier: "device" memory)
            return None
        e.grads(0, 2 * values)
        return e.grads_view(0)

    t = make()
    if t is None:
        pytest.skip("grads_view: this engine's accumulator is in device memory (STRATA_STRICT_DEVICE=1)")
    gc.collect()
    assert engines[0]() is not None, f"{which}'s tensor lives, its engine was freed"
    assert torch.equal(t, values if which != "grads_view" else 2 * values)
    v = t[2:5]  # a view keeps it too
    del t
    gc.collect()
    assert engines[0]() is not None
    assert torch.equal(v, values[2:5] * (1 if which != "grads_view" else 2))
    del v
    gc.collect()
    assert engines[0]() is None, "the engine outlived every tensor that views it"


# ---- 3. writes through p.data / p.detach() / a view ---------------------------

def write(p, how):
    with torch.no_grad():
        if how == "data.clamp_":  # WGAN's weight clipping
            p.data.clamp_(-0.01, 0.01)
        elif how == "data.copy_":
            p.data.copy_(torch.zeros(p.shape))
        elif how == "detach.mul_":
            p.detach().mul_(2)
        elif how == "view.zero_":
            p.t()[0].zero_()
        else:
            raise AssertionError(how)


HOWS = ["data.clamp_", "data.copy_", "detach.mul_", "view.zero_"]


def linear_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("then", ["step", "state_dict", "optimizer.state_dict"])
@pytest.mark.parametrize("how", HOWS)
def test_a_write_through_a_tensor_of_an_offloaded_parameter_is_refused(how, then):
    """Before: no error; the write changed the masters (no GPU, fp32: the
    fetch hands out their memory) and step/state_dict went on."""
    model = linear_model()
    off = st.offload_module(model, config(), force_no_gpu=True)
    write(model[0].weight, how)
    act = {"step": off.optimizer.step, "state_dict": off.state_dict,
           "optimizer.state_dict": off.optimizer.state_dict}[then]
    with pytest.raises(strata.Error, match=r"0\.weight.*written in place.*load_state_dict") as e:
        act()
    assert e.value.status == strata.INVALID
    assert "0.bias" not in str(e.value)
    # Said once: the model goes on (a state_dict, a step), and closes.
    off.state_dict()
    model(torch.randn(3, 4)).sum().backward()
    off.optimizer.step()
    off.close()


def test_weight_clipping_before_a_forward_is_refused_at_the_end_of_backward():
    """WGAN's loop clamps the critic's weights before its forward: the
    forward ran on the clamped fetched copy, which the masters never got
    (bf16: the copy is the engine's bf16 one, the write is lost)."""
    model = linear_model()
    off = st.offload_module(model, config(bf16=True), force_no_gpu=True)
    x = torch.randn(5, 4)
    for p in model.parameters():
        with torch.no_grad():
            p.data.clamp_(-0.01, 0.01)
    loss = model(x.bfloat16()).float().square().mean()
    with pytest.raises(strata.Error, match=r"0\.weight, 0\.bias, 2\.weight, 2\.bias: written in place"):
        loss.backward()
    off.optimizer.step()  # the gradients of that backward were handed; said once
    off.close()


def test_a_write_after_the_release_is_refused_at_the_next_step():
    """A tensor kept from p.detach() views the fetched copy until the group
    is released; a write after (into memory the engine reuses) is caught
    too, at the next step."""
    model = linear_model()
    off = st.offload_module(model, config(), force_no_gpu=True)
    kept = model[2].weight.detach()
    model(torch.randn(3, 4)).sum().backward()
    off.optimizer.step()
    with torch.no_grad():
        kept.mul_(0.5)
    with pytest.raises(strata.Error, match=r"2\.weight: written in place"):
        off.optimizer.step()
    off.close()


def test_a_write_before_close_is_said_after_it_closes():
    model = linear_model()
    off = st.offload_module(model, config(), force_no_gpu=True)
    write(model[2].bias, "data.clamp_")
    with pytest.raises(strata.Error, match=r"2\.bias: written in place"):
        off.close()
    assert off.engine is None and type(model[2].bias) is nn.Parameter


def test_reading_outside_a_forward_and_loading_are_not_writes():
    """p.data, p.detach() and views read outside every forward, kept across
    steps and a load_state_dict (whose copy moves the parameters' version
    counters), raise nothing, and training follows torch; a write through
    one of the kept tensors after all that is still refused (before: not)."""
    ref, model = linear_model(), linear_model()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    off = st.offload_module(model, config(), force_no_gpu=True)
    kept = {}
    for m, o in ((ref, oracle.AdamW(ref.parameters(), lr=LR, weight_decay=WD)), (model, off.optimizer)):
        for step in range(3):
            norms = [float(p.detach().norm()) + float(p.data.sum()) for p in m.parameters()]
            assert all(n == n for n in norms)
            kept[id(m)] = [p.detach() for p in m.parameters()] + [m[0].weight.t()[0], m[2].weight.data]
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
            if step == 1:
                m.load_state_dict(m.state_dict())
    got = off.state_dict()
    for k, v in ref.state_dict().items():
        assert rel(got[k], v) <= TOL, (k, rel(got[k], v))
    with torch.no_grad():
        kept[id(model)][1].zero_()  # 0.bias's detach(), kept since before the last step
    with pytest.raises(strata.Error, match=r"INVALID: 0\.bias: written in place"):
        off.state_dict()
    off.close()


# ---- 4. what is watched: views of the fetched copy only, once each ------------

def _watched(off):
    return sum(len(h.refs) for h in off._handed_out.values())


def test_an_ema_loop_outside_the_forward_watches_nothing():
    """An EMA of the weights (ema.lerp_(p, w) every step), a foreach over
    the parameters, p.contiguous() (p itself): none of them is a view of the
    fetched copy, so none is watched, and the watch stays empty however
    long the loop. Before: each call added what it returned (the EMA tensor
    every step: a list that grew forever; each parameter every foreach
    result: N^2; p itself: watched for good), scanned at every step."""
    model = linear_model()
    off = st.offload_module(model, config(), force_no_gpu=True)
    params = list(model.parameters())
    with torch.no_grad():
        ema = [p.detach().clone() for p in params]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    for step in range(100):
        model(x).square().mean().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 0.01)
            diffs = torch._foreach_sub(ema, params)
            same = [p.contiguous() for p in params]
        assert all(s is p for s, p in zip(same, params))
        assert _watched(off) == 0, f"step {step}: {_watched(off)} tensors watched"
        del diffs, same
    assert not off._handed_out
    masters = off.state_dict()
    for e, (k, v) in zip(ema, masters.items()):
        assert e.shape == v.shape and torch.isfinite(e).all(), k
    off.close()


def test_views_handed_out_are_watched_once_each_while_they_live():
    """p.detach() kept and asked again (the same tensor comes back from a
    tuple of views): watched once; dropped, the parameter is watched no
    more after the next check."""
    model = linear_model()
    off = st.offload_module(model, config(), force_no_gpu=True)
    w = model[0].weight
    kept = w.detach()
    for _ in range(50):
        pieces = torch.split(w, 2)  # views, a tuple
        rows = w.unbind(0)
        del pieces, rows
    assert _watched(off) == 1  # kept alone lives
    model(torch.randn(3, 4)).sum().backward()
    off.optimizer.step()
    with torch.no_grad():
        kept.mul_(2)
    with pytest.raises(strata.Error, match=r"0\.weight: written in place"):
        off.state_dict()
    del kept
    off.optimizer.step()  # (said once) and nothing watched lives: dropped
    assert not off._handed_out
    off.close()


def test_a_plain_training_loop_does_no_watching(monkeypatch):
    """The hot loop (forward, backward, clip_grad_norm_, step, zero_grad)
    never reaches the outside-a-forward path: nothing handed out, watched,
    or walked for stale forwards, whatever the number of steps."""
    from strata.torch import _module_hooks
    from strata.torch._offloaded_module import OffloadedModule
    calls = {"views_of": 0, "handed_out": 0, "_modules_running": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(OffloadedModule, "views_of", counted("views_of", OffloadedModule.views_of))
    monkeypatch.setattr(OffloadedModule, "handed_out", counted("handed_out", OffloadedModule.handed_out))
    monkeypatch.setattr(_module_hooks, "_modules_running",
                        counted("_modules_running", _module_hooks._modules_running))
    model = linear_model()
    off = st.offload_module(model, config(), force_no_gpu=True)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    for _ in range(5):
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        off.optimizer.step()
        off.optimizer.zero_grad()
    assert calls == {"views_of": 0, "handed_out": 0, "_modules_running": 0}, calls
    assert not off._handed_out
    off.close()
