"""clip_grad_norm_ at max_norm 0 and at infinity, as torch's.

torch's coefficient is max_norm / (norm + 1e-6), at most 1: max_norm 0
zeroes the gradients (coefficient 0; the step then only decays), infinity
clips nothing (the norm is still returned). The engine reads max_grad_norm
0 as "no clipping" and refuses infinity: offload_module's and OffloadAdam's
clip_grad_norm_ passed max_norm to it as it came, so 0 trained unclipped
(the reviewer's run: torch leaves 0.weight[0] at -0.0037434, Strata moved it
to +0.0062566) and infinity failed the step, INVALID "step option
max_grad_norm is inf", wherever the engine takes the norm itself
(grad_accumulation_steps > 1, several ranks).

Oracle: torch's clip_grad_norm_ then AdamW (oracle.py), bitwise: the
weights after each step, the moments (the gradients as the step took them:
exact zeros at max_norm 0), the norms (torch's own where strata computes them
as torch, the engine's double one within 1e-6 elsewhere).

Run as a script (MAX_NORM OUT), it is one rank of a two-rank test."""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata.torch as st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import oracle  # noqa: E402

LR, WD, STEPS = 1e-2, 0.01, 2
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.999], "eps": 1e-8}}
NORMS = [0.0, math.inf]
IDS = ["max_norm=0", "max_norm=inf"]


def make(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)).to(dtype)


def batch(step, micro=0, rank=0):
    g = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
    return torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def bits(t):
    return t.detach().float().reshape(-1).view(torch.int32)


def assert_bitwise(got, want, what):
    bad = [n for n in want if not torch.equal(bits(got[n]), bits(want[n]))]
    assert not bad, (what, {n: (got[n].reshape(-1)[:3].tolist(), want[n].reshape(-1)[:3].tolist()) for n in bad})


def torch_run(max_norm, micro=1, ranks=1):
    """torch: the gradients averaged over the backward passes (and ranks),
    clip_grad_norm_, AdamW; the weights after each step, the norms, the
    final moments."""
    model = make()
    opt = oracle.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    weights, norms = [], []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = None
        for r in range(ranks):
            model.zero_grad(set_to_none=True)
            for k in range(micro):
                loss_of(model, *batch(s, k, r)).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for p, g in zip(model.parameters(), total):
            p.grad = g / (micro * ranks) if micro * ranks > 1 else g
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)))
        if max_norm == 0:
            assert all(not bool(p.grad.any()) for p in model.parameters()), "torch's clip at 0 zeroes the gradients"
        opt.step()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    names = [n for n, _ in model.named_parameters()]
    moments = {names[i]: s for i, s in opt.state_dict()["state"].items()}
    return weights, norms, moments


def assert_moments(got_state, names, want):
    for i, s in got_state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(bits(s[k]), bits(want[names[i]][k])), (names[i], k)


def module_run(max_norm, micro=1, via_torch=True):
    model = make()
    off = st.offload_module(model, {"optimizer": dict(ADAMW)}, force_no_gpu=True, grad_accumulation_steps=micro)
    weights, norms = [], []
    for s in range(STEPS):
        for k in range(micro):
            loss_of(model, *batch(s, k)).backward()
        clip = torch.nn.utils.clip_grad_norm_ if via_torch else (lambda _, m: off.clip_grad_norm_(m))
        norms.append(float(clip(model.parameters(), max_norm)))
        off.optimizer.step()
        off.optimizer.zero_grad()
        weights.append(off.master_parameters())
    state = off.optimizer.state_dict()["state"]
    off.close()
    return weights, norms, state


@pytest.mark.parametrize("via_torch", [True, False], ids=["torch.nn.utils", "off.clip_grad_norm_"])
@pytest.mark.parametrize("max_norm", NORMS, ids=IDS)
def test_offload_module_one_backward_clips_at_0_and_inf_as_torch(max_norm, via_torch):
    # One backward a step: torch's norms and float32 coefficient; 0 must
    # reach the engine as a clip whose coefficient is exactly 0.
    got_w, got_n, got_state = module_run(max_norm, via_torch=via_torch)
    want_w, want_n, want_m = torch_run(max_norm)
    assert got_n == want_n, (got_n, want_n)
    for s in range(STEPS):
        assert_bitwise(got_w[s], want_w[s], f"step {s}'s weights")
    assert_moments(got_state, list(want_m), want_m)


