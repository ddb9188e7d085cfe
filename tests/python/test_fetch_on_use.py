"""offload_module's parameters are real wherever torch code reads them, and
OffloadAdam follows torch's rule for parameters without a gradient; bad
input is refused naming what is wrong. Oracle: torch AdamW on a copy (for
the bitwise tests with a correctly rounded sqrt: oracle.py)."""
import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402

LR, WD, STEPS, TOL = 1e-2, 0.01, 5, 5e-6
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.999], "eps": 1e-8}}


def config(tmp_path=None):
    cfg = {"zero_optimization": {"stage": 3}, "optimizer": copy.deepcopy(ADAMW)}
    if tmp_path is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    return cfg


class ReadsOutside(nn.Module):
    """Every way of reading a parameter outside its own module's forward."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt
        self.emb = nn.Embedding(40, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # reads out_proj.weight itself
        self.child = nn.Linear(16, 16)
        self.other = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def block(self, h):
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + F.linear(h, self.other.weight, self.other.bias)  # another module's weight, functionally
        return torch.tanh(h @ self.child.weight.t() + self.child.bias)  # a parent reads its child's

    def forward(self, x):
        h = self.emb(x)
        if self.ckpt is None:
            h = self.block(h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.ckpt)
        return F.linear(self.norm(h), self.emb.weight)  # a head tied by reading the embedding


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def train(model, opt, x, y, clip):
    for _ in range(STEPS):
        loss = F.cross_entropy(model(x).reshape(-1, 40), y.reshape(-1))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("ckpt", [None, True, False], ids=["plain", "checkpoint-reentrant", "checkpoint"])
@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["noclip", "clip"])
def test_parameters_read_outside_their_forward(tmp_path, ckpt, clip):
    torch.manual_seed(0)
    ref = ReadsOutside(ckpt)
    model = copy.deepcopy(ref)
    x, y = torch.randint(0, 40, (4, 7)), torch.randint(0, 40, (4, 7))
    # The attention's key bias has a true gradient of zero (softmax ignores a
    # shift common to every score): Adam trains it on rounding noise, so one
    # rounding of torch's own sqrt moves it by 4-27% (PyPI torch on an AMD
    # EPYC). Hence the oracle with a correctly rounded sqrt, as ours is.
    train(ref, oracle.AdamW(ref.parameters(), lr=LR, weight_decay=WD), x, y, clip)
    off = st.offload_module(model, config(tmp_path), force_no_gpu=True)
    train(model, off.optimizer, x, y, clip)
    got = off.state_dict()
    bad = {k: rel(got[k], v) for k, v in ref.state_dict().items() if not rel(got[k], v) <= TOL}
    assert not bad, f"tensors beyond {TOL} relative: {bad}"
    assert not any(st.is_fetched(p) for p in model.parameters()), "a group stayed fetched after the step"
    ref.eval(), model.eval()
    with torch.no_grad():
        assert rel(model(x), ref(x)) <= TOL
    assert not any(st.is_fetched(p) for p in model.parameters())
    off.close()


class KeepsRaw(nn.Module):
    """Its forward enters saved-tensor hooks that keep what they are given as
    it is (where torch.utils.checkpoint keeps recomputed tensors), and
    multiplies by a view of its own weight made before them: the view
    reaches those hooks, never strata's pack."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32) / 32 ** 0.5)
        self.lin = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        wt = self.w.t()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            h = torch.tanh(x @ wt)
        return self.lin(h)


