"""OffloadAdam's lifetime: a dropped optimizer frees its engines at once (no
reference cycle left for the collector), and a load_state_dict that fails
building its engines leaves the optimizer as it was."""
import gc
import os
import weakref

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402
import strata.torch._offload_adam as offload_adam  # noqa: E402


def threads():
    return len(os.listdir("/proc/self/task"))


# ---- C. no cycle ---------------------------------------------------------------

@pytest.mark.parametrize("fp16", [False, True])
def test_dropped_optimizer_frees_its_engines_without_the_collector(fp16):
    """/tmp/review-py/cycle.py: before, _LossScaling's lambda over self made a
    cycle: the engines, their threads and memory waited for the collector."""
    model = nn.Linear(64, 64)
    cfg = {"zero_optimization": {"stage": 1}}
    if fp16:
        model = model.half()
        cfg["fp16"] = {"enabled": True}
    gc.collect()  # (earlier tests' garbage)
    before, live = threads(), strata._live_native_engines()
    gc.disable()
    try:
        opt = st.OffloadAdam(model.parameters(), config=cfg, force_no_gpu=True, loss_scaled=fp16)
        assert opt.loss_scale == (65536.0 if fp16 else 1.0)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        r, e = weakref.ref(opt), weakref.ref(opt._engines[0].engine)
        del opt
        assert r() is None and e() is None, "a dropped OffloadAdam waits for the cyclic collector"
        assert strata._live_native_engines() == live and threads() == before
    finally:
        gc.enable()


# ---- D. a failed load changes nothing ------------------------------------------

def _states_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][k]), (i, k)
    assert a.get("loss_scaler") == b.get("loss_scaler")


def _make(swap, bf16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}}}
    if bf16:
        model = model.bfloat16()
        cfg["bf16"] = {"enabled": True}
    opt = st.OffloadAdam([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-4}],
                         config=cfg, force_no_gpu=True)
    return model, opt


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 32, generator=g).to(model[0].weight.dtype)).float().sum().backward()
        opt.step()


def _failing_new_engine(monkeypatch, fails, status, text):
    """OffloadAdam._new_engine made to raise strata.Error(status, text) once
    `fails` engines were made (and on every call after). Returns the list of
    the groups of the engines made; undo with monkeypatch.undo()."""
    built = []
    real = offload_adam.OffloadAdam._new_engine

    def flaky(self, index, params):
        if len(built) == fails:
            raise strata.Error(status, text)
        built.append(index)
        return real(self, index, params)

    monkeypatch.setattr(offload_adam.OffloadAdam, "_new_engine", flaky)
    return built


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("fails", [0, 1])
def test_load_failing_to_build_an_engine_keeps_the_optimizer(tmp_path, monkeypatch, bf16, fails):
    """/tmp/review-py/loadfail.py: before, the old engines were closed before
    the new were built; a failure lost their state, left _cohorts short
    (step: IndexError) and state_dict missing groups. Now the new engines
    are built beside the old: a failure that is not for want of room (here
    an I/O error) leaves the optimizer as it was."""
    swap_a, swap_b = tmp_path / "a", tmp_path / "b"
    swap_a.mkdir(), swap_b.mkdir()
    model, opt = _make(swap_a, bf16)
    twin, twin_opt = _make(swap_b, bf16)  # the same training, never loaded into
    _train(model, opt, 1, seed=1)
    _train(twin, twin_opt, 1, seed=1)
    older = opt.state_dict()
    _train(model, opt, 2, seed=2)
    _train(twin, twin_opt, 2, seed=2)
    before = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    folders = sorted(os.listdir(swap_a))

    _failing_new_engine(monkeypatch, fails, strata.IO, "simulated: the swap folder's disk failed")
    with pytest.raises(strata.Error) as err:
        opt.load_state_dict(older)
    assert err.value.status == strata.IO
    monkeypatch.undo()

    assert sorted(os.listdir(swap_a)) == folders, "the engines built for the failed load left their folders"
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), f"{k} changed by a load that failed"
    _states_equal(opt.state_dict(), before)
    _train(model, opt, 2, seed=3)  # steps on as if the load had not been tried
    _train(twin, twin_opt, 2, seed=3)
    for (k, v), w in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(v, w), k
    _states_equal(opt.state_dict(), twin_opt.state_dict())
    opt.load_state_dict(older)  # and a load that works still does
    _states_equal(opt.state_dict(), older)
    opt.close()
    twin_opt.close()
    assert os.listdir(swap_a) == []


