"""What a review of strata.torch found honoured only in part, each
against torch or against a run that says the same thing another way:
clip_grad_norm_ under a config's gradient_clipping (clipped once, at the
call's norm), a torch AdamW state_dict loaded (max_grad_norm kept), a param
group asking for amsgrad/fused/capturable/differentiable (refused, as the
arguments are), and a config optimizer section that disagrees with the
arguments (refused, not overridden); and offload_module's close(), which left
its gradient hooks on parameters that keep their AccumulateGrad node, and
its accumulation count, which ignored the ds_config's
gradient_accumulation_steps (DeepSpeed averages over it)."""
import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

nn = torch.nn


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def batches(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g) * 4).to(dtype) for _ in range(n)]


def train(model, opt, xs, clip=None):
    for x in xs:
        model(x).float().square().sum().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


# ---- clip_grad_norm_ says the clipping; the config's gradient_clipping does not clip again ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("call_clip", [0.5, 1e6], ids=["call-clips", "call-never-clips"])
def test_clip_grad_norm_overrides_the_configs_gradient_clipping(dtype, call_clip):
    xs = batches(3, dtype)
    bf16 = {"bf16": {"enabled": True}} if dtype == torch.bfloat16 else {}
    runs = {}
    # The config would clip hard (1e-3); the call says call_clip. Both runs
    # must train as the one whose config does not clip at all: clipped once,
    # at the call's norm.
    for name, cfg_clip in (("config_clips", 1e-3), ("config_silent", None)):
        model = mlp(dtype)
        cfg = dict(bf16, **({"gradient_clipping": cfg_clip} if cfg_clip else {}))
        opt = st.OffloadAdam(model.parameters(), lr=1e-2, config=cfg, force_no_gpu=True)
        runs[name] = train(model, opt, xs, clip=call_clip)
        opt.close()
    for a, b in zip(runs["config_clips"], runs["config_silent"]):
        assert torch.equal(a, b), (a - b).abs().max()
    # The config's clipping alone does clip (what the call overrides is real).
    model = mlp(dtype)
    opt = st.OffloadAdam(model.parameters(), lr=1e-2, config=dict(bf16, gradient_clipping=1e-3), force_no_gpu=True)
    clipped = train(model, opt, xs)
    opt.close()
    assert any(not torch.equal(a, b) for a, b in zip(clipped, runs["config_silent"]))


# ---- a torch AdamW state_dict keeps OffloadAdam's max_grad_norm ----------------------

def test_loading_a_torch_adamw_state_dict_keeps_max_grad_norm():
    xs = batches(4)
    start = mlp()
    ref = torch.optim.AdamW(start.parameters(), lr=1e-2)
    train(start, ref, xs[:1])
    saved = copy.deepcopy(ref.state_dict())
    assert "max_grad_norm" not in saved["param_groups"][0]
    runs = {}
    # torch's dict (no max_grad_norm), the same dict saying 1e-3, and the
    # same dict saying 0 (no clipping): the first must train as the second.
    for name, key in (("torch_dict", None), ("says_1e-3", 1e-3), ("says_0", 0.0)):
        model = copy.deepcopy(start)
        sd = copy.deepcopy(saved)
        if key is not None:
            sd["param_groups"][0]["max_grad_norm"] = key
        opt = st.OffloadAdam(model.parameters(), lr=1e-2, max_grad_norm=1e-3, config={}, force_no_gpu=True)
        opt.load_state_dict(sd)
        runs[name] = (opt.param_groups[0]["max_grad_norm"], train(model, opt, xs[1:]))
        opt.close()
    assert runs["torch_dict"][0] == 1e-3
    for a, b in zip(runs["torch_dict"][1], runs["says_1e-3"][1]):
        assert torch.equal(a, b), (a - b).abs().max()
    assert any(not torch.equal(a, b) for a, b in zip(runs["torch_dict"][1], runs["says_0"][1])), "must clip"


# ---- refused, as the arguments are: a group asking for what the kernel does not compute ----

