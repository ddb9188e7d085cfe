"""Models trained through strata.torch export, with the real strata-export, to
a safetensors file that a fresh model loads with load_state_dict(strict=True):
the engine keeps each tensor's shape and the model's parameter names."""
import json
import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


class Net(torch.nn.Module):
    """Shapes of 1, 2 and 3 dims, in nested modules."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 4, 3)  # weight (4, 2, 3)
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(24), torch.nn.Linear(24, 3))

    def forward(self, x):  # x (B, 2, 8)
        return self.head(torch.relu(self.conv(x)).flatten(1))


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 2, 8, generator=g), torch.randn(16, 3, generator=g)


def exporter():
    path = os.environ.get("STRATA_EXPORT")
    if not path:
        pytest.skip("STRATA_EXPORT (the strata-export binary) is not set")
    return path


def read_safetensors(path):
    """{name: tensor} of a safetensors file, parsed by hand (8-byte LE header
    length, JSON header, raw LE data), as tests/export/check_safetensors.py does."""
    blob = open(path, "rb").read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    header.pop("__metadata__")
    out = {}
    for name, h in header.items():
        assert h["dtype"] == "F32", (name, h)
        b, e = h["data_offsets"]
        a = np.frombuffer(data[b:e], dtype="<f4").copy()
        out[name] = torch.from_numpy(a).reshape(h["shape"])
        assert list(out[name].shape) == h["shape"]
    return out, header


def export(tmp_path, ckpt):
    out = tmp_path / "model.safetensors"
    r = subprocess.run([exporter(), str(ckpt), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return read_safetensors(out)


def assert_loads_into_fresh_model(tensors, masters, trained_from):
    fresh = Net()
    fresh.load_state_dict(tensors, strict=True)  # every key, every shape
    state = fresh.state_dict()
    assert set(state) == set(masters)
    for name, m in masters.items():
        assert torch.equal(state[name], m), name
        # the master weights moved away from the initial ones: training ran
        assert not torch.equal(m, trained_from[name]), name


def test_offload_module_exports_a_state_dict(tmp_path):
    exporter()
    torch.manual_seed(0)
    model = Net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    off = st.offload_module(model, CONFIG, force_no_gpu=True)
    x, y = data()
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        off.step()
    off.engine.save_checkpoint(tmp_path / "ckpt", "step3")
    masters = off.master_parameters()
    off.close()
    tensors, header = export(tmp_path, tmp_path / "ckpt")
    assert header["conv.weight"]["shape"] == [4, 2, 3]
    assert header["head.1.weight"]["shape"] == [3, 24]
    assert header["head.0.bias"]["shape"] == [24]
    assert_loads_into_fresh_model(tensors, masters, initial)


def test_offload_adam_with_named_parameters_exports_a_state_dict(tmp_path):
    exporter()
    torch.manual_seed(0)
    model = Net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = st.OffloadAdam(model.named_parameters(), lr=1e-2, config=CONFIG, force_no_gpu=True)
    x, y = data()
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    (ge,) = opt._engines
    ge.engine.save_checkpoint(tmp_path / "ckpt", "step3")
    masters = dict(zip([n for n, _ in model.named_parameters()], ge.read_masters()))
    opt.close()
    tensors, _ = export(tmp_path, tmp_path / "ckpt")
    assert_loads_into_fresh_model(tensors, masters, initial)
    for name, p in model.named_parameters():  # the model holds the masters too (fp32 compute)
        assert torch.equal(p.detach(), masters[name]), name


def test_add_param_shapes(tmp_path):
    with strata.Engine(CONFIG, force_no_gpu=True) as e:
        assert e.add_param(0, "w", torch.arange(6.0).reshape(2, 3)) == 0
        assert e.add_param(0, "scalar", torch.tensor(5.0)) == 6
        assert e.add_param(0, "given", torch.arange(4.0), shape=(2, 2)) == 7
        assert e.add_param(0, "flat", 3) == 11
        assert e.add_param(0, "counted", 6, shape=[3, 2]) == 14
        with pytest.raises(strata.Error) as err:
            e.add_param(0, "bad", torch.arange(4.0), shape=(3, 2))
        assert err.value.status == strata.INVALID and "'bad'" in err.value.message and "6 elements" in err.value.message
        with pytest.raises(strata.Error) as err:
            e.add_param(0, "neg", 4, shape=(-2, -2))
        assert err.value.status == strata.INVALID and "add_param 'neg': dim 0 of the shape is -2" in err.value.message
        with pytest.raises(strata.Error) as err:
            e.add_param(0, "odd", 4, shape=(2.0, 2))
        assert err.value.status == strata.INVALID and "'odd'" in err.value.message
        e.build()
        e.save_checkpoint(tmp_path / "ckpt", "t")
        tensors, header = export(tmp_path, tmp_path / "ckpt")
    assert [header[n]["shape"] for n in ("w", "scalar", "given", "flat", "counted")] == [[2, 3], [], [2, 2], [3], [3, 2]]
    assert torch.equal(tensors["w"], torch.arange(6.0).reshape(2, 3))
    assert tensors["scalar"].item() == 5.0
    # A checkpoint whose shapes differ from the engine's registration is refused by name.
    with strata.Engine(CONFIG, force_no_gpu=True) as e:
        for name, shape in (("w", (3, 2)), ("scalar", ()), ("given", (2, 2)), ("flat", None), ("counted", (3, 2))):
            numel = int(np.prod(shape)) if shape is not None else 3
            e.add_param(0, name, numel, shape=shape)
        e.build()
        with pytest.raises(strata.Error) as err:
            e.load_checkpoint(tmp_path / "ckpt")
        assert err.value.status == strata.INVALID and "'w'" in err.value.message and "[2, 3]" in err.value.message


def test_a_tied_weight_exports_under_both_names(tmp_path):
    # GPT-2's head shares the token embedding: one master in the engine, an
    # alias in the checkpoint, both names in the file, so a plain torch model
    # with the tie loads it strictly.
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tiny_gpt import TinyGpt, batches, loss_of
    exporter()
    model = TinyGpt()
    off = st.offload_module(model, CONFIG, force_no_gpu=True)
    for x, y in batches(2, 4):
        loss_of(model, x, y).backward()
        off.optimizer.step()
    off.engine.save_checkpoint(tmp_path / "ckpt", "t")
    masters = off.master_parameters()
    off.close()
    tensors, header = export(tmp_path, tmp_path / "ckpt")
    assert torch.equal(tensors["head.weight"], tensors["wte.weight"])
    fresh = TinyGpt(seed=9)
    fresh.load_state_dict(tensors, strict=True)
    assert fresh.head.weight is fresh.wte.weight
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, masters[name]), name


def test_alias_refusals():
    with strata.Engine(CONFIG, force_no_gpu=True) as e:
        e.add_param(0, "w", torch.ones(4))
        with pytest.raises(strata.Error, match="has no tensor 'nope'"):
            e.add_alias(0, "v", "nope")
        e.add_alias(0, "v", "w")
        with pytest.raises(strata.Error, match="already used"):
            e.add_alias(0, "v", "w")
        with pytest.raises(strata.Error, match="already used"):
            e.add_alias(0, "w", "w")
        e.build()
        with pytest.raises(strata.Error, match="after build"):
            e.add_alias(0, "u", "w")
