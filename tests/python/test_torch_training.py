"""PyTorch training as users write it, on one process: offload_module's
optimizer under an LR scheduler with torch's clip_grad_norm_, tied weights,
eval passes, the model's and the optimizer's state_dict (torch.save and a
fresh process resume bitwise), and how ranks are found. The multi-rank
counterpart is ddp_worker.py (run_ddp.py)."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import TinyGpt, batches, loss_of, lr_factor  # noqa: E402

LR, WD, CLIP = 3e-3, 0.01, 0.5
TOL = 5e-6  # fp32: measured 3e-7 (see ddp_worker.py)


def config(path=None):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    if path is not None:
        os.makedirs(path, exist_ok=True)  # an nvme_path must exist (a missing one is refused)
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
                                    "offload_param": {"device": "nvme", "nvme_path": str(path)}}
    return cfg


def train(model, opt, sched, data):
    norms = []
    for x, y in data:
        opt.zero_grad()
        loss_of(model, x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
    return norms


def test_optimizer_scheduler_clipping_and_tied_weights(tmp_path):
    data = batches(10, 4)
    ref = TinyGpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    ref_norms = train(ref, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor), data)
    assert any(n > CLIP for n in ref_norms), "the run must clip"

    model = TinyGpt()
    off = st.offload_module(model, config(tmp_path), force_no_gpu=True)
    assert isinstance(off.optimizer, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor)
    norms = train(model, off.optimizer, sched, data)
    assert off.optimizer.param_groups[0]["lr"] == pytest.approx(LR * lr_factor(10))
    for a, b in zip(norms, ref_norms):
        assert abs(a - b) <= TOL * b, (norms, ref_norms)
    masters = off.master_parameters()
    assert torch.equal(masters["head.weight"], masters["wte.weight"]), "a tied weight has one master"
    for n, p in ref.named_parameters():
        rel = ((masters[n] - p.detach()).abs().max() / p.detach().abs().max()).item()
        assert rel <= TOL, f"{n}: {rel}"
    with pytest.raises(strata.Error, match="all those of one"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    off.close()
    assert model.head.weight is model.wte.weight


def test_eval_passes_do_not_warn(capfd):
    model = TinyGpt()
    off = st.offload_module(model, config(), force_no_gpu=True)
    data = batches(6, 2)
    for i, (x, y) in enumerate(data):
        if i % 2:
            with torch.no_grad():
                model.eval()
                loss_of(model, x, y)
                model.train()
        loss_of(model, x, y).backward()
        off.optimizer.step()
    off.close()
    err = capfd.readouterr().err
    assert "another order" not in err, err


def test_state_dict_is_real_and_resumes_bitwise_in_a_fresh_process(tmp_path):
    data = batches(8, 4)
    model = TinyGpt()
    off = st.offload_module(model, config(tmp_path / "a"), force_no_gpu=True)
    sched = torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor)
    train(model, off.optimizer, sched, data[:4])
    sd = model.state_dict()
    masters = off.master_parameters()
    for n, p in TinyGpt().state_dict().items():
        assert sd[n].shape == p.shape and sd[n].is_contiguous() and sd[n].dtype == p.dtype, n
    assert all(torch.equal(sd[n], m) for n, m in masters.items())
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": sd, "optimizer": off.optimizer.state_dict(), "sched": sched.state_dict()}, ckpt)
    nbytes = sum(p.numel() * 4 for p in TinyGpt().parameters())
    assert os.path.getsize(ckpt) > 3 * nbytes, "weights and both moments"
    train(model, off.optimizer, sched, data[4:])
    final = off.master_parameters()
    off.close()

    script = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import strata.torch as st
from tiny_gpt import TinyGpt, batches, loss_of, lr_factor
import test_torch_training as t
model = TinyGpt(seed=5)  # other values: the load must replace them
off = st.offload_module(model, t.config({str(tmp_path / "b")!r}), force_no_gpu=True)
sched = torch.optim.lr_scheduler.LambdaLR(off.optimizer, lr_factor)
ck = torch.load({str(ckpt)!r})
model.load_state_dict(ck["model"])
off.optimizer.load_state_dict(ck["optimizer"])
sched.load_state_dict(ck["sched"])
t.train(model, off.optimizer, sched, batches(8, 4)[4:])
torch.save(off.master_parameters(), {str(tmp_path / "resumed.pt")!r})
off.close()
"""
    subprocess.run([sys.executable, "-c", script], check=True, env=os.environ.copy())
    resumed = torch.load(tmp_path / "resumed.pt")
    for n, w in final.items():
        assert torch.equal(resumed[n], w), f"{n} differs after the resume"