@pytest.mark.parametrize("flag", ["amsgrad", "fused", "capturable", "differentiable"])
def test_a_param_group_option_that_is_not_computed_is_refused(flag):
    model = mlp()
    groups = [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight], flag: True}]
    with pytest.raises(strata.Error, match=f"a param group has {flag}=True, which is not supported"):
        st.OffloadAdam(groups, config={}, force_no_gpu=True)
    opt = st.OffloadAdam([model[0].weight], config={}, force_no_gpu=True)
    with pytest.raises(strata.Error, match=f"{flag}=True"):
        opt.add_param_group({"params": [model[2].weight], flag: True})
    assert len(opt.param_groups) == 1  # nothing added
    opt.add_param_group({"params": [model[2].weight]})
    opt.close()


def test_a_torch_amsgrad_state_dict_is_refused_before_anything_changes():
    model = mlp()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    train(model, ref, batches(1))
    opt = st.OffloadAdam(model.parameters(), lr=1e-2, config={}, force_no_gpu=True)
    before = opt.state_dict()
    with pytest.raises(strata.Error, match="load_state_dict: param group 0 has amsgrad=True"):
        opt.load_state_dict(ref.state_dict())
    assert opt.state_dict()["param_groups"] == before["param_groups"]
    opt.close()


# ---- a config optimizer section that disagrees with the arguments ------------------

@pytest.mark.parametrize("section, kw, needle", [
    ({"type": "Lion", "params": {"lr": 1e-3}}, {}, "optimizer.type is 'Lion'; OffloadAdam is AdamW"),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, {}, "adam_w_mode false"),
    ({"type": "AdamW", "params": {"lr": 3e-4}}, {"lr": 1e-3},
     "optimizer.params.lr is 0.0003 and the argument lr=0.001"),
    ({"type": "AdamW", "params": {"betas": [0.9, 0.95]}}, {"betas": (0.9, 0.999)},
     "optimizer.params.betas is \\[0.9, 0.95\\] and the argument betas=\\(0.9, 0.999\\)"),
    ({"type": "AdamW", "params": {"eps": 1e-6}}, {"eps": 1e-8}, "optimizer.params.eps"),
    ({"type": "AdamW", "params": {"weight_decay": 0.1}}, {"weight_decay": 0.01},
     "optimizer.params.weight_decay is 0.1 and the argument weight_decay=0.01"),
    ({"type": "AdamW", "params": {"lr": "fast"}}, {}, "optimizer.params.lr is 'fast'; a number"),
])
def test_a_config_optimizer_that_disagrees_with_the_arguments_is_refused(section, kw, needle):
    with pytest.raises(strata.Error, match=needle):
        st.OffloadAdam(mlp().parameters(), config={"optimizer": section}, force_no_gpu=True, **kw)


