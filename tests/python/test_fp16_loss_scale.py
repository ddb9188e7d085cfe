"""fp16 loss scaling through strata.torch. With fp16 a step divides the
gradients by the loss scale (DeepSpeed's semantics), so the loss must be
multiplied by it: `backward(loss)` / `scale_loss(loss)` on offload_module,
its optimizer and OffloadAdam do it, and a backward from an unscaled loss is
refused unless `loss_scaled=True` says the code scales it itself.

Oracle: torch's own fp16 training — an fp16 model, float32 masters stepped
by torch.optim.AdamW (its sqrt correctly rounded: oracle.py) with .grad =
fp16 grad.float() times the float32 1/scale (GradScaler's unscale), the
step skipped when a gradient overflowed, DeepSpeed's dynamic scaler
(written here from docs/config.md) — bitwise:
masters, fp16 parameters, moments, clip norms, the scale before every step
and which steps were skipped. The models: an MLP over an embedding written
with broadcast products (torch 1.13 has no fp16 matmul, tanh or relu on the
CPU: it runs on both torches) and, on torch 2, the tied-head GPT of
tiny_gpt.py."""
import copy
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402
from tiny_gpt import TinyGpt, batches as gpt_batches, loss_of as gpt_loss  # noqa: E402

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
LR, WD, STEPS = 3e-3, 0.01, 7
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.999], "eps": 1e-8}}
# The scale doubles after 2 clean steps; one overflow halves it.
FP16 = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 1}
VOCAB = 23


class BLinear(nn.Module):
    """nn.Linear's arithmetic as a broadcast product and a sum."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / math.sqrt(n_in))
        self.bias = nn.Parameter(torch.full((n_out,), 0.01))

    def forward(self, x):
        return (x.unsqueeze(-2) * self.weight).sum(-1) + self.bias


class HalfMlp(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 8)
        self.fc1 = BLinear(8, 16)
        self.fc2 = BLinear(16, 1)

    def forward(self, idx):
        h = self.fc1(self.emb(idx).sum(1))
        h = torch.where(h > 0, h, h * 0.125)  # leaky ReLU
        return self.fc2(h).squeeze(-1)


def mlp_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (4, 3), generator=g), torch.randn(4, generator=g).half()) for _ in range(n)]


def mlp_loss(model, x, y):
    return (model(x) - y).square().mean()


class Case:
    def __init__(self, make, data, loss, inf_param):
        self.make, self.data, self.loss, self.inf_param = make, data, loss, inf_param


CASES = {"mlp": lambda: Case(HalfMlp, mlp_batches(STEPS), mlp_loss, "fc2.bias")}
if TORCH2:  # fp16 matmul, softmax, layer_norm on the CPU
    CASES["gpt"] = lambda: Case(TinyGpt, gpt_batches(STEPS, 2), gpt_loss, "ln_f.bias")


def nonzero_wd(model):
    """Two param groups (two OffloadAdam engines): the biases without decay."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


class RefScaler:
    """DeepSpeed's dynamic loss scaler (DynamicLossScaler.update_scale,
    consecutive_hysteresis False) as docs/config.md states it: the first
    hysteresis - 1 overflows only count down, every later one halves, until
    a doubling gives the counter back."""

    def __init__(self, fp16):
        self.scale = 2.0 ** fp16.get("initial_scale_power", 16)
        self.window, self.hysteresis = fp16.get("loss_scale_window", 1000), fp16.get("hysteresis", 2)
        self.min_scale = fp16.get("min_loss_scale", 1.0)
        self.left, self.clean = self.hysteresis, 0

    def update(self, overflow):
        if overflow:
            self.clean = 0
            if self.left > 1:
                self.left -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
        else:
            self.clean += 1
            if self.clean >= self.window:
                self.scale, self.clean, self.left = self.scale * 2, 0, self.hysteresis


def with_inf(model, name, on):
    """At the steps in `on`, the gradient of parameter `name` overflows."""
    return model.get_parameter(name).register_hook(lambda g: torch.full_like(g, float("inf"))) if on else None


