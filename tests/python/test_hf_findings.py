"""Five defects that Hugging Face models found (issue 35), each shown with
plain torch modules so that both torch versions run it: a second
offload_module of one model, a refused fp16 backward that crashed the
process at exit, clipping with a bf16-rounded norm, copy.deepcopy of an
offloaded model, and DeepSpeed's "auto" config values filled in silence."""
import copy
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

nn = torch.nn
CFG = {"zero_optimization": {"stage": 3}}


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


# ---- 1. a second offload_module of the same model --------------------------------

def test_a_second_offload_module_of_a_model_is_refused_naming_it():
    model = two_linears()
    off = st.offload_module(model, CFG, force_no_gpu=True)
    for again in (model, model[2], nn.Sequential(model)):  # the model, a part of it, a whole around it
        with pytest.raises(strata.Error) as err:
            st.offload_module(again, CFG, force_no_gpu=True)
        assert err.value.status == strata.INVALID
        assert "Sequential" in err.value.message and type(again).__name__ in err.value.message
        assert "close()" in err.value.message
    # The first one still trains: the refusal changed nothing.
    model(torch.randn(3, 4)).sum().backward()
    off.optimizer.step()
    off.close()
    # Closed, the model may be offloaded again.
    st.offload_module(model, CFG, force_no_gpu=True).close()


# ---- 2. a refused fp16 backward leaves nothing that crashes later -----------------

REFUSED_FP16 = """
import torch, strata, strata.torch as st
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)).half()
off = st.offload_module(model, {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "initial_scale_power": 4}},
                        force_no_gpu=True)
loss = model(torch.tensor([1, 2, 3])).float().sum()
MODE = %r
if MODE == "uncaught":
    loss.backward()
try:
    loss.backward()
    raise SystemExit("an unscaled fp16 backward was accepted")
except strata.Error as e:
    assert e.status == strata.INVALID, e
    print("refused:", e.message[:60])
if MODE == "then_trains":
    for _ in range(2):
        off.backward(model(torch.tensor([1, 2, 3])).float().sum())
        off.optimizer.step()
    assert off.engine.steps == 2, off.engine.steps
print("done")
"""


def _fp16_linear_runs():
    try:
        nn.Linear(2, 2).half()(torch.ones(1, 2, dtype=torch.float16))
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(not _fp16_linear_runs(), reason="this torch has no float16 Linear on the CPU (torch 1.13)")
@pytest.mark.parametrize("mode", ["caught", "uncaught", "then_trains"])
def test_a_refused_fp16_backward_leaves_nothing_that_crashes_at_exit(mode):
    # Embedding + Linear: the refusal, raised inside autograd's hook, left
    # the Embedding's backward queued in the thread's ready queue, which
    # torch frees at the thread's exit, after Python: exit 139.
    p = subprocess.run([sys.executable, "-c", REFUSED_FP16 % mode], capture_output=True, text=True,
                       env=dict(os.environ), timeout=300)
    out = p.stdout + p.stderr
    if mode == "uncaught":
        assert p.returncode == 1 and "INVALID" in p.stderr and "not scaled" in p.stderr, (p.returncode, out)
    else:
        assert p.returncode == 0 and "refused: " in p.stdout and "done" in p.stdout, (p.returncode, out)


# ---- 3. clip_grad_norm_ under bf16: float32 norms ---------------------------------

def _bf16_grads(model, x):
    """The model's bf16 gradients for x, by torch alone (a copy of it)."""
    ref = copy.deepcopy(model)
    ref(x).float().square().sum().backward()
    return [p.grad.clone() for p in ref.parameters()]


def _float32_clip(grads, max_norm):
    """torch's clip_grad_norm_ over float32 masters whose .grad is grad.float():
    the total norm and the float32 coefficient."""
    masters = [nn.Parameter(torch.zeros(g.shape)) for g in grads]
    for m, g in zip(masters, grads):
        m.grad = g.float()
    total = torch.nn.utils.clip_grad_norm_(masters, max_norm)  # not strata's: torch's own
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _first_moments(state_dict, grads):
    return [state_dict["state"][i]["exp_avg"] for i in range(len(grads))]


