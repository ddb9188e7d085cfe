"""What a review of OffloadAdam and offload_module's optimizer found
(session 34), each against torch: clipping that spans several engines
(several param groups, or one group split because a parameter missed a
step) clips by the norm of them all, not each engine by its own; a
non-finite gradient in one engine skips the whole step; a closed OffloadAdam
refuses to train instead of starting over; a refused param group is not
left behind, and an added one clips with the rest; state_dicts whose shapes,
options or moments the step would not honour are refused before anything
changes, and a group saved without state starts from zero moments."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

nn = torch.nn


def grads(n, shapes, seed=3):
    """n steps of gradients for parameters of `shapes`, the first step's large (so a clip at 1 bites)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) * (50.0 if k == 0 else 0.3) for s in shapes] for k in range(n)]


def params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


SHAPES = [(8, 4), (8,), (3, 8), (3,)]


def test_the_configs_gradient_clipping_clips_two_param_groups_by_their_joint_norm():
    ours, ref = params(SHAPES), params(SHAPES)
    opt = st.OffloadAdam([dict(params=ours[:2]), dict(params=ours[2:], weight_decay=0.0)],
                         lr=1e-2, config={"gradient_clipping": 1.0}, force_no_gpu=True)
    torch_opt = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:], "weight_decay": 0.0}], lr=1e-2)
    for gs in grads(3, SHAPES):
        for p, q, g in zip(ours, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        torch_opt.step()
        assert max(n for n, _ in opt.last_results) > 1.0  # each engine's own norm: the clip bit
    for p, q in zip(ours, ref):
        close(p.detach(), q.detach())
    opt.close()


def test_each_param_groups_max_grad_norm_clips_its_group_alone():
    ours, ref = params(SHAPES), params(SHAPES)
    opt = st.OffloadAdam([dict(params=ours[:2], max_grad_norm=1.0), dict(params=ours[2:], max_grad_norm=0.25)],
                         lr=1e-2, force_no_gpu=True)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    for gs in grads(3, SHAPES):
        for p, q, g in zip(ours, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref[:2], 1.0)
        torch.nn.utils.clip_grad_norm_(ref[2:], 0.25)
        torch_opt.step()
    for p, q in zip(ours, ref):
        close(p.detach(), q.detach())
    opt.close()


def test_a_group_split_by_a_parameter_that_missed_a_step_still_clips_as_one():
    """Step 1: the last parameter has no gradient (skipped, as torch skips
    it): the group's engine splits in two. Steps 2-3: all have gradients;
    the clip spans both engines."""
    ours, ref = params(SHAPES), params(SHAPES)
    opt = st.OffloadAdam([dict(params=ours, max_grad_norm=1.0)], lr=1e-2, force_no_gpu=True)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    for k, gs in enumerate(grads(3, SHAPES)):
        for i, (p, q, g) in enumerate(zip(ours, ref, gs)):
            p.grad, q.grad = (None, None) if k == 0 and i == 3 else (g.clone(), g.clone())
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        torch_opt.step()
    assert len(opt._engines) == 2
    for p, q in zip(ours, ref):
        close(p.detach(), q.detach())
    opt.close()


def test_a_non_finite_gradient_in_one_group_skips_every_groups_step():
    ours = params(SHAPES)
    opt = st.OffloadAdam([dict(params=ours[:2]), dict(params=ours[2:])], lr=1e-2, force_no_gpu=True)
    for p, g in zip(ours, grads(1, SHAPES)[0]):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in ours]
    for p, g in zip(ours, grads(1, SHAPES, seed=4)[0]):
        p.grad = g
    ours[3].grad[0] = float("nan")
    opt.step()  # (the engines warn of the NaN)
    assert all(skipped for _, skipped in opt.last_results)
    for p, b in zip(ours, before):
        assert torch.equal(p.detach(), b)
    assert all(float(opt.state[p]["step"]) == 1 for p in ours)
    opt.close()


def test_a_closed_offload_adam_refuses_to_train_on():
    (a,) = params([(4,)])
    opt = st.OffloadAdam([a], lr=0.1, force_no_gpu=True)
    a.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    opt.close()
    a.grad = torch.ones(4)
    for call in (opt.step, opt.state_dict, lambda: opt.load_state_dict(sd),
                 lambda: opt.clip_grad_norm_(1.0), lambda: opt.add_param_group({"params": params([(2,)])})):
        with pytest.raises(strata.Error, match="closed") as e:
            call()
        assert e.value.status == strata.STATE