class Run:
    def __init__(self):
        self.scales, self.skipped, self.norms = [], [], []


def torch_fp16(case, clip=None, groups=None, inf_at=()):
    """The oracle."""
    model = case.make().half()
    masters = {p: p.detach().float().clone().requires_grad_() for p in model.parameters()}
    spec = groups(model) if groups else [{"params": list(model.parameters())}]
    opt = oracle.AdamW([dict(g, params=[masters[p] for p in g["params"]]) for g in spec], lr=LR,
                       weight_decay=WD)
    scaler, run = RefScaler(FP16), Run()
    for s, (x, y) in enumerate(case.data):
        run.scales.append(scaler.scale)
        hook = with_inf(model, case.inf_param, s in inf_at)
        (case.loss(model, x, y).float() * scaler.scale).backward()
        if hook is not None:
            hook.remove()
        overflow = not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        if not overflow:
            for p, m in masters.items():
                m.grad = unscaled(p.grad, scaler.scale)
            if clip is not None:
                run.norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)))
            opt.step()
            with torch.no_grad():
                for p, m in masters.items():
                    p.copy_(m)
        scaler.update(overflow)
        run.skipped.append(overflow)
        model.zero_grad(set_to_none=True)
    run.model, run.opt = model, opt
    run.masters = {n: masters[p].detach() for n, p in model.named_parameters()}
    return run


def scaled_backward(owner, loss, how):
    if how == "backward":
        owner.backward(loss)
    elif how == "scale_loss":
        owner.scale_loss(loss).backward()
    else:  # "manual", with loss_scaled=True
        (loss.float() * owner.loss_scale).backward()


def offload_adam_fp16(case, clip=None, groups=None, inf_at=(), how="backward"):
    model = case.make().half()
    opt = st.OffloadAdam(groups(model) if groups else model.parameters(), lr=LR, weight_decay=WD,
                         config={"fp16": FP16}, force_no_gpu=True, loss_scaled=how == "manual")
    run = Run()
    for s, (x, y) in enumerate(case.data):
        run.scales.append(opt.loss_scale)
        hook = with_inf(model, case.inf_param, s in inf_at)
        scaled_backward(opt, case.loss(model, x, y), how)
        if hook is not None:
            hook.remove()
        if clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        skipped = {k for _, k in opt.last_results}
        assert len(skipped) == 1, ("engines disagree on skipping", opt.last_results)
        run.skipped.append(skipped.pop())
        if clip is not None and not run.skipped[-1]:
            run.norms.append(norm)
        opt.zero_grad()
    run.model, run.opt = model, opt
    sd = opt.state_dict()
    order = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    run.masters = {names[id(order[i])]: s["master_param"] for i, s in sd["state"].items()}
    run.state = sd
    return run


# The overlapped step speculating (its early updates undone on a skipped
# step, redone on a clipped one): strata.speculation "always", since "auto"
# never speculates without a GPU with the state in host memory.
SPECULATE = {"speculation": "always"}


def offload_module_fp16(case, clip=None, inf_at=(), how="backward", via="module", overlap=None):
    model = case.make().half()
    off = st.offload_module(model, {"fp16": FP16, "optimizer": copy.deepcopy(ADAMW), "strata": SPECULATE},
                            force_no_gpu=True, loss_scaled=how == "manual", overlap_step=overlap)
    opt = off.optimizer
    run = Run()
    for s, (x, y) in enumerate(case.data):
        run.scales.append(off.loss_scale)
        assert opt.loss_scale == off.loss_scale == off.engine.loss_scale
        hook = with_inf(model, case.inf_param, s in inf_at)
        scaled_backward(off if via == "module" else opt, case.loss(model, x, y), how)
        if hook is not None:
            hook.remove()
        if clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        run.skipped.append(opt.last_result[1])
        if clip is not None and not run.skipped[-1]:
            run.norms.append(norm)
        opt.zero_grad()
    run.masters = off.master_parameters()
    run.state = opt.state_dict()
    run.stats = off.engine.stats()
    off.close()
    run.model = model
    return run


