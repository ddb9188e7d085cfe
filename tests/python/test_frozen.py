"""strata.Engine.freeze_group: a frozen group (a fine-tune's base weights)
keeps its parameters alone; fetches return them in the compute dtype, steps
never change them, the trained group steps as torch's AdamW with the frozen
weights as a constant, and checkpoints round-trip them."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402


def config(swap):
    return {"bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
                                  "offload_param": {"device": "nvme", "nvme_path": str(swap)}},
            "strata": {"device_budget": "8MiB", "host_budget": "8MiB"}}


def test_frozen_group_is_kept_and_refuses_grads(tmp_path):
    torch.manual_seed(0)
    base = torch.randn(64, 32)
    lora = torch.randn(64 * 4) * 0.1
    with strata.Engine(config(tmp_path), force_no_gpu=True) as e:
        e.freeze_group(0)  # before its tensors: allowed
        assert e.group_frozen(0) and not e.group_frozen(1)
        e.add_param(0, "base.weight", base)
        e.add_param(1, "lora", lora)
        e.build()
        with pytest.raises(strata.Error) as info:
            e.freeze_group(1)
        assert info.value.status == strata.STATE
        with pytest.raises(strata.Error) as info:
            e.grads(0, torch.ones(base.numel()))
        assert info.value.status == strata.INVALID and "group 0 is frozen" in str(info.value)
        with pytest.raises(strata.Error) as info:
            e.read_state(0, "exp_avg")
        assert info.value.status == strata.INVALID and "group 0 is frozen" in str(info.value)

        held = base.reshape(-1).to(torch.bfloat16).to(torch.float32)  # torch rounds to nearest even too
        master = lora.clone()
        # The oracle: torch's AdamW on the trained group alone, with the config's hyperparameters.
        ref = torch.nn.Parameter(lora.clone())
        adamw = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1)
        for step in range(3):
            w = e.fetch_tensor(0).to(torch.float32).clone()
            e.release(0)
            assert torch.equal(w, held)
            e.grads(1, torch.full((lora.numel(),), 0.5 + step))
            e.step()
            ref.grad = torch.full((lora.numel(),), 0.5 + step)
            adamw.step()
        assert torch.equal(e.read_master(0), held)
        assert torch.equal(e.read_state(0, "master"), held)
        assert not torch.equal(e.read_master(1), master)
        # (torch's own rounding of its moments differs by version: close, not bitwise)
        torch.testing.assert_close(e.read_master(1), ref.detach(), rtol=1e-5, atol=1e-6)

        e.save_checkpoint(tmp_path / "ck", "s3")
        other = torch.randn(base.numel())
        e.write_state(0, "master", other)
        assert torch.equal(e.read_master(0), other.to(torch.bfloat16).to(torch.float32))
        e.load_checkpoint(tmp_path / "ck")
        assert torch.equal(e.read_master(0), held)