@pytest.mark.parametrize("who", ["offload_module", "OffloadAdam"])
def test_clip_grad_norm_under_bf16_takes_the_float32_norm(who):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).bfloat16()
    x = torch.randn(5, 16).bfloat16() * 3
    grads = _bf16_grads(model, x)
    max_norm = 0.25
    want_norm, coef = _float32_clip(grads, max_norm)
    bf16_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(bf16_norm) != float(want_norm)  # the rounding that this test is about
    assert float(coef) < 1.0
    cfg = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    if who == "offload_module":
        off = st.offload_module(model, cfg, force_no_gpu=True, overlap_step=False)
        opt = off.optimizer
    else:
        cfg["zero_optimization"]["stage"] = 1
        opt = st.OffloadAdam(model.parameters(), lr=1e-3, weight_decay=0.0, config=cfg, force_no_gpu=True)
    model(x).float().square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    assert norm.dtype == torch.float32 and torch.equal(norm, want_norm), (norm, want_norm, bf16_norm)
    opt.step()
    # The step clipped by torch's float32 coefficient: after one step the
    # first moment is (1 - beta1) * (grad.float() * coef), one rounding each.
    one_minus_b1 = torch.tensor(1 - 0.9, dtype=torch.float32)
    for m, g in zip(_first_moments(opt.state_dict(), grads), grads):
        assert torch.equal(m.reshape(-1), (one_minus_b1 * (g.float() * coef)).reshape(-1))
    (off if who == "offload_module" else opt).close()


# ---- 4. copy.deepcopy of an offloaded model ----------------------------------------

def test_deepcopy_of_an_offloaded_model_says_what_to_do():
    model = two_linears()
    off = st.offload_module(model, CFG, force_no_gpu=True)
    for what in (model, off, off.optimizer):
        with pytest.raises(strata.Error) as err:
            copy.deepcopy(what)
        msg = err.value.message
        assert err.value.status == strata.INVALID and "deepcopy" in msg and "Sequential" in msg, msg
        assert "before offload_module" in msg and "load_state_dict" in msg, msg
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    off.close()
    twin = copy.deepcopy(model)  # closed: an ordinary model again
    assert all(torch.equal(twin.state_dict()[k], v) for k, v in expected.items())


def test_deepcopy_of_offload_adam_says_what_to_do():
    model = two_linears()
    opt = st.OffloadAdam(model.parameters(), force_no_gpu=True)
    with pytest.raises(strata.Error, match="deepcopy.*OffloadAdam.*state_dict"):
        copy.deepcopy(opt)
    opt.close()


# ---- 5. "auto" config values --------------------------------------------------------

# The optimizer part of the ds_config that Hugging Face's DeepSpeed
# integration documents: the Trainer fills "auto" from its own arguments.
HF_AUTO = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
           "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}


def test_auto_lr_is_refused_under_offload_module_where_nothing_fills_it():
    for lr_auto in (HF_AUTO, {"optimizer": {"type": "AdamW", "params": "auto"}}, {"optimizer": "auto"}):
        model = two_linears()
        with pytest.raises(strata.Error) as err:
            st.offload_module(model, copy.deepcopy(lr_auto), force_no_gpu=True)
        msg = err.value.message
        assert err.value.status == strata.INVALID and "lr" in msg and '"auto"' in msg, msg
        assert "learning_rate" in msg and "0.001" in msg, msg
        assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing was offloaded


def test_every_auto_that_is_filled_is_said_once_with_its_value():
    cfg = copy.deepcopy(HF_AUTO)
    cfg["optimizer"]["params"]["lr"] = 5e-5
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        off = st.offload_module(two_linears(), cfg, force_no_gpu=True)
    said = [str(w.message) for w in got if '"auto"' in str(w.message)]
    for key, value in (("optimizer.params.betas", "[0.9, 0.999]"), ("optimizer.params.eps", "1e-08"),
                       ("optimizer.params.weight_decay", "0.0"), ("gradient_clipping", "0.0"),
                       ("zero_optimization.reduce_bucket_size", "500000000")):
        lines = [s for s in said if f"{key} is \"auto\"" in s]
        assert len(lines) == 1 and value in lines[0], (key, said)
    # A key Strata leaves to the trainer fills nothing: no word about it.
    assert not any("train_micro_batch_size_per_gpu" in s for s in said), said
    assert len(said) == 5, said
    off.close()

    # OffloadAdam: its arguments fill the optimizer's "auto"s (the config's
    # lr "auto" is its lr=), each said once however many engines it makes.
    model = two_linears()
    groups = [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, model[2].bias]}]
    cfg = copy.deepcopy(HF_AUTO)
    cfg["zero_optimization"]["stage"] = 1
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        opt = st.OffloadAdam(groups, lr=5e-5, config=cfg, force_no_gpu=True)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    said = [str(w.message) for w in got if '"auto"' in str(w.message)]
    lr = [s for s in said if 'optimizer.params.lr is "auto"' in s]
    assert len(lr) == 1 and "5e-05" in lr[0] and "OffloadAdam" in lr[0], said
    assert len([s for s in said if "gradient_clipping" in s]) == 1, said
    opt.close()