def test_hooks_entered_inside_a_forward_keep_its_groups():
    """Its group stays until its gradients: with room for two groups, the
    next layer's fetch would otherwise take w's released memory, and the
    backward of x @ wt would read that layer's values (under the strict
    tier, NaN)."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32, bias=False), KeepsRaw(), nn.Tanh(), nn.Linear(32, 32, bias=False))

    x = torch.randn(4, 32)
    ref = make()
    opt = oracle.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    model = make()
    cfg = config()
    cfg["zero_optimization"].update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    cfg["strata"] = {"device_budget": 2 * 8192}  # two groups (4 KiB of weights, 8 KiB on the device)
    off = st.offload_module(model, cfg, force_no_gpu=True)
    for m, o in ((ref, opt), (model, off.optimizer)):
        for _ in range(3):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    got = off.state_dict()
    for k, v in ref.state_dict().items():
        assert rel(got[k], v) <= TOL, (k, rel(got[k], v))
    assert off.engine.stats()["device"]["peak"] <= 2 * 8192
    off.close()


def test_use_outside_every_forward(tmp_path):
    """A weight read by the training loop itself (no module's forward runs)."""
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    model = copy.deepcopy(ref)
    x = torch.randn(5, 6)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    off = st.offload_module(model, config(tmp_path), force_no_gpu=True)
    for m, o in ((ref, opt), (model, off.optimizer)):
        for _ in range(STEPS):
            h = m(x)
            loss = F.linear(h, m[0].weight).square().mean()  # outside any forward
            loss.backward()
            o.step()
            o.zero_grad()
    got = off.state_dict()
    for k, v in ref.state_dict().items():
        assert rel(got[k], v) <= TOL, k
    off.close()


def test_a_forward_returning_its_own_weight(tmp_path):
    """A module whose output is (a view of) its own parameter: the group stays
    fetched while the caller uses it."""

    class Pos(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(10, 4))

        def forward(self, n):
            return self.table[:n]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos, self.lin = Pos(), nn.Linear(4, 4)

        def forward(self, x):
            p = self.pos(x.shape[0])
            return self.lin(x + p) * p.sum()

    torch.manual_seed(2)
    ref = Net()
    model = copy.deepcopy(ref)
    x = torch.randn(6, 4)
    off = st.offload_module(model, config(), force_no_gpu=True)
    with torch.no_grad():
        assert rel(model(x), ref(x)) == 0.0
    off.close()


def test_in_place_changes_are_refused_naming_the_parameter():
    model = nn.Sequential(nn.Linear(3, 3))
    off = st.offload_module(model, config(), force_no_gpu=True)
    with torch.no_grad():
        with pytest.raises(strata.Error, match=r"0\.weight.*in place"):
            model[0].weight.add_(1.0)
        with pytest.raises(strata.Error, match=r"0\.bias.*in place"):
            nn.init.zeros_(model[0].bias)
    with pytest.raises(strata.Error, match=r"0\.weight"):
        model[0].weight.data = torch.zeros(3, 3)
    # Values and metadata still read right.
    assert model[0].weight.shape == (3, 3) and model[0].weight.requires_grad
    off.close()
    assert type(model[0].weight) is nn.Parameter


def test_torch_compile_is_refused_naming_it():
    if not hasattr(torch, "compile"):
        pytest.skip(f"torch {torch.__version__} has no torch.compile")
    model = nn.Sequential(nn.Linear(3, 3))
    off = st.offload_module(model, config(), force_no_gpu=True)
    with pytest.raises(strata.Error, match="torch.compile"):
        torch.compile(model)
    if hasattr(model, "compile"):
        with pytest.raises(strata.Error, match="torch.compile"):
            model.compile()
    off.close()
    torch.compile(model)  # after close, an ordinary module again


# ---- OffloadAdam: torch's rule for a parameter without a gradient ------------

def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_adam_frozen_and_unfrozen_follow_torch_bitwise(tmp_path, device):
    ref, mod = small(), small()
    for m in (ref, mod):
        for p in m[0].parameters():
            p.requires_grad_(False)
    x = torch.randn(32, 8)
    o1 = oracle.AdamW(ref.parameters(), lr=LR)
    dev = {"device": "cpu"} if device == "cpu" else {"device": "nvme", "nvme_path": str(tmp_path)}
    o2 = st.OffloadAdam(mod.parameters(), lr=LR, force_no_gpu=True,
                        config={"zero_optimization": {"stage": 1, "offload_optimizer": dev}})
    frozen_bias = mod[0].bias.detach().clone()
    for step in range(6):
        if step == 3:  # unfreeze one, freeze another, mid-run
            for m in (ref, mod):
                m[0].weight.requires_grad_(True)
                m[3].bias.requires_grad_(False)
        for m, o in ((ref, o1), (mod, o2)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for (k, a), b in zip(ref.state_dict().items(), mod.state_dict().values()):
        assert torch.equal(a, b), k
    assert torch.equal(frozen_bias, mod[0].bias), "a frozen parameter changed"
    sa, sb = o1.state_dict()["state"], o2.state_dict()["state"]
    assert sorted(sa) == sorted(sb), "state for a parameter that never had a gradient"
    for k in sa:
        assert float(sa[k]["step"]) == float(sb[k]["step"]), k
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) and torch.equal(sa[k]["exp_avg_sq"],
                                                                               sb[k]["exp_avg_sq"])
    o2.close()


# ---- bad input -----------------------------------------------------------------

def nvme(path):
    return {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": path}}}


def test_missing_nvme_path_is_refused_never_created(tmp_path):
    missing = str(tmp_path / "not-mounted")
    with pytest.raises(strata.Error, match="not-mounted"):
        st.OffloadAdam(nn.Linear(2, 2).parameters(), config=nvme(missing))
    with pytest.raises(strata.Error, match="not-mounted"):
        st.offload_module(nn.Linear(2, 2), nvme(missing))
    assert not (tmp_path / "not-mounted").exists()


def test_duplicate_parameter_is_refused():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="more than once"):
        st.OffloadAdam([lin.weight, lin.bias, lin.weight], config={})
    with pytest.raises(ValueError, match="more than once|more than one parameter group"):  # torch's own
        st.OffloadAdam([{"params": [lin.weight]}, {"params": [lin.weight, lin.bias]}], config={})


def test_float64_is_refused_naming_the_parameter():
    with pytest.raises(strata.Error, match="weight.*float64"):
        st.OffloadAdam(nn.Linear(2, 2).double().named_parameters(), config={})
    with pytest.raises(strata.Error, match="weight.*float64"):
        st.offload_module(nn.Linear(2, 2).double(), {})


def test_a_dtype_the_config_does_not_compute_in_is_refused():
    # OffloadAdam copies the engine's compute copy back into the parameters:
    # bf16 compute into float32 parameters would round them behind the user.
    with pytest.raises(strata.Error, match="weight.*float32"):
        st.OffloadAdam(nn.Linear(2, 2).named_parameters(), config={"bf16": {"enabled": True}})
    # offload_module: a bf16 model under float32 compute would run in float32.
    with pytest.raises(strata.Error, match="weight.*bfloat16"):
        st.offload_module(nn.Linear(2, 2).bfloat16(), {})


def test_sparse_gradients_are_refused_naming_the_parameter():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = st.OffloadAdam(emb.named_parameters(), config={}, force_no_gpu=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(strata.Error, match="weight.*sparse"):
        opt.step()
    opt.close()
    with pytest.raises(strata.Error, match="weight.*sparse"):
        st.offload_module(nn.Embedding(10, 3, sparse=True), {})


# ---- the torch 2.x Optimizer API ---------------------------------------------

def test_optimizer_api_hooks_keys_and_torch_interop(tmp_path):
    """Step hooks run; state_dict has torch AdamW's keys; a torch AdamW
    state_dict loads into OffloadAdam and training goes on bitwise, and back."""
    ref, mod = small(), small()
    x = torch.randn(32, 8)
    o1 = oracle.AdamW(ref.parameters(), lr=LR, foreach=True if hasattr(torch, "_foreach_lerp_") else None)
    cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    o2 = st.OffloadAdam(mod.parameters(), lr=LR, foreach=True, force_no_gpu=True, config=cfg)
    calls = []
    if hasattr(o2, "register_step_pre_hook"):
        o2.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
        o2.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    sched = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=LR, total_steps=8)
    sched_ref = torch.optim.lr_scheduler.OneCycleLR(o1, max_lr=LR, total_steps=8)

    def one(m, o, s):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
        s.step()

    for _ in range(2):
        one(ref, o1, sched_ref)
        one(mod, o2, sched)
    if hasattr(o2, "register_step_pre_hook"):
        assert calls == ["pre", "post"] * 2
    a, b = o1.state_dict(), o2.state_dict()
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        assert set(b["state"][k]) - set(a["state"][k]) == {"master_param"}, "torch's keys, and the masters"
    assert set(a["param_groups"][0]) <= set(b["param_groups"][0])
    # torch's state into OffloadAdam: go on bitwise.
    o2.load_state_dict(copy.deepcopy(a))
    for _ in range(2):
        one(ref, o1, sched_ref)
        one(mod, o2, sched)
    for (k, v), w in zip(ref.state_dict().items(), mod.state_dict().values()):
        assert torch.equal(v, w), k
    # And ours into torch's.
    o3 = torch.optim.AdamW(mod.parameters(), lr=LR)
    o3.load_state_dict(o2.state_dict())
    assert all(torch.equal(o3.state_dict()["state"][k]["exp_avg"], o1.state_dict()["state"][k]["exp_avg"])
               for k in a["state"])
    o2.close()


def test_unsupported_adamw_arguments_are_refused():
    ps = list(nn.Linear(2, 2).parameters())
    for kw in ({"amsgrad": True}, {"fused": True}, {"capturable": True}, {"differentiable": True}):
        with pytest.raises(strata.Error, match=list(kw)[0]):
            st.OffloadAdam(ps, config={}, **kw)


def test_maximize_follows_torch(tmp_path):
    ref, mod = small(), small()
    x = torch.randn(32, 8)
    o1 = oracle.AdamW(ref.parameters(), lr=LR, maximize=True)
    o2 = st.OffloadAdam(mod.parameters(), lr=LR, maximize=True, force_no_gpu=True, config={})
    for m, o in ((ref, o1), (mod, o2)):
        for _ in range(3):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for (k, v), w in zip(ref.state_dict().items(), mod.state_dict().values()):
        assert torch.equal(v, w), k
    o2.close()


def test_module_to_reads_nothing_and_the_state_round_trips():
    """Module.to() (Trainer and accelerate.prepare call it) asks only metadata;
    the optimizer's state_dict then loads back (accelerate does that)."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    off = st.offload_module(m, config(), force_no_gpu=True)
    m.to("cpu")
    m.to(torch.float32)
    assert not any(st.is_fetched(p) for p in m.parameters())
    m[1].weight.sum()  # a read outside every forward holds its group...
    assert st.is_fetched(m[1].weight)
    off.optimizer.load_state_dict(off.optimizer.state_dict())  # ...which a state load lets go
    assert not any(st.is_fetched(p) for p in m.parameters())
    off.close()


def test_another_optimizer_on_offloaded_parameters_is_refused():
    """torch's AdamW would see no gradients (they go to the engine) and step
    nothing, without a word: refused at construction, naming the parameter."""
    m = nn.Sequential(nn.Linear(4, 4))
    off = st.offload_module(m, config(), force_no_gpu=True)
    with pytest.raises(strata.Error, match=r"0\.weight.*off\w*\.optimizer|0\.weight.*\.optimizer"):
        torch.optim.AdamW(m.parameters())
    with pytest.raises(strata.Error, match=r"0\.weight"):
        st.OffloadAdam(m.parameters(), config={})
    off.close()
    torch.optim.AdamW(m.parameters())  # after close, ordinary parameters


def _twins(cls, seed):
    """A model of `cls` and its copy: the reference with torch's AdamW, the
    copy offloaded; and one input (5 x 6)."""
    torch.manual_seed(seed)
    ref = cls()
    model = copy.deepcopy(ref)
    x = torch.randn(5, 6)
    o1 = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    return ref, model, x, o1, st.offload_module(model, config(), force_no_gpu=True)


def test_a_parameter_without_a_gradient_in_a_group_that_has_some_goes_with_zeros():
    """One parameter of a group (a Linear's bias) gets no gradient in a step
    while the other does: the group goes to the engine with zeros for it,
    as torch's AdamW steps a parameter whose .grad is zeros (the staging
    buffer is not zero-filled first: the unwritten part must be zeroed, not
    left as whatever the allocator held, such as the last step's gradients)."""

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x, bias):
            return self.lin(x) if bias else nn.functional.linear(x, self.lin.weight)

    ref, model, x, o1, off = _twins(Lin, seed=4)
    plan = [True, True, False, True, False, False]
    for m, o in ((ref, o1), (model, off.optimizer)):
        for bias in plan:
            m(x, bias).square().mean().backward()
            if m is ref and not bias:
                ref.lin.bias.grad = torch.zeros_like(ref.lin.bias)
            o.step()
            o.zero_grad()
    got = off.state_dict()
    for k, v in ref.state_dict().items():
        assert rel(got[k], v) <= TOL, (k, rel(got[k], v))
    off.close()


def test_offload_module_skips_what_gets_no_gradient_as_torch():
    """A module unused in a step, and one frozen mid-run, are left alone
    (no decay, moments and step count kept), as torch AdamW leaves a
    parameter whose .grad is None; unfrozen again, it goes on from its count."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

        def forward(self, x, use_b):
            h = torch.tanh(self.a(x))
            return self.b(h) if use_b else h

    ref, model, x, o1, off = _twins(Two, seed=3)
    plan = [True, False, True, "freeze-a", True, "unfreeze-a", True]
    for m, o in ((ref, o1), (model, off.optimizer)):
        for what in plan:
            if what == "freeze-a":
                m.a.requires_grad_(False)
            if what == "unfreeze-a":
                m.a.requires_grad_(True)
            m(x, use_b=what is not False).square().mean().backward()
            o.step()
            o.zero_grad()
    got = off.state_dict()
    for k, v in ref.state_dict().items():
        assert rel(got[k], v) <= TOL, (k, rel(got[k], v))
    sa, sb = o1.state_dict()["state"], off.optimizer.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert float(sa[k]["step"]) == float(sb[k]["step"]), (k, sa[k]["step"], sb[k]["step"])
    off.close()
