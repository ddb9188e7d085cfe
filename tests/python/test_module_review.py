"""offload_module and the binding after a review (session 35): a module
registered under two names (T5's and BART's shared embedding) keeps its
weights under both in state_dict; zero_grad after a backward that raised
drops what that backward gave (as torch does), or says loudly why it cannot;
a forward under inference_mode leaves the parameters trainable; the model's
forward keeps its signature; the binding refuses float64 or CUDA memory
where the kernel reads float32 host memory."""
import copy
import inspect

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}}


def config(**strata_keys):
    cfg = {"zero_optimization": {"stage": 3}, "optimizer": copy.deepcopy(ADAMW)}
    if strata_keys:
        cfg["strata"] = dict(strata_keys)
    return cfg


def bits(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_bits(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- a module under two names -------------------------------------------------

class Shared(nn.Module):
    """One Linear under two names (as T5's `shared` and `encoder.embed_tokens`)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.mid = nn.Tanh()
        self.again = self.first  # the same module, registered again
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.again(self.mid(self.first(x))))


def test_a_module_under_two_names_keeps_its_weights_under_both():
    torch.manual_seed(0)
    model = Shared()
    want = bits(model)
    assert "again.weight" in want
    off = st.offload_module(model, config(), force_no_gpu=True)
    got = bits(model)
    assert same_bits(got, want), "a name of the shared module read as the placeholder's zeros"
    assert torch.equal(off.master_parameters()["again.weight"], want["first.weight"])
    # Trained: both names give the trained weight, and a plain model loads it.
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
    trained = bits(model)
    assert torch.equal(trained["again.weight"], trained["first.weight"])
    assert not torch.equal(trained["first.weight"], want["first.weight"])
    plain = Shared()
    plain.load_state_dict(trained)
    assert torch.equal(plain.first.weight, trained["first.weight"])
    off.close()


# ---- zero_grad after a backward that raised -----------------------------------

def _two_layers():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _raise_midway(model, x):
    """A backward that raises after the last layer's gradients are in (so
    its group went to the engine), before the first layer's."""
    h = model[1](model[0](x))

    def boom(_):
        raise RuntimeError("a hook refused this batch")

    h.register_hook(boom)
    with pytest.raises(RuntimeError, match="refused this batch"):
        model[2](h).sum().backward()


@pytest.mark.parametrize("cfg", [dict(overlap_step=False, strata={}),
                                 dict(overlap_step=None, strata={}),  # speculative by default (nonfinite "skip")
                                 dict(overlap_step=False, strata={"nonfinite": "apply"})],
                         ids=["plain", "overlap-speculative", "apply"])
def test_zero_grad_after_a_backward_that_raised_drops_its_gradients(cfg):
    x1, x2 = torch.randn(5, 6), torch.randn(5, 6)
    twin = _two_layers()
    off_twin = st.offload_module(twin, config(**cfg["strata"]), force_no_gpu=True, overlap_step=cfg["overlap_step"])
    twin(x2).sum().backward()
    off_twin.optimizer.step()
    off_twin.optimizer.zero_grad()
    twin(x2).sum().backward()
    off_twin.optimizer.step()
    want = bits(twin)
    off_twin.close()

    model = _two_layers()
    off = st.offload_module(model, config(**cfg["strata"]), force_no_gpu=True, overlap_step=cfg["overlap_step"])
    model(x2).sum().backward()
    off.optimizer.step()
    off.optimizer.zero_grad()
    _raise_midway(model, x1)
    off.optimizer.zero_grad()  # skip the bad batch: its gradients go, as torch's would
    model(x2).sum().backward()
    off.optimizer.step()
    assert same_bits(bits(model), want), "the step summed the raised backward's gradients"
    assert off.engine.steps == 2
    off.close()


def test_zero_grad_says_why_when_the_early_update_is_final():
    # overlap_step without speculation (no clipping, no fp16, nonfinite
    # "apply"): the last layer's update ran as its gradients completed and
    # cannot be taken back; zero_grad says so instead of dropping half a step.
    x1 = torch.randn(5, 6)
    model = _two_layers()
    off = st.offload_module(model, config(nonfinite="apply"), force_no_gpu=True, overlap_step=True)
    model(x1).sum().backward()
    off.optimizer.step()
    off.optimizer.zero_grad()
    _raise_midway(model, x1)
    with pytest.raises(strata.Error, match="zero_grad after a backward that raised"):
        off.optimizer.zero_grad()
    off.optimizer.step()  # as the error says: the step applies what went in
    assert off.engine.steps == 2
    off.close()


# ---- a forward under inference_mode --------------------------------------------

def test_a_forward_under_inference_mode_leaves_training_as_it_was():
    x = torch.randn(5, 6)
    ref = _two_layers()
    off_ref = st.offload_module(ref, config(), force_no_gpu=True)
    for _ in range(2):
        ref(x).sum().backward()
        off_ref.optimizer.step()
        off_ref.optimizer.zero_grad()
    want = bits(ref)
    off_ref.close()

    model = _two_layers()
    off = st.offload_module(model, config(), force_no_gpu=True)
    for _ in range(2):
        with torch.inference_mode():  # Lightning's validation
            model(x)
        model(x).sum().backward()
        off.optimizer.step()
        off.optimizer.zero_grad()
    assert same_bits(bits(model), want)
    off.close()


# ---- the model's forward keeps its signature -------------------------------------

class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None, labels=None):
        """The model's own docstring."""
        return self.lin(input_ids)