def assert_same(got, ref, what):
    bad = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not bad, f"{what} differ from torch's: {bad}"


def assert_trained_like_torch(got, ref):
    assert got.scales == ref.scales, ("loss scale before each step", got.scales, ref.scales)
    assert got.skipped == ref.skipped, ("skipped steps", got.skipped, ref.skipped)
    assert any(ref.skipped) and not all(ref.skipped), ("the run must have overflows and steps", ref.skipped)
    assert got.norms == ref.norms, ("clip_grad_norm_", got.norms, ref.norms)
    assert_same(got.masters, ref.masters, "master weights")
    assert_same(dict(got.model.named_parameters()), dict(ref.model.named_parameters()), "fp16 parameters")
    # The moments, by the state_dict's numbering (param_groups order in both).
    theirs = ref.opt.state_dict()["state"]
    mine = got.state["state"]
    assert sorted(mine) == sorted(theirs)
    for i in theirs:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[i][k].reshape(-1), theirs[i][k].reshape(-1)), (i, k)
        assert float(mine[i]["step"]) == float(theirs[i]["step"]) == ref.skipped.count(False)


# ---- the scale, at any time ---------------------------------------------------

def engine_fp16(fp16):
    e = strata.Engine({"fp16": fp16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
    e.add_param(0, "w", torch.ones(8))
    e.build()
    return e


def test_engine_loss_scale_before_the_first_step_and_after_overflows():
    with strata.Engine({"optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True) as e:
        assert e.loss_scale == 1.0  # no fp16
    with engine_fp16({"enabled": True, "loss_scale": 96}) as e:
        assert e.loss_scale == 96.0  # static
    with engine_fp16({"enabled": True, "initial_scale_power": 12, "hysteresis": 2, "loss_scale_window": 3}) as e:
        assert e.loss_scale == 2.0 ** 12, "the first loss's scale, before any step"
        scales = []
        inf, nan = float("inf"), float("nan")
        for g in (inf, inf, inf, 1.0, 1.0, 1.0, nan, inf, inf):
            e.grads(0, torch.full((8,), g, dtype=torch.float16))
            _, skipped = e.step()
            assert skipped == (not math.isfinite(g))
            assert e.loss_scale == e.last_loss_scale
            scales.append(e.loss_scale)
        # hysteresis 2: the first overflow only counts down, the second and
        # every one after it halves (DeepSpeed's); 3 clean steps double and
        # give the counter back: the next overflow only counts down again,
        # the ones after it halve. (The old rule refilled the counter at each
        # halving: 4096, 2048, 2048, ..., 4096, 4096, 2048, 2048.)
        assert scales == [4096.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 512.0], scales
        ref = RefScaler({"initial_scale_power": 12, "hysteresis": 2, "loss_scale_window": 3})
        oracle_scales = []
        for g in (inf, inf, inf, 1.0, 1.0, 1.0, nan, inf, inf):
            ref.update(not math.isfinite(g))
            oracle_scales.append(ref.scale)
        assert oracle_scales == scales, "the test's oracle is the engine's rule"
        assert e.steps == 3


@pytest.mark.parametrize("entry", ["offload_module", "OffloadAdam"])
def test_loss_scale_before_the_first_step_and_halved_by_an_overflow(entry):
    fp16 = {"enabled": True, "initial_scale_power": 13, "hysteresis": 1}
    model = HalfMlp().half()
    if entry == "offload_module":
        off = st.offload_module(model, {"fp16": fp16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
        owners, opt = (off, off.optimizer), off.optimizer
    else:
        opt = st.OffloadAdam(nonzero_wd(model), lr=LR, config={"fp16": fp16}, force_no_gpu=True)
        owners = (opt,)
    assert [o.loss_scale for o in owners] == [2.0 ** 13] * len(owners)
    x, y = mlp_batches(1)[0]
    hook = with_inf(model, "fc1.bias", True)
    owners[0].backward(mlp_loss(model, x, y))
    hook.remove()
    opt.step()
    opt.zero_grad()
    assert [o.loss_scale for o in owners] == [2.0 ** 12] * len(owners)
    owners[-1].backward(mlp_loss(model, x, y))
    opt.step()
    assert [o.loss_scale for o in owners] == [2.0 ** 12] * len(owners)  # window 1000: no doubling yet
    if entry == "offload_module":
        off.close()
    else:
        assert opt.state_dict()["loss_scaler"] == {"scale": 2.0 ** 12, "hysteresis_left": 1, "clean_steps": 1}
        opt.close()


@pytest.mark.parametrize("entry", ["offload_module", "OffloadAdam"])
def test_hysteresis_2_halves_every_overflow_after_the_first_until_a_doubling(entry):
    # DeepSpeed's DynamicLossScaler: 6 overflows in a row from 2^16 with
    # hysteresis 2: the first only counts down, each later one halves (the
    # old rule, refilling the counter at each halving, gave 2^16, 2^15,
    # 2^15, 2^14, 2^14, 2^13). A doubling (2 clean steps) gives the counter
    # back: the next overflow counts down, the one after halves.
    # offload_module runs the engine's C++ scaler, OffloadAdam its own.
    fp16 = {"enabled": True, "hysteresis": 2, "loss_scale_window": 2}
    model = HalfMlp().half()
    if entry == "offload_module":
        off = st.offload_module(model, {"fp16": fp16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
        owner, opt = off, off.optimizer
    else:
        opt = owner = st.OffloadAdam(model.parameters(), lr=LR, config={"fp16": fp16}, force_no_gpu=True)
    x, y = mlp_batches(1)[0]
    plan = [True] * 6 + [False, False, True, True]
    scales, skipped = [], []
    for overflow in plan:
        hook = with_inf(model, "fc1.bias", overflow)
        owner.backward(mlp_loss(model, x, y))
        if hook is not None:
            hook.remove()
        opt.step()
        skipped.append(opt.last_result[1] if entry == "offload_module" else opt.last_results[0][1])
        opt.zero_grad()
        scales.append(owner.loss_scale)
    assert skipped == plan, skipped
    expected = [2.0 ** k for k in (16, 15, 14, 13, 12, 11)] + [2.0 ** 11, 2.0 ** 12, 2.0 ** 12, 2.0 ** 11]
    assert scales == expected, [math.log2(s) for s in scales]
    ref = RefScaler(fp16)
    for overflow in plan:
        ref.update(overflow)
    assert ref.scale == expected[-1]
    if entry == "offload_module":
        off.close()
    else:
        assert opt.state_dict()["loss_scaler"] == {"scale": 2.0 ** 11, "hysteresis_left": 1, "clean_steps": 0}
        opt.close()


TINY = 2.0 ** -24  # the smallest loss scale the engine takes: 1/scale stays finite in float


@pytest.mark.parametrize("entry", ["offload_module", "OffloadAdam"])
@pytest.mark.parametrize("key,value", [("min_loss_scale", 0), ("min_loss_scale", 0.0), ("min_loss_scale", 1e-9),
                                       ("loss_scale", 1e-9), ("loss_scale", TINY / 2)])
def test_a_loss_scale_below_2_to_the_minus_24_is_refused(entry, key, value):
    # With min_loss_scale 0 a run of overflows halves the scale until
    # 1/scale overflows float, and the next finite step writes NaN into
    # every weight; a static scale that small does so at once. The engine's
    # config refuses both (offload_module); OffloadAdam's own scaler (its
    # engines run at a static scale of 1) refuses them in the same words.
    fp16 = {"enabled": True, key: value}
    model = HalfMlp().half()
    with pytest.raises(strata.Error) as e:
        if entry == "offload_module":
            st.offload_module(model, {"fp16": fp16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
        else:
            st.OffloadAdam(model.parameters(), lr=LR, config={"fp16": fp16}, force_no_gpu=True)
    msg = str(e.value)
    assert e.value.status_name == "CONFIG", (e.value.status_name, msg)
    head, _, tail = msg.partition(f"fp16.{key}: ")
    shown, _, tail = tail.partition(" ")
    assert float(shown) == value, msg  # (the engine's shortest form may end otherwise than repr's)
    assert tail.startswith("is below 2^-24 (5.96e-08): the step's unscale factor 1/scale would overflow float and "
                           "write NaN into the weights"), msg
    assert "allowed: 2^-24 or more" in tail, msg
    assert ("(0: dynamic)" in msg) == (key == "loss_scale"), msg


@pytest.mark.parametrize("entry", ["offload_module", "OffloadAdam"])
@pytest.mark.parametrize("fp16", [{"min_loss_scale": TINY}, {"loss_scale": TINY}, {"loss_scale": 0}],
                         ids=["min_loss_scale=2^-24", "loss_scale=2^-24", "loss_scale=0"])
def test_a_loss_scale_of_2_to_the_minus_24_and_a_dynamic_one_are_taken(entry, fp16):
    fp16 = dict(fp16, enabled=True)
    model = HalfMlp().half()
    if entry == "offload_module":
        off = st.offload_module(model, {"fp16": fp16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
        assert off.loss_scale == (TINY if fp16.get("loss_scale") else 2.0 ** 16)
        off.close()
    else:
        opt = st.OffloadAdam(model.parameters(), lr=LR, config={"fp16": fp16}, force_no_gpu=True)
        assert opt.loss_scale == (TINY if fp16.get("loss_scale") else 2.0 ** 16)
        opt.close()


def unscaled(grad, scale):
    """An fp16 gradient of the loss times `scale`, unscaled as the engine,
    DeepSpeed and torch's GradScaler do: times the float32 reciprocal."""
    return grad.float() * torch.tensor(1.0 / scale, dtype=torch.float32)


@pytest.mark.parametrize("scale", [1000, 96, 3])
def test_a_static_loss_scale_unscales_alike_in_offload_adam_and_offload_module(scale):
    # The engine (offload_module) multiplies the gradients by float(1/scale);
    # OffloadAdam divided .grad.float() by the scale: for a scale that is no
    # power of two, 1 ulp apart in a third to a half of the values, and the
    # weights apart after a step. Both now multiply by the float32
    # reciprocal (torch's GradScaler's and DeepSpeed's unscale).
    fp16 = {"enabled": True, "loss_scale": scale}
    a, b = HalfMlp().half(), HalfMlp().half()
    off = st.offload_module(a, {"fp16": fp16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
    opt = st.OffloadAdam(b.parameters(), lr=LR, weight_decay=WD, config={"fp16": fp16}, force_no_gpu=True)
    names = [n for n, _ in b.named_parameters()]
    apart = 0
    for x, y in mlp_batches(2):
        off.backward(mlp_loss(a, x, y))
        off.optimizer.step()
        off.optimizer.zero_grad()
        opt.backward(mlp_loss(b, x, y))
        for p in b.parameters():
            apart += int((p.grad.float() / scale != unscaled(p.grad, scale)).sum())
        opt.step()
        opt.zero_grad()
        assert off.optimizer.last_result[1] is False and opt.last_results[0][1] is False
    assert apart > 0, "the gradients must tell division from the reciprocal's product"
    mine = opt.state_dict()["state"]
    assert_same({names[i]: s["master_param"] for i, s in mine.items()}, off.master_parameters(),
                "OffloadAdam's masters")
    assert_same(dict(b.named_parameters()), dict(a.named_parameters()), "fp16 parameters")
    theirs = off.optimizer.state_dict()["state"]
    for i in theirs:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[i][k].reshape(-1), theirs[i][k].reshape(-1)), (names[i], k)
    opt.close()
    off.close()


def test_without_fp16_nothing_is_scaled():
    model = HalfMlp()  # float32
    off = st.offload_module(model, {"optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
    x, y = mlp_batches(1)[0]
    loss = mlp_loss(model, x, y)
    assert off.loss_scale == 1.0 and off.scale_loss(loss) is loss
    loss.backward()  # no fp16: nothing to acknowledge
    off.optimizer.step()
    off.close()
    opt = st.OffloadAdam(HalfMlp().parameters(), config={}, force_no_gpu=True)
    assert opt.loss_scale == 1.0 and opt.scale_loss(loss) is loss
    assert "loss_scaler" not in opt.state_dict()
    opt.close()


# ---- against torch ------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("how", ["backward", "scale_loss", "manual"])
def test_offload_adam_fp16_is_torch_fp16_bitwise(name, how):
    case = CASES[name]()
    got = offload_adam_fp16(case, how=how, inf_at={3})
    assert_trained_like_torch(got, torch_fp16(case, inf_at={3}))
    got.opt.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_offload_adam_fp16_with_two_engines_skips_the_whole_step_and_clips_like_torch(name):
    # The biases (their own param group: their own engine) overflow alone
    # at step 3: torch skips the whole step, and so does every engine, and
    # the optimizer keeps one scale. Clipping: torch's over the unscaled
    # float32 gradients.
    case = CASES[name]()
    got = offload_adam_fp16(case, clip=0.05, groups=nonzero_wd, inf_at={3})
    ref = torch_fp16(case, clip=0.05, groups=nonzero_wd, inf_at={3})
    assert len(got.opt._engines) == 2
    assert ref.norms and any(n > 0.05 for n in ref.norms), ("the clip must apply", ref.norms)
    assert_trained_like_torch(got, ref)
    got.opt.close()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("how,via", [("backward", "module"), ("backward", "optimizer"), ("scale_loss", "module"),
                                     ("manual", "module")])
def test_offload_module_fp16_is_torch_fp16_bitwise(name, how, via):
    case = CASES[name]()
    got = offload_module_fp16(case, how=how, via=via, inf_at={3})
    ref = torch_fp16(case, inf_at={3})
    assert_same(got.masters, ref.masters, "master weights")
    assert got.scales == ref.scales and got.skipped == ref.skipped, (got.scales, ref.scales, got.skipped)
    assert any(ref.skipped) and not all(ref.skipped), ref.skipped
    if how == "backward" and via == "module":
        assert got.stats["speculated_steps"] >= 1, got.stats  # the default overlapped step took part


@pytest.mark.parametrize("name", sorted(CASES))
def test_offload_module_fp16_clips_the_unscaled_gradients_like_torch(name):
    case = CASES[name]()
    got = offload_module_fp16(case, clip=0.05, inf_at={3}, overlap=False)
    ref = torch_fp16(case, clip=0.05, inf_at={3})
    assert any(n > 0.05 for n in ref.norms), ("the clip must apply", ref.norms)
    assert got.norms == ref.norms, (got.norms, ref.norms)
    assert_same(got.masters, ref.masters, "master weights")
    assert got.skipped == ref.skipped


class CheckpointedMlp(HalfMlp):
    """fc1 under torch.utils.checkpoint: a reentrant one runs its own
    backward inside the scaled loss's."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx):
        import torch.utils.checkpoint
        h = torch.utils.checkpoint.checkpoint(self.fc1, self.emb(idx).sum(1), use_reentrant=self.reentrant)
        return self.fc2(torch.where(h > 0, h, h * 0.125)).squeeze(-1)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_offload_module_fp16_under_checkpoint(reentrant):
    case = Case(lambda: CheckpointedMlp(reentrant), mlp_batches(STEPS), mlp_loss, "fc2.bias")
    got, ref = offload_module_fp16(case, inf_at={3}), torch_fp16(case, inf_at={3})
    assert_same(got.masters, ref.masters, "master weights")
    assert got.skipped == ref.skipped and any(ref.skipped)
    model = case.make().half()
    off = st.offload_module(model, {"fp16": FP16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True)
    with pytest.raises(strata.Error, match="not scaled"):
        mlp_loss(model, *case.data[0]).backward()
    off.close()


# ---- two ranks ------------------------------------------------------------------

INF_RANK, INF_STEP = 1, 3  # fp16_ranks_worker.py: rank 1's biases overflow at step 3


def test_offload_adam_fp16_on_two_ranks_skips_together_and_is_torch_fp16_bitwise(tmp_path):
    # Only rank 1's gradients of one engine overflow: every engine of both
    # ranks skips that step, as torch skips it. The oracle: the mean of the
    # two ranks' unscaled float32 gradients (the engine's sum, halved).
    import subprocess
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from free_ports import free_port_block
    port = free_port_block(2)
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               STRATA_STORE_PORT=str(port + 1))
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp16_ranks_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(tmp_path / f"rank{r}.pt")],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    model = HalfMlp().half()
    masters = {p: p.detach().float().clone().requires_grad_() for p in model.parameters()}
    opt = oracle.AdamW([dict(g, params=[masters[p] for p in g["params"]]) for g in nonzero_wd(model)],
                       lr=LR, weight_decay=WD)
    scaler, scales, skipped = RefScaler(FP16), [], []
    data = [mlp_batches(STEPS, seed=10 + r) for r in range(2)]
    for s in range(STEPS):
        scales.append(scaler.scale)
        grads = []
        for r in range(2):
            hook = with_inf(model, "fc2.bias", r == INF_RANK and s == INF_STEP)
            (mlp_loss(model, *data[r][s]).float() * scaler.scale).backward()
            if hook is not None:
                hook.remove()
            grads.append({p: unscaled(p.grad, scaler.scale) for p in model.parameters()})
            model.zero_grad(set_to_none=True)
        overflow = not all(bool(torch.isfinite(g).all()) for gr in grads for g in gr.values())
        if not overflow:
            for p, m in masters.items():
                m.grad = (grads[0][p] + grads[1][p]) * 0.5
            opt.step()
            with torch.no_grad():
                for p, m in masters.items():
                    p.copy_(m)
        scaler.update(overflow)
        skipped.append(overflow)
    assert skipped[INF_STEP] and skipped.count(True) >= 1 and not all(skipped), skipped
    for r in range(2):
        assert got[r]["engines"] == 2
        assert got[r]["scales"] == scales, (r, got[r]["scales"], scales)
        assert got[r]["skipped"] == [[k, k] for k in skipped], (r, got[r]["skipped"], skipped)
        assert_same(got[r]["params"], dict(model.named_parameters()), f"rank {r}'s parameters")
        # The float32 state too (fp16 parameters hide most last-bit differences):
        # by the state_dict's numbering, param_groups order in both.
        theirs = opt.state_dict()["state"]
        in_order = [m for g in opt.param_groups for m in g["params"]]
        assert sorted(got[r]["state"]) == sorted(theirs)
        for i, s in theirs.items():
            assert torch.equal(got[r]["state"][i]["master_param"].reshape(-1), in_order[i].detach().reshape(-1)), \
                (r, i, "master_param")
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[r]["state"][i][k].reshape(-1), s[k].reshape(-1)), (r, i, k)


# ---- misuse -------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [None, False], ids=["overlapped", "not-overlapped"])
def test_offload_module_refuses_an_unscaled_backward_and_is_unharmed(overlap):
    case = CASES["mlp"]()
    ref = offload_module_fp16(case, overlap=overlap)
    model = case.make().half()
    off = st.offload_module(model, {"fp16": FP16, "optimizer": copy.deepcopy(ADAMW), "strata": SPECULATE},
                            force_no_gpu=True, overlap_step=overlap)
    for s, (x, y) in enumerate(case.data):
        if s in (0, 2, 5):
            with pytest.raises(strata.Error) as e:
                case.loss(model, x, y).backward()  # the silent mistake
            msg = str(e.value)
            assert e.value.status_name == "INVALID"
            for needle in ("fp16", "not scaled", "off.backward(loss)", "scale_loss", "loss_scaled=True",
                           f"{off.loss_scale:g} times too small"):
                assert needle in msg, (needle, msg)
            assert not any(st.is_fetched(p) for p in model.parameters())
        off.backward(case.loss(model, x, y))
        off.optimizer.step()
    # Nothing of the refused passes reached the engine.
    assert_same(off.master_parameters(), ref.masters, "master weights after refused backward passes")
    if overlap is None:
        assert off.engine.stats()["speculated_steps"] >= 1
    off.close()


def test_offload_module_refuses_an_unscaled_micro_batch():
    case = CASES["mlp"]()
    model = case.make().half()
    off = st.offload_module(model, {"fp16": FP16, "optimizer": copy.deepcopy(ADAMW)}, force_no_gpu=True,
                            grad_accumulation_steps=2)
    (x, y), (x2, y2) = case.data[:2]
    off.backward(case.loss(model, x, y))
    scaled = off.scale_loss(case.loss(model, x2, y2))  # scaled, but not the tensor backward runs from
    with pytest.raises(strata.Error, match="not scaled"):
        case.loss(model, x2, y2).backward()
    scaled.backward()
    off.optimizer.step()
    assert off.engine.steps == 1
    off.close()


def test_offload_adam_refuses_a_step_of_unscaled_gradients_and_changes_nothing():
    case = CASES["mlp"]()
    model = case.make().half()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = st.OffloadAdam(model.parameters(), lr=LR, config={"fp16": FP16}, force_no_gpu=True)
    x, y = case.data[0]
    case.loss(model, x, y).backward()
    for call in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), opt.step):
        with pytest.raises(strata.Error) as e:
            call()
        msg = str(e.value)
        for needle in ("fp16", "not scaled", "opt.backward(loss)", "scale_loss", "loss_scaled=True"):
            assert needle in msg, (needle, msg)
    assert_same(dict(model.named_parameters()), before, "parameters after a refused step")
    assert all(ge.engine.steps == 0 for ge in opt._engines)
    opt.zero_grad()
    opt.backward(case.loss(model, x, y))
    opt.step()
    opt.close()


def test_loss_scaled_must_be_a_bool():
    with pytest.raises(strata.Error, match="loss_scaled"):
        st.offload_module(HalfMlp().half(), {"fp16": FP16}, force_no_gpu=True, loss_scaled="yes")
    with pytest.raises(strata.Error, match="loss_scaled"):
        st.OffloadAdam(HalfMlp().half().parameters(), config={"fp16": FP16}, force_no_gpu=True, loss_scaled=None)


def test_offload_adam_loss_scaler_resumes_from_state_dict():
    case = CASES["mlp"]()
    whole = offload_adam_fp16(case, inf_at={1})
    model = case.make().half()
    opt = st.OffloadAdam(model.parameters(), lr=LR, weight_decay=WD, config={"fp16": FP16}, force_no_gpu=True)
    half = STEPS // 2
    for s, (x, y) in enumerate(case.data[:half]):
        hook = with_inf(model, case.inf_param, s == 1)
        opt.backward(case.loss(model, x, y))
        if hook is not None:
            hook.remove()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    opt.close()
    opt = st.OffloadAdam(model.parameters(), lr=LR, weight_decay=WD, config={"fp16": FP16}, force_no_gpu=True)
    opt.load_state_dict(sd)
    scales = whole.scales[:half]
    for x, y in case.data[half:]:
        scales.append(opt.loss_scale)
        opt.backward(case.loss(model, x, y))
        opt.step()
        opt.zero_grad()
    assert scales == whole.scales
    assert_same(dict(model.named_parameters()), dict(whole.model.named_parameters()), "parameters after resume")
    opt.close()
    whole.opt.close()