def test_a_refused_param_group_is_not_added_and_an_added_one_clips_with_the_rest():
    a, c = params([(4,), (4,)])
    opt = st.OffloadAdam([a], lr=0.1, weight_decay=0.0, force_no_gpu=True)
    with pytest.raises(strata.Error, match="float64"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [c]})
    ref_a, ref_c = params([(4,), (4,)])
    torch_opt = torch.optim.AdamW([ref_a, ref_c], lr=0.1, weight_decay=0.0)
    for p in (a, c, ref_a, ref_c):
        p.grad = torch.full((4,), 3.0)
    norm = torch.nn.utils.clip_grad_norm_([a, c], 1.0)  # ours (both registered): torch's own, on one rank
    ref_norm = torch.nn.utils.clip_grad_norm_([ref_a, ref_c], 1.0)
    assert torch.equal(norm, ref_norm)
    opt.step()
    torch_opt.step()
    assert torch.equal(a.detach(), ref_a.detach()) and torch.equal(c.detach(), ref_c.detach())
    opt.close()


def test_offload_adam_refuses_a_saved_state_of_another_shape_and_trains_on():
    big = nn.Linear(4, 8)
    t = torch.optim.AdamW(big.parameters())
    big(torch.randn(2, 4)).sum().backward()
    t.step()
    small = nn.Linear(4, 4)
    opt = st.OffloadAdam(small.parameters(), force_no_gpu=True)
    with pytest.raises(strata.Error, match=r"exp_avg has shape \(8, 4\), not the parameter's \(4, 4\)"):
        opt.load_state_dict(t.state_dict())
    small(torch.randn(2, 4)).sum().backward()
    opt.step()  # the engines were left as they were
    assert float(opt.state[small.weight]["step"]) == 1
    opt.close()


def module_and_data():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(3, 4)


def test_offload_module_load_of_a_state_without_moments_starts_them_from_zero():
    m, x = module_and_data()
    off = st.offload_module(m, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}, force_no_gpu=True)
    empty = off.optimizer.state_dict()
    assert empty["state"] == {}
    for _ in range(3):
        m(x).square().sum().backward()
        off.optimizer.step()
    assert off.engine.read_state(0, "exp_avg").abs().sum() > 0
    off.optimizer.load_state_dict(empty)
    for gi in range(off.engine.num_groups):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.count_nonzero(off.engine.read_state(gi, k)) == 0, (gi, k)
        assert off.engine.group_steps(gi) == 0
    off.close()


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_offload_module_refuses_a_torch_state_dict_asking_what_it_does_not_do(option):
    m, x = module_and_data()
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    t = torch.optim.AdamW(ref.parameters(), **{option: True})
    ref(x).sum().backward()
    t.step()
    off = st.offload_module(m, {"optimizer": {"type": "AdamW"}}, force_no_gpu=True)
    before = off.engine.read_state(0, "exp_avg").clone()
    with pytest.raises(strata.Error, match=option):
        off.optimizer.load_state_dict(t.state_dict())
    assert torch.equal(off.engine.read_state(0, "exp_avg"), before)
    off.close()


def test_offload_module_refuses_a_group_saved_with_state_for_only_some_parameters():
    m, x = module_and_data()
    off = st.offload_module(m, {"optimizer": {"type": "AdamW"}}, force_no_gpu=True)
    m(x).square().sum().backward()
    off.optimizer.step()
    sd = off.optimizer.state_dict()
    del sd["state"][1]  # the first Linear's bias: its weight keeps state
    with pytest.raises(strata.Error, match=r"parameters \[0\] have state and \[1\] none"):
        off.optimizer.load_state_dict(sd)
    off.close()


@pytest.mark.parametrize("clip", [None, 1.0], ids=["unclipped", "joint-clip"])
def test_a_step_that_fails_never_leaves_gradients_a_later_step_would_apply(clip):
    """strata.nonfinite "error": a NaN in the first group's gradients fails
    the step. Unclipped, the second group's engine was never handed its
    gradients; under a joint clip it was, and they are dropped
    (discard_grads; before, the optimizer refused to go on until a load).
    Either way the next step trains on fresh gradients: bitwise a run that
    never saw the failed batch."""
    def make():
        ps = params(SHAPES)
        cfg = {"strata": {"nonfinite": "error"}, **({"gradient_clipping": clip} if clip else {})}
        return ps, st.OffloadAdam([dict(params=ps[:2]), dict(params=ps[2:])], lr=1e-2, config=cfg,
                                  force_no_gpu=True)

    ours, opt = make()
    twin, twin_opt = make()
    for ps, o in ((ours, opt), (twin, twin_opt)):
        for p, g in zip(ps, grads(1, SHAPES)[0]):
            p.grad = g
        o.step()
    for p, g in zip(ours, grads(1, SHAPES, seed=4)[0]):
        p.grad = g
    ours[0].grad[0, 0] = float("nan")
    with pytest.raises(strata.Error):
        opt.step()
    for ps, o in ((ours, opt), (twin, twin_opt)):
        for p, g in zip(ps, grads(1, SHAPES, seed=5)[0]):
            p.grad = g
        o.step()  # fresh gradients everywhere
    assert not any(skipped for _, skipped in opt.last_results)
    for a, b in zip(ours, twin):
        assert torch.equal(a, b)
    opt.close()
    twin_opt.close()