def test_the_forward_keeps_its_signature():
    model = Named()
    want = inspect.signature(model.forward)
    off = st.offload_module(model, config(), force_no_gpu=True)
    assert inspect.signature(model.forward) == want  # Hugging Face's Trainer picks columns by it
    assert model.forward.__doc__ == "The model's own docstring."
    off.close()


# ---- the binding's memory checks ------------------------------------------------

def test_adam_step_refuses_what_the_kernel_cannot_read():
    np = pytest.importorskip("numpy")
    g = np.zeros(64, dtype=np.float32)
    m, v = np.zeros(64, dtype=np.float32), np.zeros(64, dtype=np.float32)
    p64 = np.ones(64)  # numpy's default: float64
    with pytest.raises(strata.Error, match="param is float64; it must be float32"):
        strata.adam_step(p64, g, m, v, step=1)
    assert (p64 == 1).all()
    with pytest.raises(strata.Error, match="exp_avg_sq is float16"):
        strata.adam_step(np.ones(64, dtype=np.float32), g, m, v.astype(np.float16), step=1)
    p = torch.ones(64)
    strata.adam_step(p, torch.ones(64), torch.zeros(64), torch.zeros(64), step=1, lr=0.1)
    assert (p < 1).all()


def test_a_host_engine_refuses_cuda_memory():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: a CUDA tensor cannot be made here")
    e = strata.Engine(config(), force_no_gpu=True)
    e.add_param(0, "w", 16)
    e.build()
    with pytest.raises(strata.Error, match="this engine has no GPU"):
        e.grads(0, torch.zeros(16, device="cuda"))
    with pytest.raises(strata.Error, match="this engine has no GPU"):
        e.stash(torch.zeros(16, device="cuda"))
    e.close()


# ---- OffloadAdam: zero_grad after clip_grad_norm_ without a step ----------------

def test_offload_adam_zero_grad_drops_a_clip_whose_step_never_came():
    # clip_grad_norm_, then the batch is skipped (no step): zero_grad drops
    # the clip with the gradients it was for, as torch's (which scaled .grad
    # itself) would, and the next step clips at the config's
    # gradient_clipping again. Before, it kept the skipped batch's clip: no
    # clipping (float32: torch's function clipped .grad in place), or the old
    # coefficient (bf16 or fp16 gradients).
    torch.manual_seed(3)
    shapes = [(6, 4), (4,)]
    init = [torch.randn(s) for s in shapes]
    g1 = [torch.randn(s) * 100 for s in shapes]  # clipped hard
    g2 = [torch.randn(s) * 10 for s in shapes]  # clipped by the config too

    def run(skip_a_clipped_batch):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = st.OffloadAdam(ps, lr=1e-2, config={"gradient_clipping": 0.05}, force_no_gpu=True)
        if skip_a_clipped_batch:
            for p, g in zip(ps, g1):
                p.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(ps, 0.1)
            opt.zero_grad()
        for p, g in zip(ps, g2):
            p.grad = g.clone()
        opt.step()
        out = [p.detach().clone() for p in ps]
        opt.close()
        return out

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