def test_the_configs_values_are_the_defaults_and_param_groups_still_set_their_own():
    # The Hugging Face way: the config says the decay, the groups exempt some.
    model = mlp()
    decay = [model[0].weight, model[2].weight]
    rest = [model[0].bias, model[2].bias]
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}}
    opt = st.OffloadAdam([{"params": decay}, {"params": rest, "weight_decay": 0.0}], config=cfg,
                         force_no_gpu=True)
    g0, g1 = opt.param_groups
    assert (g0["lr"], g0["betas"], g0["eps"], g0["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-8, 0.1)
    assert (g1["lr"], g1["weight_decay"]) == (3e-4, 0.0)
    opt.close()
    # Trains as the same hyperparameters given as arguments, bitwise.
    xs = batches(3)
    runs = []
    for c, kw in ((cfg, {}), ({}, {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1})):
        m = mlp()
        o = st.OffloadAdam([{"params": [m[0].weight, m[2].weight]},
                            {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0}], config=c,
                           force_no_gpu=True, **kw)
        runs.append(train(m, o, xs))
        o.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


DEFAULTS = (1e-3, (0.9, 0.999), 1e-8, 0.01)


@pytest.mark.parametrize("section, kw, want", [
    ({"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.05}},
     dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05), (2e-3, (0.8, 0.99), 1e-7, 0.05)),
    ({"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.05}},
     {}, (2e-3, (0.8, 0.99), 1e-7, 0.05)),
    ({"type": "adam", "params": {"lr": "auto", "betas": "auto", "adam_w_mode": True}},
     dict(lr=2e-3), (2e-3, (0.9, 0.999), 1e-8, 0.01)),
    ({"type": "AdamW", "params": "auto"}, dict(weight_decay=0.05), (1e-3, (0.9, 0.999), 1e-8, 0.05)),
    ("auto", {}, DEFAULTS), (None, {}, DEFAULTS),
])
def test_a_config_optimizer_that_agrees_is_taken(section, kw, want):
    opt = st.OffloadAdam(mlp().parameters(), config={"optimizer": section}, force_no_gpu=True, **kw)
    g = opt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) == want
    opt.close()


# ---- offload_module: close() leaves no hook behind ---------------------------------

def test_backward_after_close_fills_grad_and_a_second_offload_takes_its_own():
    model = mlp()
    x = batches(1)[0]
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}}, force_no_gpu=True)
    model(x).square().sum().backward()
    off.optimizer.step()
    off.optimizer.zero_grad()
    off.close()
    # Ordinary parameters again: backward fills .grad, as torch's would.
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    # Offloaded again: its gradients go to the new engine alone, and it trains as one fresh offload of ref.
    off2 = st.offload_module(model, {"zero_optimization": {"stage": 3}}, force_no_gpu=True)
    off3 = st.offload_module(ref, {"zero_optimization": {"stage": 3}}, force_no_gpu=True)
    for m, o in ((model, off2), (ref, off3)):
        m(x).square().sum().backward()
        o.optimizer.step()
        o.optimizer.zero_grad()
    got, want = model.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for k in got:
        assert torch.equal(got[k], want[k]), k
    off2.close()
    off3.close()


# ---- offload_module takes the ds_config's gradient_accumulation_steps ---------------

def accumulate(cfg, micro, **kw):
    model = mlp()
    # eps 1e-3: Adam's update then depends on the gradient's scale (the divisor) in every element.
    opt = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3}}
    off = st.offload_module(model, dict(cfg, zero_optimization={"stage": 3}, optimizer=opt), force_no_gpu=True, **kw)
    xs = batches(3 * micro)
    for s in range(3):
        for x in xs[s * micro:(s + 1) * micro]:
            model(x).square().mean().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    off.close()
    return sd


def test_the_configs_gradient_accumulation_steps_is_the_divisor():
    by_config = accumulate({"gradient_accumulation_steps": 2}, 2)
    by_argument = accumulate({}, 2, grad_accumulation_steps=2)
    by_both = accumulate({"gradient_accumulation_steps": 2}, 2, grad_accumulation_steps=2)
    summed = accumulate({}, 2, grad_accumulation_steps=1)  # what the config's 2 trained as before
    for k in by_argument:
        assert torch.equal(by_config[k], by_argument[k]), k
        assert torch.equal(by_both[k], by_argument[k]), k
    assert any(not torch.equal(summed[k], by_argument[k]) for k in summed), "the divisor must show"
    # "auto": the argument's (or 1).
    auto = accumulate({"gradient_accumulation_steps": "auto"}, 2, grad_accumulation_steps=2)
    # DeepSpeed's derivation: train_batch_size / (micro batch x ranks), at one rank 12 / 6.
    derived = accumulate({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 6}, 2)
    import numpy as np  # an integer of numpy's is an integer
    numpy_int = accumulate({}, 2, grad_accumulation_steps=np.int64(2))
    for k in by_argument:
        assert torch.equal(auto[k], by_argument[k]), k
        assert torch.equal(derived[k], by_argument[k]), k
        assert torch.equal(numpy_int[k], by_argument[k]), k


