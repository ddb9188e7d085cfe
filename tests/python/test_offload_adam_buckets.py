"""OffloadAdam's engine groups (strata._sizing): parameters cut over groups
change no result, bitwise, against one group per parameter and against
torch AdamW; state_dict and load_state_dict see whole parameters; with the
state on NVMe and no GPU the engine's copy of the parameters is on NVMe,
one group at a time in host memory."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import strata.torch as st  # noqa: E402
from strata.torch import _sizing  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402

STEPS = 6
BUCKET = 4096  # smaller than three of the parameters below


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 300)  # 4800 + 300
        self.b = torch.nn.Linear(300, 40)  # 12000 + 40
        # A leaf that is not contiguous: copied back through a flat copy.
        self.c = torch.nn.Parameter(torch.randn(40, 130).t())  # 5200

    def forward(self, x):
        return torch.tanh(self.b(torch.relu(self.a(x)))) @ self.c.t()


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=g), torch.randn(32, 130, generator=g)


def nvme(path):
    path.mkdir(exist_ok=True)
    return {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}}


def train(model, opt, steps=STEPS):
    x, y = data()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def offload(model, path, bucket):
    return st.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.01, config=nvme(path), bucket_numel=bucket,
                          force_no_gpu=True)


def test_parameters_cut_over_groups_step_bitwise_as_whole_ones_and_as_torch(tmp_path):
    ref = Net()
    train(ref, oracle.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01))
    whole, cut = Net(), Net()
    assert not cut.c.is_contiguous()
    opt_whole, opt_cut = offload(whole, tmp_path / "w", 1 << 22), offload(cut, tmp_path / "c", BUCKET)
    total = sum(p.numel() for p in cut.parameters())
    (ge,) = opt_cut._engines
    assert ge.engine.num_groups == -(-total // BUCKET), "the parameters were cut over full groups"
    assert all(ge.engine.group_numel(g) == BUCKET for g in range(ge.engine.num_groups - 1))
    assert opt_whole._engines[0].engine.num_groups == 1
    train(whole, opt_whole)
    train(cut, opt_cut)
    for (n, a), b, r in zip(cut.named_parameters(), whole.parameters(), ref.parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(a, r), n
    for a, b in zip(ge.read_masters(), opt_whole._engines[0].read_masters()):
        assert torch.equal(a, b)
    opt_whole.close()
    opt_cut.close()


def test_state_dict_of_cut_parameters_is_whole_and_loads_back(tmp_path):
    whole, cut = Net(), Net()
    opt_whole, opt_cut = offload(whole, tmp_path / "w", 1 << 22), offload(cut, tmp_path / "c", BUCKET)
    train(whole, opt_whole, 3)
    train(cut, opt_cut, 3)
    sd_whole, sd_cut = opt_whole.state_dict(), opt_cut.state_dict()
    assert set(sd_cut["state"]) == set(sd_whole["state"])
    for k, s in sd_whole["state"].items():
        assert set(sd_cut["state"][k]) == set(s) and {"exp_avg", "exp_avg_sq"} <= set(s)
        for key, v in s.items():
            assert sd_cut["state"][k][key].shape == v.shape and torch.equal(sd_cut["state"][k][key], v), key
    fresh = Net()
    fresh.load_state_dict(cut.state_dict())  # a float32 parameter holds its master weights itself
    opt_fresh = offload(fresh, tmp_path / "f", 2048)  # other cuts than the saved run's
    opt_fresh.load_state_dict(sd_cut)
    train(fresh, opt_fresh, 3)
    train(whole, opt_whole, 3)
    for a, b in zip(fresh.parameters(), whole.parameters()):
        assert torch.equal(a, b)
    for o in (opt_whole, opt_cut, opt_fresh):
        o.close()


def test_with_state_on_nvme_the_engines_parameters_are_on_nvme_too(tmp_path):
    model = Net()
    opt = offload(model, tmp_path, None)  # sized: the model is tiny, the smallest groups
    (ge,) = opt._engines
    total = sum(p.numel() for p in model.parameters())
    assert ge.engine.num_groups == -(-total // _sizing.MIN_BUCKET_NUMEL)
    assert ge.engine.config["zero_optimization"]["offload_param"]["device"] == "nvme"
    train(model, opt, 2)
    s = ge.engine.stats()
    assert s["device"]["budget"] <= _sizing.P_COPIES * _sizing.MIN_BUCKET_NUMEL * 4 + (1 << 20), s["device"]
    assert 0 < s["device"]["peak"] <= s["device"]["budget"]
    opt.close()
    kept = st.OffloadAdam(Net().parameters(), config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
                          force_no_gpu=True)
    assert kept._engines[0].engine.config["zero_optimization"]["offload_param"]["device"] == "none"
    kept.close()
