"""OffloadAdam under strata.nonfinite "error" with several engines (several
param groups, or one group split into cohorts): a NaN in any engine's
gradients fails the step before any engine steps, naming the parameter, so
nothing is updated (docs/config.md: "error: nothing is updated"). Before,
the engines stepped in turn and those ahead of the NaN's were updated."""
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

nn = torch.nn
ERROR = {"strata": {"nonfinite": "error"}}


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(8, 4, generator=g)), nn.Parameter(torch.randn(3, generator=g))


def grads(a, b, seed):
    g = torch.Generator().manual_seed(seed)
    a.grad, b.grad = torch.randn(8, 4, generator=g), torch.randn(3, generator=g)


def snapshot(opt, p):
    return p.detach().clone(), opt.state[p]["step"].clone()


@pytest.mark.parametrize("clip", [None, 1.0], ids=["unclipped", "joint-clip"])
def test_a_nan_in_the_second_groups_gradients_updates_no_group(clip):
    a, b = params()
    cfg = dict(ERROR, **({"gradient_clipping": clip} if clip else {}))
    opt = st.OffloadAdam([dict(params=[a]), dict(params=[b])], lr=1e-2, config=cfg, force_no_gpu=True)
    grads(a, b, 1)
    opt.step()
    before_a, before_b = snapshot(opt, a), snapshot(opt, b)
    grads(a, b, 2)
    b.grad[1] = float("nan")
    with pytest.raises(strata.Error) as e:
        opt.step()
    for p, (value, step) in ((a, before_a), (b, before_b)):
        assert torch.equal(p.detach(), value), "a parameter changed on a step that failed"
        assert torch.equal(opt.state[p]["step"], step), "a step count moved on a step that failed"
    assert e.value.status == strata.INVALID
    assert re.search(r"param group 1.*parameter of shape \(3,\)", str(e.value)), str(e.value)
    # The failed step's gradients are gone: the next one trains on fresh
    # ones, bitwise a twin that never saw the failed batch.
    ta, tb = params()
    twin = st.OffloadAdam([dict(params=[ta]), dict(params=[tb])], lr=1e-2, config=cfg, force_no_gpu=True)
    grads(ta, tb, 1)
    twin.step()
    grads(a, b, 3)
    grads(ta, tb, 3)
    opt.step()
    twin.step()
    assert torch.equal(a.detach(), ta.detach()) and torch.equal(b.detach(), tb.detach())
    opt.close()
    twin.close()


def test_a_nan_in_a_later_cohort_of_one_group_updates_no_cohort():
    """One group split into cohorts (b missed a step): two engines."""
    a, b = params()
    opt = st.OffloadAdam([("a", a), ("b", b)], lr=1e-2, config=ERROR, force_no_gpu=True)
    grads(a, b, 1)
    b.grad = None
    opt.step()  # a steps alone: a's cohort and b's
    grads(a, b, 2)
    b.grad[0] = float("inf")
    before = snapshot(opt, a)
    with pytest.raises(strata.Error) as e:
        opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(opt.state[a]["step"], before[1])
    assert float(opt.state[b].get("step", 0)) == 0
    assert "parameter 'b'" in str(e.value), str(e.value)
    opt.close()


WORKER = r'''
import os, sys, torch, strata, strata.torch as st
rank = int(os.environ["RANK"])
g = torch.Generator().manual_seed(0)
a, b = torch.nn.Parameter(torch.randn(8, 4, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))
opt = st.OffloadAdam([dict(params=[a]), dict(params=[b])], lr=1e-2, force_no_gpu=True,
                     config={"strata": {"nonfinite": "error", "timeout": 60}})
a.grad, b.grad = torch.ones(8, 4), torch.ones(3)
before = a.detach().clone()
if rank == 1:
    b.grad[0] = float("nan")  # this rank's only
try:
    opt.step()
    sys.exit(f"rank {rank}: the step did not fail")
except strata.Error as e:
    assert torch.equal(a.detach(), before), f"rank {rank}: a changed"
    assert e.status == strata.INVALID and "param group 1" in str(e), str(e)
a.grad, b.grad = torch.ones(8, 4), torch.ones(3)
opt.step()  # the ranks go on together
opt.close()
open(os.path.join(sys.argv[1], f"ok{rank}"), "w").close()
'''


def test_a_nan_on_one_rank_fails_the_step_on_every_rank_before_any_engine_steps(tmp_path):
    """With several ranks the check is every rank's (a sum over the ranks):
    a rank whose own gradients are finite fails too, instead of stepping the
    first engine alone and waiting for the other rank."""
    here = os.path.dirname(os.path.abspath(__file__))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    p = subprocess.run([sys.executable, os.path.join(here, "run_ddp.py"), str(worker), "--expect", "ok1"],
                       capture_output=True, text=True, timeout=600)
    if p.returncode == 77:
        pytest.skip(p.stdout.strip())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