@pytest.mark.parametrize("persistent", [False, True])
def test_a_load_without_room_for_both_lets_the_old_state_go_first(tmp_path, monkeypatch, persistent):
    """Building the loaded state's engines beside the old needs room for
    both: where that fails for want of room (NOSPACE, NOMEM) the old engines
    go first and the build is tried again: the load goes through. Where it
    fails again, the optimizer holds no state and says so (STATE naming the
    failure) until a load succeeds."""
    swap = tmp_path / "a"
    swap.mkdir()
    model, opt = _make(swap, False)
    _train(model, opt, 1, seed=1)
    older = opt.state_dict()
    _train(model, opt, 2, seed=2)
    tries = []
    real = offload_adam.OffloadAdam._new_engine

    def short(self, index, params):
        if persistent or not tries:
            tries.append(index)
            raise strata.Error(strata.NOSPACE, "simulated: no room beside the old swap files")
        return real(self, index, params)

    monkeypatch.setattr(offload_adam.OffloadAdam, "_new_engine", short)
    if not persistent:
        opt.load_state_dict(older)
        monkeypatch.setattr(offload_adam.OffloadAdam, "_new_engine", real)
        _states_equal(opt.state_dict(), older)
        _train(model, opt, 1, seed=3)
    else:
        with pytest.raises(strata.Error) as err:
            opt.load_state_dict(older)
        assert err.value.status == strata.NOSPACE and "holds no state" in str(err.value), str(err.value)
        monkeypatch.setattr(offload_adam.OffloadAdam, "_new_engine", real)
        with pytest.raises(strata.Error) as refused:
            opt.step()
        assert refused.value.status == strata.STATE
        opt.load_state_dict(older)  # the way out
        _states_equal(opt.state_dict(), older)
    opt.close()
    assert os.listdir(swap) == []


# ---- A cohort split that fails changes nothing ---------------------------------

@pytest.mark.parametrize("fails", [0, 1])
def test_a_split_failing_to_build_an_engine_keeps_the_optimizer(tmp_path, monkeypatch, fails):
    """A step where some parameters of a cohort got no gradient splits it in
    two engines (and gives parameters stepped for the first time one more).
    Before, the cohort was closed once its two parts were made: a part, or
    the new cohort's engine, failing to build (NOSPACE) leaked the first
    part (engine and folder) or lost the split cohort's state. Now the new
    engines are made first: a failure closes them and leaves the cohorts."""
    swap_a, swap_b = tmp_path / "a", tmp_path / "b"
    swap_a.mkdir(), swap_b.mkdir()
    model, opt = _make(swap_a, False)
    twin, twin_opt = _make(swap_b, False)
    _train(model, opt, 1, seed=1)
    _train(twin, twin_opt, 1, seed=1)
    before = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    folders = sorted(os.listdir(swap_a))

    # The bias of the first layer gets no gradient: its cohort splits.
    opt.zero_grad()
    model(torch.randn(2, 32)).sum().backward()
    model[0].bias.grad = None
    built = _failing_new_engine(monkeypatch, fails, strata.NOSPACE, "simulated: no space for the swap file")
    with pytest.raises(strata.Error) as err:
        opt.step()
    assert err.value.status == strata.NOSPACE
    monkeypatch.undo()
    assert len(built) == fails, "the split did not make its engines: the case is not made"
    assert sorted(os.listdir(swap_a)) == folders, "the engines made for the failed split left their folders"
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), f"{k} changed by a step that failed"
    _states_equal(opt.state_dict(), before)
    _train(model, opt, 2, seed=3)  # steps on as if the failed step had not been tried
    _train(twin, twin_opt, 2, seed=3)
    for (k, v), w in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(v, w), k
    opt.close()
    twin_opt.close()
    assert os.listdir(swap_a) == []