def test_the_key_taken_is_not_called_left_to_the_trainer():
    # In a fresh process: the engine says each such note once a process.
    code = ("import torch, strata.torch as st\n"
            "m = torch.nn.Linear(4, 2)\n"
            "off = st.offload_module(m, {'gradient_accumulation_steps': 2, 'train_batch_size': 8,\n"
            "                            'zero_optimization': {'stage': 3}}, force_no_gpu=True)\n"
            "off.close()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "train_batch_size: left to the trainer" in run.stderr, run.stderr  # the engine's word on a key it leaves
    assert "gradient_accumulation_steps" not in run.stderr, run.stderr


@pytest.mark.parametrize("cfg, kw, needle", [
    ({"gradient_accumulation_steps": 2}, {"grad_accumulation_steps": 3},
     "grad_accumulation_steps=3 and the config's 2 backward passes"),
    ({"gradient_accumulation_steps": 0}, {}, "the config's gradient_accumulation_steps is 0; an integer >= 1"),
    ({"gradient_accumulation_steps": 2.0}, {}, "the config's gradient_accumulation_steps is 2.0; an integer >= 1"),
    ({}, {"grad_accumulation_steps": 0}, "grad_accumulation_steps is 0; an integer >= 1"),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 6}, {"grad_accumulation_steps": 1},
     "grad_accumulation_steps=1 and the config's 2 backward passes"),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 5}, {},
     "train_batch_size 12 is not a multiple of train_micro_batch_size_per_gpu 5"),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 3}, {},
     "train_batch_size 12 is not train_micro_batch_size_per_gpu 6 x gradient_accumulation_steps 3"),
])
def test_a_bad_or_disagreeing_accumulation_count_is_refused(cfg, kw, needle):
    with pytest.raises(strata.Error, match=needle):
        st.offload_module(mlp(), dict(cfg, zero_optimization={"stage": 3}), force_no_gpu=True, **kw)


# ---- a sub-module's state_dict under offload_module: the masters, owned ----------------

@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-config"])
def test_a_sub_modules_state_dict_holds_its_masters_of_its_own(bf16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 4))
    cfg = {"zero_optimization": {"stage": 3}, **({"bf16": {"enabled": True}} if bf16 else {})}
    off = st.offload_module(model, cfg, force_no_gpu=True)
    x = batches(1, torch.bfloat16 if bf16 else torch.float32)[0]  # (bf16: the fetched weights are bf16)

    def step():
        model(x).float().square().sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()

    step()
    whole = model.state_dict()
    sub = model[0].state_dict()
    assert list(sub) == ["0.weight", "0.bias"]
    for k, v in sub.items():  # the masters, in the parameter's dtype (float32), as the model's state_dict has them
        assert v.dtype == torch.float32 and torch.equal(v, whole["0." + k]), k
    kept = {k: v.clone() for k, v in sub.items()}
    step()  # a snapshot: later steps do not change it
    assert not torch.equal(model.state_dict()["0.0.weight"], whole["0.0.weight"]), "the step must train"
    for k in sub:
        assert torch.equal(sub[k], kept[k]), k
    off.close()
    for k in sub:  # nor does close() (the engine's memory is gone)
        assert torch.equal(sub[k], kept[k]), k


# ---- a sub-module's own load_state_dict under offload_module: its masters ----------------

@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-config"])
def test_a_sub_modules_load_state_dict_makes_the_values_its_masters(bf16):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 4))

    cfg = {"zero_optimization": {"stage": 3}, **({"bf16": {"enabled": True}} if bf16 else {})}
    x = batches(1, torch.bfloat16 if bf16 else torch.float32)[0]

    def step(model, off):
        model(x).float().square().sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()

    model, ref = make(), make()
    off, off_ref = st.offload_module(model, cfg, force_no_gpu=True), st.offload_module(ref, cfg, force_no_gpu=True)
    step(model, off)
    step(ref, off_ref)
    torch.manual_seed(1)
    new = {"0.weight": torch.randn(16, 8), "0.bias": torch.randn(16)}
    before = off.master_parameters()
    model[0].load_state_dict(new)
    after = off.master_parameters()
    for k, v in new.items():  # the values, as the masters (float32)
        assert torch.equal(after["0." + k], v), k
    for k in ("1.weight", "1.bias"):  # a group outside the sub-module: untouched
        assert torch.equal(after[k], before[k]), k
    # The model's own load of the same values: the same masters, and the same next step, bitwise.
    ref.load_state_dict(dict(ref.state_dict(), **{"0." + k: v for k, v in new.items()}))
    step(model, off)
    step(ref, off_ref)
    # Gradients still reach the engine after either load (under a bf16 config a
    # load gave the parameters new AccumulateGrad nodes: their hooks were lost).
    assert off.optimizer.last_result[0] > 0 and off.optimizer.last_result == off_ref.optimizer.last_result
    got, want = off.master_parameters(), off_ref.master_parameters()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # A refused load (strict, a key missing) raises and changes nothing; strict=False loads what it has.
    kept = off.master_parameters()
    with pytest.raises(RuntimeError, match="Missing key"):
        model[0].load_state_dict({"0.weight": torch.zeros(16, 8)})
    assert all(torch.equal(off.master_parameters()[k], kept[k]) for k in kept)
    model[0].load_state_dict({"0.weight": torch.ones(16, 8)}, strict=False)
    now = off.master_parameters()
    assert torch.equal(now["0.0.weight"], torch.ones(16, 8)) and torch.equal(now["0.0.bias"], kept["0.0.bias"])
    # A leaf's own load (model[1]), and assign=True refused naming it.
    model[1].load_state_dict({"weight": torch.full((4, 16), 0.5), "bias": torch.zeros(4)})
    assert torch.equal(off.master_parameters()["1.weight"], torch.full((4, 16), 0.5))
    with pytest.raises(strata.Error, match="assign=True"):
        model[0].load_state_dict(new, assign=True)
    off.close()
    off_ref.close()
    assert "load_state_dict" not in model[0].__dict__ and "load_state_dict" not in model.__dict__


