"""Gradients handed in parts (strata_engine_grads_part / grads_end): through
the binding, bitwise one grads() call of the gradient the parts make; and
offload_module, which hands every gradient as a part where the engine takes
it (one rank, host memory), trains bitwise as it does staging each group
whole: clipped by the config or by clip_grad_norm_ (whose norms it then
takes from the engine's accumulator), with a parameter that backward
reaches twice before the rest of its group (a reentrant checkpoint): its
part is added to."""
import pytest

torch = pytest.importorskip("torch")
import torch.utils.checkpoint  # noqa: E402
import strata  # noqa: E402
import strata.torch as st  # noqa: E402
from strata.torch import _module_group  # noqa: E402

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
          "gradient_clipping": 0.05,
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "offload_param": {"device": "cpu"}},
          "strata": {"device_budget": "8MiB", "host_budget": "32MiB"}}


def test_binding_parts_are_one_grads_call():
    torch.manual_seed(0)
    w0 = torch.randn(70000)  # more than one tile of the norm's sum (65536)
    grads = [torch.randn(70000) for _ in range(3)]
    results = []
    for parts in (True, False):
        with strata.Engine(CONFIG, force_no_gpu=True) as e:
            e.add_param(0, "w", w0)
            e.build()
            assert e.takes_grad_parts(0, "f32") and not e.takes_grad_parts(0, "bf16")
            norms = []
            for g in grads:
                if parts:
                    e.grads_part(0, 66000, g[66000:])
                    e.grads_part(0, 0, g[:100])
                    e.grads_part(0, 100, g[100:66000])
                    e.grads_part(0, 0, g[:100])  # given again: added
                    e.grads_end(0)
                else:
                    whole = g.clone()
                    whole[:100] += g[:100]
                    e.grads(0, whole)
                    assert torch.equal(e.grads_view(0), whole)
                norms.append(e.step()[0])
            results.append((norms, e.read_master(0)))
    assert results[0][0] == results[1][0]
    assert results[0][0][0] > 0.05  # clipped: the coefficient depends on the norm's every bit
    assert torch.equal(results[0][1], results[1][1])


def test_binding_refuses_overlapping_parts():
    with strata.Engine(CONFIG, force_no_gpu=True) as e:
        e.add_param(0, "w", torch.zeros(1000))
        e.build()
        e.grads_part(0, 0, torch.ones(600))
        with pytest.raises(strata.Error, match=r"overlap the part \[0, 600\)"):
            e.grads_part(0, 500, torch.ones(100))
        with pytest.raises(strata.Error, match="parts open"):
            e.step()
        e.grads_end(0)
        with pytest.raises(strata.Error, match="already has gradients"):
            e.grads_part(0, 0, torch.ones(10))
        e.step()


