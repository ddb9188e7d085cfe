"""Ranks whose batches leave different parameters without a gradient, as a
data-dependent model does (a branch one rank's batch skips; torch's
zero_grad(set_to_none=True) leaves its .grad None).

OffloadAdam steps the same parameters on every rank, as torch DDP does: a
parameter with a gradient on any rank steps on every rank, with the
gradient averaged over the ranks, zeros where a rank has none, within
seconds, and later steps and engines still work. Before, the rank without
the gradient alone split its engine (new engines, new rendezvous ports):
the ranks' collectives paired wrongly (COMM, or a wait until strata.timeout)
and the communicator broke.

offload_module hands its groups as backward reaches them: a module one
rank's batch skips fails that step on every rank at once with COMM naming
both ranks' collectives (as torch DDP refuses unused parameters unless told
to look for them), never a wait until strata.timeout, never a silent
update.

Also: the binding's group indices outside the C API's 0..1000000 are
refused, not wrapped by ctypes into another group.

Run as a script (CASE OUT), it is one rank of a two-rank test."""
import copy
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import oracle  # noqa: E402
from two_ranks import run_two_ranks  # noqa: E402

TIMEOUT = 20  # strata.timeout of the ranks' engines: a wait shows as a failure after it
BOUND = 8.0  # seconds a step may take on a rank: well below TIMEOUT
LR, WD = 1e-2, 0.01
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.999], "eps": 1e-8}}


# ---- the binding's group indices ---------------------------------------------------

BAD_GROUPS = [2 ** 32, 2 ** 32 + 1, 2 ** 31, -2 ** 32, 1_000_001, -1, 1.5, True]


@pytest.mark.parametrize("bad", BAD_GROUPS, ids=[repr(b) for b in BAD_GROUPS])
def test_a_group_index_outside_the_c_apis_range_is_refused_naming_it(bad):
    # ctypes passes an int argument as a C int modulo 2**32: add_param(2**32)
    # registered the tensor in group 0, without a word; int() cut 1.5 to 1.
    e = strata.Engine({}, world_size=1, force_no_gpu=True)
    try:
        def refused(what, call):
            with pytest.raises(strata.Error) as info:
                call()
            assert info.value.status == strata.INVALID, (what, info.value)
            assert what in str(info.value) and "0..1000000" in str(info.value), str(info.value)

        refused("add_param 'w2'", lambda: e.add_param(bad, "w2", 4))
        refused("add_param 'w3'", lambda: e.add_param(bad, "w3", torch.ones(2, 2)))
        e.add_param(0, "w", torch.arange(4.0))
        refused("add_alias", lambda: e.add_alias(bad, "v", "w"))
        refused("freeze_group", lambda: e.freeze_group(bad))
        refused("group_frozen", lambda: e.group_frozen(bad))
        e.build()
        assert e.num_groups == 1 and e.group_numel(0) == 4, "a refused add_param landed in group 0"
        g = torch.zeros(4)
        for what, call in [("fetch", lambda: e.fetch(bad)), ("fetch", lambda: e.fetch_tensor(bad)),
                           ("release", lambda: e.release(bad)), ("grads", lambda: e.grads(bad, g)),
                           ("grads_part", lambda: e.grads_part(bad, 0, g)), ("grads_end", lambda: e.grads_end(bad)),
                           ("grads_lent", lambda: e.grads_lent(bad)), ("grads_view", lambda: e.grads_view(bad)),
                           ("takes_grad_parts", lambda: e.takes_grad_parts(bad)),
                           ("read_state", lambda: e.read_state(bad, "master")),
                           ("write_state", lambda: e.write_state(bad, "master", g)),
                           ("group_steps", lambda: e.group_steps(bad)),
                           ("set_group_steps", lambda: e.set_group_steps(bad, 0)),
                           ("read_master", lambda: e.read_master(bad)), ("group_numel", lambda: e.group_numel(bad))]:
            refused(what, call)
        assert torch.equal(e.read_master(0), torch.arange(4.0))
    finally:
        e.close()