def test_load_state_dict_refused_changes_nothing():
    model = TinyGpt()
    off = st.offload_module(model, config(), force_no_gpu=True)
    before = off.master_parameters()
    bad = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    del bad["ln_f.bias"]
    with pytest.raises(RuntimeError, match="ln_f.bias"):
        model.load_state_dict(bad)
    after = off.master_parameters()
    assert all(torch.equal(before[n], after[n]) for n in before), "a refused load changed the weights"
    assert not any(st.is_fetched(p) for p in model.parameters()), "placeholders are back"
    model.load_state_dict(bad, strict=False)
    assert torch.equal(off.master_parameters()["wte.weight"], torch.zeros_like(before["wte.weight"]))
    assert torch.equal(off.master_parameters()["ln_f.bias"], before["ln_f.bias"])
    off.close()


def test_one_param_group_only():
    model = TinyGpt()
    off = st.offload_module(model, config(), force_no_gpu=True)
    with pytest.raises(strata.Error, match="one param group"):
        off.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    off.close()


def test_ranks_are_found_and_conflicts_refused(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(v, raising=False)
    assert st._resolve_ranks(None, None, "t") == (0, 1)
    with pytest.raises(strata.Error, match="both rank= and world_size="):
        st._resolve_ranks(1, None, "t")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert st._resolve_ranks(None, None, "t") == (1, 4)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert st._resolve_ranks(None, None, "t") == (0, 2), "torchrun's variables come first"
    with pytest.raises(strata.Error, match="rank=/world_size= says rank 1 of 2 but torchrun says rank 0 of 2"):
        st._resolve_ranks(1, 2, "t")
    monkeypatch.delenv("RANK")
    with pytest.raises(strata.Error, match="incomplete"):
        st._resolve_ranks(None, None, "t")
    for v in ("WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(v)
    with pytest.raises(strata.Error, match="no launcher variables"):
        st.OffloadAdam(TinyGpt().parameters(), rank=0, world_size=2, force_no_gpu=True)


def test_gradient_accumulation_averages_like_torch():
    # Two micro-batches per step: torch users divide the loss by 2; with
    # offload_module the engine averages the grads calls of a step itself.
    data = batches(6, 4)
    ref = TinyGpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for x, y in data:
        opt.zero_grad()
        for half in (slice(0, 2), slice(2, 4)):
            (loss_of(ref, x[half], y[half]) / 2).backward()
        opt.step()
    model = TinyGpt()
    off = st.offload_module(model, config(), force_no_gpu=True, grad_accumulation_steps=2)
    for x, y in data:
        for half in (slice(0, 2), slice(2, 4)):
            loss_of(model, x[half], y[half]).backward()
        off.optimizer.step()
    masters = off.master_parameters()
    for n, p in ref.named_parameters():
        rel = ((masters[n] - p.detach()).abs().max() / p.detach().abs().max()).item()
        assert rel <= TOL, f"{n}: {rel}"
    off.close()


def test_a_bad_log_level_is_named_not_silent():
    # spdlog reads an unknown level as "off"; Strata names it and keeps info.
    code = ("import strata; e = strata.Engine({'zero_optimization': {'stage': 1}, 'amp': {'enabled': False}}); "
            "e.close()")
    env = dict(os.environ, STRATA_LOG_LEVEL="warnn")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "STRATA_LOG_LEVEL='warnn' is not one of" in p.stderr, p.stderr
    assert "amp" in p.stderr, "warnings still show"
    env["STRATA_LOG_LEVEL"] = "error"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "amp" not in p.stderr, p.stderr