class Pair(torch.nn.Module):
    """One group of two parameters; backward reaches `a` twice (inside a
    reentrant checkpoint, then outside it) before it reaches `b`."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(32) * 0.5 + 1.0)
        self.b = torch.nn.Parameter(torch.randn(32) * 0.1)

    def forward(self, h):
        h = (h + self.b) * self.a
        return torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(t * self.a), h, use_reentrant=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(300, 32)
        self.pair = Pair()
        self.head = torch.nn.Linear(32, 300)

    def forward(self, x):
        return self.head(self.pair(self.emb(x)))


def train(parts, clip_fn, overlap, backwards=1):
    torch.manual_seed(0)
    model = Net()
    off = st.offload_module(model, CONFIG, force_no_gpu=True, overlap_step=overlap)
    groups = [g for g in off._groups if not g.frozen]
    assert all(g.takes_parts for g in groups), "on the CPU every group takes its gradients in parts"
    if not parts:
        for g in groups:
            g.takes_parts = False
    handed = []
    engine_part = off.engine.grads_part
    off.engine.grads_part = lambda *a, **k: handed.append(a[0]) or engine_part(*a, **k)
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(4):
        for _ in range(backwards):  # a second one: each group's second hand of the step is whole (added)
            x = torch.randint(0, 300, (4, 16), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
        if clip_fn:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        off.optimizer.step()
        off.optimizer.zero_grad()
        norms.append(off.optimizer.last_result[0])
    # Parts where the engine takes them (each group's, every step), none else.
    assert len(handed) == (4 * (sum(len(g.params) for g in groups) + 1) if parts else 0), handed  # `a` twice
    masters = off.master_parameters()
    off.close()
    return norms, masters


@pytest.mark.parametrize("overlap", [False, None], ids=["plain", "overlap"])
@pytest.mark.parametrize("clip_fn", [False, True], ids=["config-clip", "clip_grad_norm_"])
def test_offload_module_parts_train_as_staged(clip_fn, overlap):
    got, ref = train(True, clip_fn, overlap), train(False, clip_fn, overlap)
    assert got[0] == ref[0]
    assert set(got[1]) == set(ref[1])
    bad = [n for n in got[1] if not torch.equal(got[1][n], ref[1][n])]
    assert not bad, f"master weights differ: {bad}"


def test_two_backwards_a_step_add_as_staged():
    got, ref = train(True, False, False, backwards=2), train(False, False, False, backwards=2)
    assert got[0] == ref[0]
    assert all(torch.equal(got[1][n], ref[1][n]) for n in ref[1])


def test_clip_grad_norm_from_the_accumulator_is_torchs():
    """clip_grad_norm_'s norm, taken from the engine's accumulator, is the
    one torch takes of the same gradients (one backward, no checkpoint)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Tanh(), torch.nn.Linear(50, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Tanh(), torch.nn.Linear(50, 3))
    twin.load_state_dict(model.state_dict())
    off = st.offload_module(model, CONFIG, force_no_gpu=True)
    x = torch.randn(8, 40)
    model(x).square().mean().backward()
    assert any(isinstance(n, _module_group._LazyNorm) for n in off._norms.values())
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    twin(x).square().mean().backward()
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    assert torch.equal(got, want)
    off.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_the_binding_holds_lent_gradients_only_while_the_engine_reads_them(device, tmp_path):
    """One rank: with the state in host memory the step reads a lent
    gradient's whole tiles where autograd put them, so the binding holds it
    until step() returns; on NVMe the engine copies it, and the binding lets
    it go as the group's grads_end returns (strata_engine_grads_lent)."""
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": device, "nvme_path": str(tmp_path)},
                                 "offload_param": {"device": "cpu"}}}
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)  # 131072 weights: two whole 65536-element tiles
    off = st.offload_module(model, cfg, force_no_gpu=True, overlap_step=False)
    (g,) = off._groups
    model(torch.randn(4, 256)).square().sum().backward()
    if device == "cpu":
        assert off.engine.grads_lent(g.index)
        assert sorted(t.numel() for t in off.engine._lent[g.index]) == [512, 131072], off.engine._lent
    else:
        assert not off.engine.grads_lent(g.index)
        assert off.engine._lent == {}
    off.optimizer.step()
    assert not off.engine.grads_lent(g.index)
    off.close()


def test_a_copied_group_is_let_go_though_a_group_lent_before_it_is_still_read():
    """One rank, state in host memory: the large layer's gradient is read in
    place by the step, so the binding holds it until step() returns. The small
    layer's gradient, lent after it, is under one tile and so was copied: the
    binding lets it go as its grads_end returns, not behind the large one."""
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 256), torch.nn.Linear(256, 512))  # 1280 and 131584
    off = st.offload_module(model, cfg, force_no_gpu=True, overlap_step=False)
    small, large = off._groups
    model(torch.randn(4, 4)).square().sum().backward()  # the large layer's grads_end first
    assert off.engine.grads_lent(large.index) and not off.engine.grads_lent(small.index)
    assert list(off.engine._lent) == [large.index], off.engine._lent
    off.optimizer.step()
    assert off.engine._lent == {}
    off.close()
