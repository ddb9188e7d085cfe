"""The Python binding: strata.Engine over the C API, and the PyTorch
integration (OffloadAdam, offload_module) against torch.optim.AdamW."""
import json
import copy
import os

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

STEPS = 50
RTOL = 1e-5


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)


def param_groups(model):
    # Two groups with different weight decay: one engine each in OffloadAdam.
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def nvme_config(path, params_too=False):
    os.makedirs(path, exist_ok=True)  # an nvme_path must exist (a missing one is refused)
    zero = {"stage": 3 if params_too else 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}
    if params_too:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(path)}
    return {"zero_optimization": zero}


def reference_run(model, x, y, groups):
    """torch.optim.AdamW with the LR schedule, the oracle: the model after STEPS steps."""
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    for _ in range(STEPS):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        sched.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def lr_factor(step):
    return 1.0 - step / (2 * STEPS)  # a linear decay: the LR changes every step


def assert_close(actual, expected):
    for name, a in actual.items():
        e = expected[name]
        rel = ((a - e).abs().max() / e.abs().max()).item()
        assert rel <= RTOL, f"{name}: relative difference {rel}"
        assert torch.allclose(a, e, rtol=RTOL, atol=1e-7), name


def test_engine_protocol():
    with strata.Engine({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, force_no_gpu=True) as e:
        assert e.add_param(0, "w", torch.arange(5.0)) == 0
        assert e.add_param(0, "b", 3) == 5
        e.add_param(1, "v", 4, init=torch.ones(4))
        e.build()
        assert (e.num_groups, e.group_numel(0), e.group_numel(1), e.compute_dtype, e.on_gpu) == (2, 8, 4, "f32", False)
        p = e.fetch_tensor(0)
        assert p.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
        e.release(0)
        e.grads(0, torch.ones(8))
        e.grads(1, torch.ones(4, dtype=torch.bfloat16))
        norm, skipped = e.step(lr=0.1, weight_decay=0.0)
        assert norm == pytest.approx(12 ** 0.5) and not skipped
        assert torch.allclose(e.read_master(0), torch.tensor([0, 1, 2, 3, 4, 0, 0, 0.0]) - 0.1)
        s = e.stats()
        assert s["steps"] == 1 and s["host"]["peak"] <= s["host"]["budget"]
        with pytest.raises(strata.Error) as err:
            e.fetch(7)
        assert err.value.status == strata.INVALID and "group 7 out of range" in err.value.message
    with pytest.raises(strata.Error) as err:
        e.build()  # closed
    assert err.value.status == strata.STATE


def test_engine_bf16_compute():
    with strata.Engine({"bf16": {"enabled": True}}, force_no_gpu=True) as e:
        init = torch.tensor([1.0, -2.5, 3.140625, 1e-3])
        e.add_param(0, "w", init)
        e.build()
        assert e.compute_dtype == "bf16"
        p = e.fetch_tensor(0)
        assert p.dtype == torch.bfloat16 and torch.equal(p, init.to(torch.bfloat16))
        e.release(0)
        e.grads(0, torch.ones(4, dtype=torch.bfloat16))
        e.step(lr=0.5)
        assert torch.allclose(e.read_master(0), init - 0.5, rtol=0, atol=1e-6)


def test_engine_overlap_step():
    # strata.nonfinite "skip" (the default): the early update is speculative;
    # a step with other options than prepare_step's redoes it with step's.
    # ("always": the policy would not speculate the first step.)
    with strata.Engine({"strata": {"speculation": "always"}}, force_no_gpu=True, overlap_step=True) as e:
        e.add_param(0, "w", torch.ones(16))
        e.build()
        e.prepare_step(lr=0.1)
        e.grads(0, torch.ones(16))
        e.step(lr=0.2)
        assert torch.allclose(e.read_master(0), torch.full((16,), 0.8))
        s = e.stats()
        # (early_updates: 1, or 0 when step() came before the update began and dropped it)
        assert (s["speculated_steps"], s["replayed_steps"]) == (1, 1) and s["early_updates"] <= 1, s
    # "apply", no clipping, no fp16: nothing after backward can change the
    # early update, which is final: other options are refused.
    with strata.Engine({"strata": {"nonfinite": "apply"}}, force_no_gpu=True, overlap_step=True) as e:
        e.add_param(0, "w", torch.ones(16))
        e.build()
        e.prepare_step(lr=0.1)
        e.grads(0, torch.ones(16))
        with pytest.raises(strata.Error, match="options differ"):
            e.step(lr=0.2)
        e.step(lr=0.1)
        assert torch.allclose(e.read_master(0), torch.full((16,), 0.9))
        assert e.stats()["speculated_steps"] == 0


def test_engine_placement_and_device_option():
    with strata.Engine({"strata": {"numa_bind": "off"}}, force_no_gpu=True, device=3) as e:
        assert e.placement.startswith("rank 0/1: no GPU (force_no_gpu): device tier is a host arena; "
                                      "no NUMA binding (strata.numa_bind is off)"), e.placement
        s = e.stats()
        assert s["gpu_device"] == -1 and s["numa_node"] == -1
    with pytest.raises(strata.Error, match="options.device: -2"):
        strata.Engine({}, force_no_gpu=True, device=-2)


def test_bad_config_raises_with_the_engines_message(tmp_path):
    bad = {"zero_optimization": {"stagee": 1}}
    for make in (lambda: strata.Engine(bad),
                 lambda: st.OffloadAdam(make_model().parameters(), config=bad),
                 lambda: st.offload_module(make_model(), bad)):
        with pytest.raises(strata.Error) as err:
            make()
        assert err.value.status == strata.CONFIG and err.value.status_name == "CONFIG"
        assert "zero_optimization.stagee: unknown key; did you mean 'stage'?" in err.value.message
        assert "CONFIG" in str(err.value)
    with pytest.raises(strata.Error, match="invalid JSON"):
        strata.Engine("{oops")


def test_adam_step_alone_equals_torch():
    torch.manual_seed(3)
    w, g = torch.randn(1000), torch.randn(1000)
    ref = w.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    ref.grad = g.clone()
    opt.step()
    m, v = torch.zeros(1000), torch.zeros(1000)
    strata.adam_step(w, g, m, v, step=1, lr=1e-2, weight_decay=0.1)
    assert torch.allclose(w, ref.detach(), rtol=RTOL, atol=0)
    with pytest.raises(strata.Error) as err:
        strata.adam_step(w, g, m, v, step=0)
    assert err.value.status == strata.INVALID


def test_offload_adam_on_nvme_equals_adamw(tmp_path):
    x, y = make_data()
    ref = make_model()
    expected = reference_run(ref, x, y, param_groups(ref))
    model = make_model()
    opt = st.OffloadAdam(param_groups(model), lr=1e-2, weight_decay=0.01, config=nvme_config(tmp_path),
                         force_no_gpu=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    assert any(os.scandir(tmp_path)), "no swap files on the NVMe path"
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert_close(dict(model.named_parameters()), expected)
    stats = opt._engines[0].engine.stats()
    assert stats["steps"] == STEPS and stats["nvme_to_host"] > 0, stats
    opt.close()
    assert not any(os.scandir(tmp_path)), "swap folders left behind"


def test_offload_adam_state_dict_round_trip(tmp_path):
    """state_dict, a fresh optimizer and load_state_dict go on exactly as an
    uninterrupted run: master weights, both moments and the step count."""
    x, y = make_data()
    ref_model = make_model()
    ref = st.OffloadAdam(param_groups(ref_model), lr=1e-2, config=nvme_config(tmp_path / "a"), force_no_gpu=True)
    model = make_model()
    opt = st.OffloadAdam(param_groups(model), lr=1e-2, config=nvme_config(tmp_path / "b"), force_no_gpu=True)
    for m, o in ((ref_model, ref), (model, opt)):
        for _ in range(3):
            o.zero_grad()
            loss_of(m, x, y).backward()
            o.step()
    sd = opt.state_dict()
    assert set(sd["state"]) == {0, 1, 2, 3, 4, 5}
    for s in sd["state"].values():
        assert float(s["step"]) == 3 and s["master_param"].dtype == torch.float32
        assert s["exp_avg"].abs().sum() > 0 and s["exp_avg_sq"].abs().sum() > 0
    assert [g["weight_decay"] for g in sd["param_groups"]] == [0.01, 0.0]
    opt.close()

    fresh = make_model()
    opt2 = st.OffloadAdam(param_groups(fresh), lr=5e-3, config=nvme_config(tmp_path / "c"), force_no_gpu=True)
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    assert sd2["param_groups"] == sd["param_groups"]
    for k, s in sd["state"].items():
        for key in ("step", "master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd2["state"][k][key], s[key]), key
    for _ in range(3):  # goes on exactly as the uninterrupted run
        for m, o in ((ref_model, ref), (fresh, opt2)):
            o.zero_grad()
            loss_of(m, x, y).backward()
            o.step()
    for a, b in zip(fresh.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    ref.close()
    opt2.close()

def test_offload_module_equals_adamw(tmp_path):
    x, y = make_data()
    ref = make_model()
    expected = reference_run(ref, x, y, ref.parameters())
    model = make_model()
    cfg = nvme_config(tmp_path, params_too=True)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    off = st.offload_module(model, cfg, force_no_gpu=True)
    # Between steps the parameters hold no memory of their own.
    assert not any(st.is_fetched(p) for p in model.parameters())
    assert set(off.master_parameters()) == set(expected)
    released_while_later_layers_run = []
    model[4].register_forward_pre_hook(
        lambda m, inp: released_while_later_layers_run.append(not st.is_fetched(model[0].weight)))
    for step in range(STEPS):
        loss_of(model, x, y).backward()
        assert all(p.grad is None for p in model.parameters()), "gradients stayed in .grad"
        off.step(lr=1e-2 * lr_factor(step))
    assert_close(off.master_parameters(), expected)
    stats = off.engine.stats()
    assert all(released_while_later_layers_run) and len(released_while_later_layers_run) == STEPS
    # 3 fetches in forward, and 2 in backward (layers 2 and 3 saved their
    # weights; layer 1 did not, as its input needs no gradient).
    assert stats["steps"] == STEPS and stats["fetches"] >= 4 * STEPS and stats["nvme_to_host"] > 0, stats
    off.close()  # the module gets ordinary parameters holding the master weights
    assert_close(dict(model.named_parameters()), expected)
    assert all(p.is_contiguous() for p in model.parameters())
    assert not any(os.scandir(tmp_path)), "swap folders left behind"


def test_offload_module_unused_parameters_and_eval(tmp_path):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.a = torch.nn.Linear(4, 2)
            self.b = torch.nn.Linear(4, 2)  # unused in training

        def forward(self, x, head="a"):
            return getattr(self, head)(self.body(x))

    torch.manual_seed(0)
    model = TwoHeads()
    before_b = model.b.weight.detach().clone()
    off = st.offload_module(model, {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0}}},
                            force_no_gpu=True)
    x = torch.randn(8, 4)
    for _ in range(3):
        model(x).sum().backward()
        off.step(lr=1e-2)
    with torch.no_grad():
        out = model(x, head="b")
    assert out.shape == (8, 2)
    assert torch.equal(off.master_parameters()["b.weight"], before_b)  # zero gradients, no decay
    off.close()


def test_offload_module_bf16_compute():
    # Parameters are fetched as bf16 (the config's compute dtype); the master
    # weights stay fp32 in the engine.
    model = make_model()
    x, y = make_data()
    off = st.offload_module(model, {"bf16": {"enabled": True}}, force_no_gpu=True)
    losses = []
    for _ in range(20):
        loss = ((model(x.bfloat16()).float() - y) ** 2).mean()  # torch 1.13 has no bf16 mse on the CPU
        loss.backward()
        off.step(lr=1e-2)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(m.dtype == torch.float32 for m in off.master_parameters().values())
    off.close()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_offload_module_compact_state_learns_like_fp32():
    # strata.state_format "compact": the same training within the format's
    # precision; the masters differ (they are rounded), and a clash with the
    # config, or compact without bf16, is refused with the reason.
    results = {}
    for fmt in ("fp32", "compact"):
        model = make_model()
        x, y = make_data()
        off = st.offload_module(model, {"bf16": {"enabled": True}}, force_no_gpu=True, state_format=fmt)
        losses = []
        for _ in range(20):
            loss = ((model(x.bfloat16()).float() - y) ** 2).mean()
            loss.backward()
            off.step(lr=1e-2)
            losses.append(loss.item())
        results[fmt] = (losses, {k: v.clone() for k, v in off.master_parameters().items()})
        off.close()
    l32, lc = results["fp32"][0], results["compact"][0]
    assert lc[-1] < 0.7 * lc[0], lc
    assert all(abs(a - b) <= 0.05 * abs(a) for a, b in zip(l32, lc)), (l32, lc)
    assert any(not torch.equal(results["fp32"][1][k], results["compact"][1][k]) for k in results["fp32"][1])
    with pytest.raises(ValueError, match="differs from the config"):
        st.offload_module(make_model(), {"bf16": {"enabled": True}, "strata": {"state_format": "fp32"}},
                          force_no_gpu=True, state_format="compact")
    with pytest.raises(strata.Error, match="bf16.enabled"):
        st.offload_module(make_model(), {}, force_no_gpu=True, state_format="compact")


def test_checkpoint_round_trip_and_corruption(tmp_path):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with strata.Engine(cfg, force_no_gpu=True) as e:
        e.add_param(0, "w", torch.arange(6.0))
        e.build()
        e.grads(0, torch.ones(6))
        e.step()
        saved = e.read_master(0).clone()
        e.save_checkpoint(tmp_path / "ckpt", "one", blob=b"trainer-state" * 10000)
        e.grads(0, torch.ones(6))
        e.step()
        assert not torch.equal(e.read_master(0), saved)
        assert e.load_checkpoint(tmp_path / "ckpt") == b"trainer-state" * 10000
        assert torch.equal(e.read_master(0), saved)
        with pytest.raises(strata.Error, match="another trainer blob"):
            e.save_checkpoint(tmp_path / "ckpt", "one")  # the same state, but the blob would be lost
        e.save_checkpoint(tmp_path / "ckpt", "one", blob=b"trainer-state" * 10000)  # the same: nothing to write
        e.grads(0, torch.ones(6))
        e.step()
        with pytest.raises(strata.Error) as err:
            e.save_checkpoint(tmp_path / "ckpt", "one")
        assert err.value.status == strata.INVALID and "never overwritten" in err.value.message
        assert e.load_checkpoint(tmp_path / "ckpt", "one") == b"trainer-state" * 10000
        data = tmp_path / "ckpt" / "one" / "rank00000.bin"
        raw = bytearray(data.read_bytes())
        # inside the first block the manifest references (a snapshot links the
        # swap file, where blocks sit wherever their last write put them)
        manifest = json.loads((tmp_path / "ckpt" / "one" / "manifest.json").read_text())
        raw[manifest["files"][0]["blocks"][0]["offset"] + 7] ^= 0x40
        data.write_bytes(bytes(raw))
        with pytest.raises(strata.Error) as err:
            e.load_checkpoint(tmp_path / "ckpt", "one")
        assert err.value.status == strata.CORRUPT and "rank00000.bin" in err.value.message
        assert torch.equal(e.read_master(0), saved)
        with pytest.raises(strata.Error) as err:
            e.load_checkpoint(tmp_path / "nothing-saved-here")
        assert err.value.status == strata.NOT_FOUND and err.value.status_name == "NOT_FOUND"