@pytest.mark.parametrize("max_norm", NORMS, ids=IDS)
def test_offload_module_with_accumulation_clips_at_0_and_inf_as_torch(max_norm):
    # Two backward passes a step: the engine takes the norm (in double);
    # inf raised INVALID at the step, 0 trained unclipped.
    got_w, got_n, got_state = module_run(max_norm, micro=2)
    want_w, want_n, want_m = torch_run(max_norm, micro=2)
    assert got_n == pytest.approx(want_n, rel=1e-6, abs=0), (got_n, want_n)
    for s in range(STEPS):
        assert_bitwise(got_w[s], want_w[s], f"step {s}'s weights")
    assert_moments(got_state, list(want_m), want_m)


def test_offload_module_at_0_is_not_unclipped():
    # The reviewer's numbers: torch leaves 0.weight[0] at -0.0037434 after
    # one step with clip_grad_norm_(…, 0.0); unclipped it moves to
    # +0.0062566.
    got_w, _, _ = module_run(0.0)
    want_w, _, _ = torch_run(0.0)
    assert float(got_w[0]["0.weight"].reshape(-1)[0]) == float(want_w[0]["0.weight"].reshape(-1)[0])
    assert abs(float(want_w[0]["0.weight"].reshape(-1)[0]) - (-0.0037434)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("max_norm", NORMS, ids=IDS)
def test_offload_adam_one_rank_clips_at_0_and_inf_as_torch(max_norm, dtype):
    # fp32: torch's own function on .grad; fp16: torch's norms of the
    # unscaled float32 gradients and its coefficient, applied at the step.
    # (fp16 gradients are made from a float32 model's: torch 1.13 has no
    # fp16 matmul on the CPU.)
    fp16 = dtype == torch.float16
    model = make(dtype)
    config = {"fp16": {"enabled": True, "loss_scale": 1024}} if fp16 else {}
    opt = st.OffloadAdam(model.parameters(), lr=LR, weight_decay=WD, config=config, force_no_gpu=True,
                         loss_scaled=fp16)
    ref = make()
    with torch.no_grad():  # torch's fp16 training: float32 masters of the fp16 model
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q.float())
    ref_opt = oracle.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    names = [n for n, _ in ref.named_parameters()]
    for s in range(STEPS):
        x, y = batch(s)
        if fp16:
            loss_of(ref, x, y).backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                p.grad = (q.grad * 1024).half()
                q.grad = p.grad.float() / 1024
        else:
            loss_of(model, x, y).backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = p.grad.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
        assert norm == float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm))
        ref_opt.step()
        ref_opt.zero_grad()
        state = opt.state_dict()["state"]
        got = {names[i]: st_["master_param"] for i, st_ in state.items()} if fp16 else dict(model.named_parameters())
        assert_bitwise(got, dict(ref.named_parameters()), f"step {s}'s weights")
    assert_moments(opt.state_dict()["state"], names, {names[i]: s for i, s in ref_opt.state_dict()["state"].items()})
    opt.close()


# ---- two ranks: the engine's norm --------------------------------------------------

def _rank(max_norm, out):
    rank = int(os.environ["RANK"])
    model = make()
    opt = st.OffloadAdam(model.parameters(), lr=LR, weight_decay=WD, force_no_gpu=True,
                         config={"strata": {"timeout": 60}})
    res = {"weights": [], "norms": []}
    for s in range(STEPS):
        loss_of(model, *batch(s, 0, rank)).backward()
        res["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        res["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    res["state"] = opt.state_dict()["state"]
    opt.close()
    torch.save(res, out)


@pytest.mark.parametrize("max_norm", NORMS, ids=IDS)
def test_offload_adam_two_ranks_clips_at_0_and_inf_as_torch(tmp_path, max_norm):
    from two_ranks import run_two_ranks
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    run_two_ranks(lambda r: [sys.executable, os.path.abspath(__file__), repr(max_norm), str(outs[r])], 300)
    got = [torch.load(o) for o in outs]
    want_w, want_n, want_m = torch_run(max_norm, ranks=2)
    names = list(want_m)
    for r in range(2):
        assert got[r]["norms"] == pytest.approx(want_n, rel=1e-6, abs=0), (r, got[r]["norms"], want_n)
        for s in range(STEPS):
            assert_bitwise(got[r]["weights"][s], want_w[s], f"rank {r}, step {s}'s weights")
        assert_moments(got[r]["state"], names, want_m)


if __name__ == "__main__":
    _rank(float(sys.argv[1]), sys.argv[2])
