"""The step's options from Python: None is "the config's value"; a negative
lr, beta, eps or weight_decay is refused (INVALID naming it), as is NaN or
infinity. Before, a negative one went to the engine, which reads a negative
as "the config's value": an LR schedule that went below 0 trained at the
config's (peak) lr without a word. OffloadAdam checks every param group that
steps before any engine steps."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

nn = torch.nn


def engine(**kw):
    e = strata.Engine({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}}},
                      force_no_gpu=True, **kw)
    e.add_param(0, "w", torch.ones(16))
    e.build()
    return e


@pytest.mark.parametrize("option,kwargs,shown", [
    ("lr", dict(lr=-1e-4), "-0.0001"),
    ("beta1", dict(betas=(-0.9, 0.999)), "-0.9"),
    ("beta2", dict(betas=(0.9, -0.5)), "-0.5"),
    ("eps", dict(eps=-1e-8), "-1e-08"),
    ("weight_decay", dict(weight_decay=-0.01), "-0.01"),
    ("lr", dict(lr=float("nan")), "nan"),
    ("eps", dict(eps=float("inf")), "inf"),
])
def test_engine_step_refuses_a_negative_or_non_finite_option_naming_it(option, kwargs, shown):
    with engine() as e:
        e.grads(0, torch.ones(16))
        with pytest.raises(strata.Error) as err:
            e.step(**kwargs)
        before = e.read_master(0).clone()
        assert torch.equal(before, torch.ones(16)), "the refused step updated the weights"
        assert err.value.status == strata.INVALID
        assert option in err.value.message and shown in err.value.message, err.value.message
        e.step(lr=0.1)  # the same step, with an lr: it goes on
        assert torch.allclose(e.read_master(0), torch.full((16,), 0.9))


def test_engine_prepare_step_refuses_a_negative_lr():
    with engine(overlap_step=True) as e:
        with pytest.raises(strata.Error, match=r"lr is -0\.5"):
            e.prepare_step(lr=-0.5)


def test_engine_step_none_and_zero_are_values_as_before():
    with engine() as e:
        e.grads(0, torch.ones(16))
        e.step(lr=None, weight_decay=0.0)  # the config's lr (0.1)
        assert torch.allclose(e.read_master(0), torch.full((16,), 0.9))
        e.grads(0, torch.ones(16))
        e.step(lr=0.0)
        assert torch.allclose(e.read_master(0), torch.full((16,), 0.9))


def test_offload_adam_refuses_a_group_lr_made_negative_before_any_group_steps():
    g = torch.Generator().manual_seed(0)
    a, b = nn.Parameter(torch.randn(8, generator=g)), nn.Parameter(torch.randn(3, generator=g))
    opt = st.OffloadAdam([dict(params=[a]), dict(params=[b])], lr=1e-2, force_no_gpu=True)
    # A LambdaLR whose factor goes below 0 on the second group.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda k: 1.0, lambda k: 1.0 - k])
    a.grad, b.grad = torch.ones(8), torch.ones(3)
    opt.step()
    sched.step()
    opt.step()  # factor 0: lr 0
    sched.step()
    assert opt.param_groups[1]["lr"] < 0
    before = a.detach().clone(), b.detach().clone(), opt.state[a]["step"].clone()
    with pytest.raises(strata.Error) as err:
        opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1]), "a refused step updated"
    assert torch.equal(opt.state[a]["step"], before[2])
    assert err.value.status == strata.INVALID
    assert "param group 1" in str(err.value) and "lr is -0.01" in str(err.value), str(err.value)
    opt.close()


def test_offload_adam_refuses_a_group_beta_outside_its_range_before_any_group_steps():
    a, b = nn.Parameter(torch.ones(8)), nn.Parameter(torch.ones(3))
    opt = st.OffloadAdam([dict(params=[a]), dict(params=[b])], lr=1e-2, force_no_gpu=True)
    opt.param_groups[1]["betas"] = (0.9, 1.0)
    a.grad, b.grad = torch.ones(8), torch.ones(3)
    with pytest.raises(strata.Error, match=r"param group 1.*beta2 is 1\.0") as err:
        opt.step()
    assert torch.equal(a.detach(), torch.ones(8)) and err.value.status == strata.INVALID
    opt.close()


def test_offload_module_optimizer_refuses_a_negative_lr():
    model = nn.Linear(4, 2)
    off = st.offload_module(model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, force_no_gpu=True)
    before = {n: v.clone() for n, v in off.master_parameters().items()}
    model(torch.ones(3, 4)).sum().backward()
    off.optimizer.param_groups[0]["lr"] = -1e-3
    with pytest.raises(strata.Error, match=r"lr is -0\.001"):
        off.optimizer.step()
    after = off.master_parameters()
    assert all(torch.equal(before[n], after[n]) for n in before)
    off.close()