def test_a_load_under_no_grad_and_a_load_that_raises_midway_leave_training_whole():
    """Under a bf16 config a load gives the parameters new AccumulateGrad
    nodes (their data changes dtype and back): found again under
    torch.no_grad() too. A load that raises between the model's hooks
    writes nothing and leaves no load open: the next one works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
                            force_no_gpu=True)
    x = batches(1, torch.bfloat16)[0]

    def step():
        model(x).float().square().sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
        return off.optimizer.last_result[0]

    step()
    with torch.no_grad():
        model.load_state_dict(model.state_dict())
    assert step() > 0, "the gradients must reach the engine after a load under no_grad"

    def boom(*args):
        raise RuntimeError("a hook of the user's")

    kept = off.master_parameters()
    handle = model[2]._register_load_state_dict_pre_hook(boom)
    with pytest.raises(RuntimeError, match="a hook of the user's"):
        model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    handle.remove()
    now = off.master_parameters()
    assert all(torch.equal(now[k], kept[k]) for k in kept), "the load that raised wrote nothing"
    model[0].load_state_dict({"weight": torch.full((16, 8), 0.5), "bias": torch.full((16,), 0.5)})
    now = off.master_parameters()
    assert torch.equal(now["0.weight"], torch.full((16, 8), 0.5)), "a later load of another module must not be lost"
    assert torch.equal(now["2.weight"], kept["2.weight"])
    model.load_state_dict({k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()})
    assert all(torch.equal(v, torch.full_like(v, 0.25)) for v in off.master_parameters().values())
    assert step() > 0
    off.close()


def test_a_partial_load_of_a_bf16_model_keeps_the_other_masters_exactly():
    """A model in bf16: its state_dict gives its masters in bf16. Parameters
    a load does not write (strict=False, or outside the sub-module loaded)
    keep their fp32 masters bitwise, not rounded to bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
                            force_no_gpu=True)
    x = batches(1, torch.bfloat16)[0]
    for _ in range(2):
        model(x).float().square().sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
    before = off.master_parameters()
    assert any(not torch.equal(v, v.bfloat16().float()) for v in before.values()), "fp32 masters beyond bf16"
    model.load_state_dict({"0.weight": torch.ones(16, 8, dtype=torch.bfloat16)}, strict=False)
    after = off.master_parameters()
    assert torch.equal(after["0.weight"], torch.ones(16, 8))
    for k in ("0.bias", "2.weight", "2.bias"):
        assert torch.equal(after[k], before[k]), k
    model[2].load_state_dict({"weight": torch.ones(4, 16, dtype=torch.bfloat16),
                              "bias": torch.zeros(4, dtype=torch.bfloat16)})
    last = off.master_parameters()
    assert torch.equal(last["2.weight"], torch.ones(4, 16)) and torch.equal(last["0.bias"], before["0.bias"])
    off.close()
