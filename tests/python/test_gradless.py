"""strata.Engine(skip_groups_without_grads=True): a group without grads() in
a step is left untouched and counts its own steps, as torch.optim.AdamW
leaves a parameter whose .grad is None (torch is the oracle here)."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
          "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
          "strata": {"device_budget": "8MiB", "host_budget": "8MiB"}}


def train(e, a0, b0, grads, with_b):
    """Two groups, a and b; b gets its gradient only at the steps in with_b."""
    e.add_param(0, "a", a0)
    e.add_param(1, "b", b0)
    e.build()
    for s, (ga, gb) in enumerate(grads):
        e.grads(0, ga)
        if s in with_b:
            e.grads(1, gb)
        e.step()


def test_skipped_group_matches_torch_adamw():
    torch.manual_seed(0)
    a0, b0 = torch.randn(300), torch.randn(200)
    with_b = (0, 2, 3, 5)  # the steps in which b has a gradient
    grads = [(torch.randn(300), torch.randn(200)) for _ in range(6)]
    pa, pb = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    opt = torch.optim.AdamW([pa, pb], lr=0.01, weight_decay=0.1)
    for s, (ga, gb) in enumerate(grads):
        pa.grad = ga.clone()
        pb.grad = gb.clone() if s in with_b else None
        opt.step()
    with strata.Engine(CONFIG, force_no_gpu=True, skip_groups_without_grads=True) as e:
        train(e, a0, b0, grads, with_b)
        assert e.steps == 6 and e.group_steps(0) == 6 and e.group_steps(1) == 4
        assert opt.state[pb]["step"] == 4
        torch.testing.assert_close(e.read_master(0), pa.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(e.read_master(1), pb.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(e.read_state(1, "exp_avg"), opt.state[pb]["exp_avg"], rtol=1e-5, atol=1e-7)
        e.set_group_steps(1, 10)
        assert e.group_steps(1) == 10
    with strata.Engine(CONFIG, force_no_gpu=True) as e:  # the default: DeepSpeed's rule, every group every step
        train(e, a0, b0, grads, with_b)
        assert e.group_steps(1) == 6
        assert not torch.allclose(e.read_master(1), pb.detach(), rtol=1e-5, atol=1e-6)
        with pytest.raises(strata.Error) as info:
            e.set_group_steps(1, 3)
        assert info.value.status == strata.INVALID
