"""Decoupled (AdamW) or L2 (Adam) weight decay: torch 2.x's Adam and AdamW
say which in each param group (decoupled_weight_decay). OffloadAdam is
AdamW: a group, or a loaded state_dict, that asks for L2 decay with a
weight_decay other than 0 is refused, naming the key and the alternative
(before, it trained as AdamW without a word). offload_module's optimizer
steps with the engine's mode (the config's optimizer): a loaded group whose
decoupled_weight_decay says the other is refused, naming both."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

nn = torch.nn
HAS_KEY = "decoupled_weight_decay" in torch.optim.Adam([nn.Parameter(torch.zeros(1))]).defaults
needs_key = pytest.mark.skipif(not HAS_KEY, reason="this torch's Adam has no decoupled_weight_decay")


def params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3, generator=g)), nn.Parameter(torch.randn(3, generator=g))]


def trained(opt_class, ps, **kw):
    t = opt_class(ps, **kw)
    for p in ps:
        p.grad = torch.ones_like(p)
    t.step()
    return t.state_dict()


def test_a_param_group_asking_for_l2_decay_is_refused():
    with pytest.raises(strata.Error, match="decoupled_weight_decay=False") as e:
        st.OffloadAdam([{"params": params(), "weight_decay": 0.1, "decoupled_weight_decay": False}],
                       force_no_gpu=True)
    assert e.value.status == strata.INVALID and "offload_module" in str(e.value)
    opt = st.OffloadAdam(params(), weight_decay=0.1, force_no_gpu=True)
    with pytest.raises(strata.Error, match="decoupled_weight_decay=False"):
        opt.add_param_group({"params": params(), "weight_decay": 0.1, "decoupled_weight_decay": False})
    assert len(opt.param_groups) == 1
    opt.close()


def test_l2_decay_of_zero_is_no_decay_and_is_taken():
    opt = st.OffloadAdam([{"params": params(), "weight_decay": 0.0, "decoupled_weight_decay": False}],
                         force_no_gpu=True)
    opt.close()


@needs_key
def test_a_torch_adam_state_dict_with_weight_decay_is_refused_before_anything_changes():
    ps = params()
    opt = st.OffloadAdam(ps, lr=1e-2, weight_decay=0.1, force_no_gpu=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in ps]
    saved = trained(torch.optim.Adam, params(), weight_decay=0.1)
    with pytest.raises(strata.Error, match="param group 0 has decoupled_weight_decay=False") as e:
        opt.load_state_dict(saved)
    assert e.value.status == strata.INVALID
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[0]["decoupled_weight_decay"]
    opt.close()


def test_a_torch_adamw_state_dict_and_an_adam_one_without_decay_load():
    for saved in (trained(torch.optim.AdamW, params(), weight_decay=0.1), trained(torch.optim.Adam, params())):
        opt = st.OffloadAdam(params(), force_no_gpu=True)
        opt.load_state_dict(saved)
        opt.close()


def module_and_config(adam_w_mode):
    model = nn.Linear(3, 2)
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": adam_w_mode}}}
    return model, st.offload_module(model, cfg, force_no_gpu=True)


@needs_key
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["engine-adamw", "engine-l2"])
def test_offload_module_refuses_a_state_dict_whose_decay_is_not_the_engines(adam_w_mode):
    model, off = module_and_config(adam_w_mode)
    ref = nn.Linear(3, 2)
    other = torch.optim.Adam if adam_w_mode else torch.optim.AdamW  # the other mode
    saved = trained(other, list(ref.parameters()), weight_decay=0.1)
    before = off.engine.read_state(0, "exp_avg").clone()
    with pytest.raises(strata.Error, match="decoupled_weight_decay") as e:
        off.optimizer.load_state_dict(saved)
    assert e.value.status == strata.INVALID and "adam_w_mode" in str(e.value), str(e.value)
    assert torch.equal(off.engine.read_state(0, "exp_avg"), before)
    same = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    off.optimizer.load_state_dict(trained(same, list(ref.parameters()), weight_decay=0.1))
    off.close()


@needs_key
def test_offload_module_optimizer_says_its_mode_in_its_group():
    for mode in (True, False):
        _, off = module_and_config(mode)
        assert off.optimizer.param_groups[0]["decoupled_weight_decay"] is mode
        assert off.optimizer.state_dict()["param_groups"][0]["decoupled_weight_decay"] is mode
        off.close()