def test_a_numpy_or_tensor_group_index_is_taken():
    np = pytest.importorskip("numpy")
    e = strata.Engine({}, world_size=1, force_no_gpu=True)
    try:
        e.add_param(np.int64(0), "w", torch.arange(3.0))
        e.build()
        assert torch.equal(e.read_master(torch.tensor(0)), torch.arange(3.0))
        assert e.group_numel(np.int32(0)) == 3
    finally:
        e.close()


# ---- the models, their batches, and what each rank drops -----------------------------

def _mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


class Branchy(nn.Module):
    """b is a branch a batch may skip (mode "skip"), or compute without it
    reaching the loss ("detach")."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, mode="use"):
        if mode == "none":
            return x.new_zeros(x.shape[0], 3).requires_grad_()
        h = torch.tanh(self.a(x))
        if mode == "use":
            h = h + torch.tanh(self.b(h))
        elif mode == "detach":
            h = h + torch.tanh(self.b(h)).detach()
        return self.c(h)


def _batch(rank, step, k=0):
    g = torch.Generator().manual_seed(1000 + 100 * rank + 10 * step + k)
    return torch.randn(5, 4, generator=g)


def _loss(out):
    return out.pow(2).mean()


# OffloadAdam: per step, the parameter rank 1 leaves without a gradient
# (None: none), and whether clip_grad_norm_ (max_norm far above the norm:
# nothing is clipped) comes before the step.
ADAM_STEPS = [("2.bias", False), (None, False), ("0.weight", True), ("all", False), (None, True)]
# offload_module: rank 1 skips b in the first step's backward.
MODULE_STEPS = [["skip"]]
NO_CLIP = 1e6


# ---- the ranks ---------------------------------------------------------------------

def _timed(record, call):
    t0 = time.monotonic()
    try:
        call()
        record.append(("ok", None, time.monotonic() - t0))
        return True
    except strata.Error as e:
        record.append((strata.STATUS_NAMES[e.status], str(e), time.monotonic() - t0))
        return False


def _adam_rank(stage, out):
    rank = int(os.environ["RANK"])
    cfg = {"zero_optimization": {"stage": stage}, "strata": {"timeout": TIMEOUT}}
    model = _mlp()
    named = dict(model.named_parameters())
    opt = st.OffloadAdam(model.named_parameters(), lr=LR, weight_decay=WD, force_no_gpu=True, config=cfg)
    res = {"steps": [], "weights": [], "engines": []}
    for s, (drop, clip) in enumerate(ADAM_STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(model(_batch(rank, s))).backward()
        for n, p in named.items():
            if rank == 1 and drop in (n, "all"):
                p.grad = None

        def step():
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), NO_CLIP)
            opt.step()
        ok = _timed(res["steps"], step)
        res["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        res["engines"].append(len(opt._engines))
        torch.save(res, out)
        if not ok:
            return
    # A new engine after them: its rendezvous port is every rank's next one.
    extra = nn.Parameter(torch.ones(5))
    opt2 = st.OffloadAdam([extra], lr=LR, force_no_gpu=True, config=cfg)
    extra.grad = torch.full((5,), float(rank + 1))
    _timed(res["steps"], opt2.step)
    res["extra"] = extra.detach().clone()
    opt2.close()
    opt.close()
    torch.save(res, out)


def _module_rank(stage, out):
    rank = int(os.environ["RANK"])
    cfg = {"zero_optimization": {"stage": stage}, "optimizer": copy.deepcopy(ADAMW), "strata": {"timeout": TIMEOUT}}
    model = Branchy()
    off = st.offload_module(model, cfg, force_no_gpu=True)
    res = {"steps": [], "weights": []}
    for s, modes in enumerate(MODULE_STEPS):
        def step():
            for k, mode in enumerate(modes):
                if mode == "drop":
                    off.optimizer.zero_grad()
                    continue
                _loss(model(_batch(rank, s, k), mode if rank == 1 else "use")).backward()
            off.optimizer.step()
            off.optimizer.zero_grad()
        if _timed(res["steps"], step):
            res["weights"].append({k: v.detach().clone() for k, v in off.master_parameters().items()})
        torch.save(res, out)
        if len(res["weights"]) <= s:
            return
    # A new engine after it: its rendezvous port is every rank's next one.
    lin = nn.Linear(2, 2)
    off2 = st.offload_module(lin, copy.deepcopy(cfg), force_no_gpu=True)

    def step2():
        lin(torch.ones(1, 2)).sum().backward()
        off2.optimizer.step()
    _timed(res["steps"], step2)
    off2.close()
    off.close()
    torch.save(res, out)


def _run_ranks(tmp_path, case):
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    logs = run_two_ranks(lambda r: [sys.executable, os.path.abspath(__file__), case, str(outs[r])], 300, block=64)
    return [torch.load(o) for o in outs], logs


def _check_steps(got, want_steps):
    for r in range(2):
        steps = got[r]["steps"]
        for k, (status, message, seconds) in enumerate(steps):
            assert status == "ok", f"rank {r}, step {k}: {status} after {seconds:.1f} s: {message}"
            assert seconds < BOUND, f"rank {r}, step {k} took {seconds:.1f} s (strata.timeout {TIMEOUT} s)"
        assert len(steps) == want_steps, f"rank {r}: {len(steps)} steps of {want_steps}"


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _averaged_grads(model, per_rank):
    """Sets each parameter's .grad to the ranks' mean, as DDP's all-reduce
    gives it (zeros for a rank without one; None where no rank has one).
    per_rank: per rank, a callable that runs its backward passes."""
    grads = []
    for run in per_rank:
        model.zero_grad(set_to_none=True)
        run()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        if any(n in g for g in grads):
            total = grads[0].get(n, torch.zeros_like(p))
            for g in grads[1:]:
                total = total + g.get(n, torch.zeros_like(p))
            p.grad = total / len(per_rank)


@pytest.mark.parametrize("stage", [0, 2])
def test_offload_adam_steps_a_parameter_without_a_gradient_on_one_rank_on_every_rank(tmp_path, stage):
    got, _ = _run_ranks(tmp_path, f"adam-{stage}")
    _check_steps(got, len(ADAM_STEPS) + 1)
    # Torch DDP + AdamW: the parameter is updated with the ranks' mean
    # gradient, rank 1's counted as zeros.
    ref = _mlp()
    opt = oracle.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    named = dict(ref.named_parameters())
    for s, (drop, _) in enumerate(ADAM_STEPS):
        def run(rank):
            _loss(ref(_batch(rank, s))).backward()
            for n, p in named.items():
                if rank == 1 and drop in (n, "all"):
                    p.grad = None
        _averaged_grads(ref, [lambda r=r: run(r) for r in range(2)])
        opt.step()
        want = {n: p.detach().clone() for n, p in ref.named_parameters()}
        for r in range(2):
            assert _same(got[r]["weights"][s], want), f"rank {r}, step {s}: not torch DDP + AdamW's weights"
        assert got[0]["engines"][s] == got[1]["engines"][s] == 1, "the ranks split their engines"
    # The new optimizer's step: the mean of the ranks' gradients 1 and 2.
    assert torch.equal(got[0]["extra"], got[1]["extra"])


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_module_with_a_module_one_rank_skips_fails_every_rank_at_once(tmp_path, stage):
    got, _ = _run_ranks(tmp_path, f"module-{stage}")
    for r in range(2):
        status, message, seconds = got[r]["steps"][0]
        assert status == "COMM" and "ranks disagree" in message, f"rank {r}: {status}: {message}"
        assert seconds < BOUND, f"rank {r} took {seconds:.1f} s to fail (strata.timeout {TIMEOUT} s)"


if __name__ == "__main__":
    case, stage = sys.argv[1].rsplit("-", 1)
    {"adam": _adam_rank, "module": _module_rank}[case](int(stage), sys.argv[2])
