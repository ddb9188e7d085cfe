"""A KeyboardInterrupt (Ctrl-C) where CPython delivers one: as a native
ctypes call returns (simulated: the call runs, then KeyboardInterrupt) or at
the start of a Python function (simulated: it raises before running). After
catching it, the state is consistent: nothing stays fetched or handed
unrecorded, no native engine leaks, and training goes on bitwise as if the
interrupted work had finished (an engine that stepped) or never started
(one that had not)."""
import contextlib
import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402
import strata.torch._fetch_on_use as fou  # noqa: E402
import strata.torch._group_engine as group_engine  # noqa: E402
from strata._capi import _load  # noqa: E402
from strata.torch._offload_adam import OffloadAdam  # noqa: E402
from strata.torch._overlap import _Overlap  # noqa: E402


@contextlib.contextmanager
def interrupt_after_native(name, nth=1):
    """The nth call of the C function `name` runs, then KeyboardInterrupt."""
    lib = _load()
    orig = getattr(lib, name)
    n = [0]

    def wrapper(*a):
        r = orig(*a)
        n[0] += 1
        if n[0] == nth:
            setattr(lib, name, orig)
            raise KeyboardInterrupt(f"after native {name} #{nth}")
        return r

    setattr(lib, name, wrapper)
    try:
        yield n
    finally:
        setattr(lib, name, orig)
    assert n[0] >= nth, f"{name} was called {n[0]} times, not {nth}"


@contextlib.contextmanager
def interrupt_in(owner, name, after=True):
    """The next call of owner.name raises KeyboardInterrupt, after running
    (after=True) or at its start."""
    orig = owner.__dict__[name]
    hit = []

    def wrapper(*a, **k):
        setattr(owner, name, orig)
        hit.append(1)
        if after:
            orig(*a, **k)
        raise KeyboardInterrupt(f"in {name}")

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, orig)
    assert hit, f"{name} was not called"


def interrupted(fn):
    with pytest.raises(KeyboardInterrupt):
        fn()


def assert_same(a, b):
    """Parameters (or state dicts) bitwise equal."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    else:
        assert a == b


def params(m):
    return [p.detach().clone() for p in m.parameters()]


# ---- 1. hand_grads: all buckets or none ------------------------------------

def test_hand_grads_interrupted_leaves_no_gradients_in_the_engine():
    """d1_hand_grads.py: a Ctrl-C after bucket 0's native grads left them in
    the engine, unrecorded: zero_grad() kept them and the next step added
    them. Reference: the interrupted batches dropped by zero_grad. (The
    second, interrupted before bucket 0: handed is marked before the first
    grads call, and discard_grads with none pending changes nothing.)"""
    def run(interrupt):
        torch.manual_seed(0)
        m = nn.Linear(8, 8)
        opt = st.OffloadAdam(m.parameters(), lr=0.1, force_no_gpu=True, bucket_numel=40, config={})
        assert len(opt._engines[0].buckets) == 2
        xs = [torch.randn(4, 8) for _ in range(3)]
        if interrupt:
            for ctx in (lambda: interrupt_after_native("strata_engine_grads", 1),
                        lambda: interrupt_in(strata.Engine, "grads", after=False)):
                opt.zero_grad()
                m(xs.pop(0)).pow(2).sum().backward()
                with ctx():
                    interrupted(opt.step)
                assert not opt._engines[0].handed
        opt.zero_grad()
        m(xs[-1]).pow(2).sum().backward()
        opt.step()
        return params(m), opt.state_dict()

    assert_same(run(True), run(False))


# ---- 3. the engine stepped, then Ctrl-C ---------------------------------------

def _train_one(fp16, interrupt, what="strata_engine_step"):
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    cfg = {}
    if fp16:
        m = m.half()
        cfg = {"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}}
    opt = st.OffloadAdam(m.parameters(), lr=0.1, force_no_gpu=True, config=cfg)
    xs = [torch.randn(2, 4) for _ in range(3)]
    for i, x in enumerate(xs):
        opt.zero_grad()
        loss = F.linear(x, m.weight.float(), m.bias.float()).pow(2).sum()  # (float: CPU has no fp16 matmul in 1.13)
        if fp16:
            opt.backward(loss)
        else:
            loss.backward()
        if interrupt and i == 0:
            with interrupt_after_native(what, 1):
                interrupted(opt.step)
            # The engine stepped: the model holds its masters.
            ge = opt._engines[0]
            assert ge.engine.steps == 1
            for p, master in zip(m.parameters(), ge.read_masters()):
                assert torch.equal(p, master.to(p.dtype))
        else:
            opt.step()
    return params(m), opt.state_dict(), opt.loss_scale


@pytest.mark.parametrize("fp16", [False, True])
def test_step_interrupted_after_the_engine_stepped_finishes_it(fp16):
    """d2_step.py / d2b_step_next.py: the engine stepped, copy_params_back
    never ran: the weights stayed a step behind (and fp16's scale missed the
    step). Now the step is finished: training goes on bitwise as if it had
    completed."""
    assert_same(_train_one(fp16, True), _train_one(fp16, False))


def test_copy_back_fetch_interrupted_finishes_the_step():
    """d8_copy_back.py: Ctrl-C as copy_params_back's native fetch returns:
    the group stayed fetched (every later step: STATE) and the weights
    stale."""
    assert_same(_train_one(False, True, "strata_engine_fetch"), _train_one(False, False))


def test_step_interrupted_after_the_first_of_two_engines():
    """Two engines (param groups): Ctrl-C as the first's native step returns.
    The first has stepped (as if the step had completed for it); the second
    has not (as if the step had not started for it: its gradients dropped).
    Reference: the same step with the second group's .grad None."""
    def run(interrupt):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        opt = st.OffloadAdam([{"params": m[0].parameters()}, {"params": m[1].parameters()}], lr=0.1,
                             force_no_gpu=True, config={})
        x1, x2 = torch.randn(2, 4), torch.randn(2, 4)
        m(x1).pow(2).sum().backward()
        if interrupt:
            with interrupt_after_native("strata_engine_step", 1):
                interrupted(opt.step)
            assert not any(ge.handed for ge in opt._engines)
        else:
            for p in m[1].parameters():
                p.grad = None
            opt.step()
        opt.zero_grad()
        m(x2).pow(2).sum().backward()
        opt.step()
        return params(m), opt.state_dict()

    assert_same(run(True), run(False))


# ---- 4. what a step consumes, kept until the engine steps --------------------

def test_clip_kept_when_step_is_interrupted_before_any_engine_steps():
    """d10_clip_retry.py: step() took clip_grad_norm_'s coefficient at its
    top: a Ctrl-C before any engine stepped (in _regroup) and step() run
    again stepped unclipped (torch's clip scaled .grad itself)."""
    def run(interrupt):
        torch.manual_seed(0)
        m = nn.Linear(4, 4).to(torch.bfloat16)
        opt = st.OffloadAdam(m.parameters(), lr=0.1, force_no_gpu=True, config={})
        (m(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum() * 1000).backward()
        opt.clip_grad_norm_(1e-3)
        if interrupt:
            with interrupt_in(OffloadAdam, "_regroup", after=False):
                interrupted(opt.step)
        opt.step()
        return params(m), opt.state_dict()

    assert_same(run(True), run(False))


def _module_run(interrupt, takes_parts):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    off = st.offload_module(model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}}},
                            force_no_gpu=True, overlap_step=False)
    opt = off.optimizer
    if not takes_parts:
        for g in off._groups:
            g.takes_parts = False  # the path a GPU takes (whole grads calls)
    xs = [torch.randn(2, 4) for _ in range(4)]
    model(xs[0]).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    model(xs[1]).pow(2).sum().backward()
    if interrupt:
        # Before the engine steps: as if the step never started (zero_grad drops its gradients).
        with interrupt_in(_Overlap, "options"):
            interrupted(opt.step)
    opt.zero_grad()
    model(xs[2]).pow(2).sum().backward()
    if interrupt:
        # As the native step returns: the engine stepped, as if the step had completed.
        with interrupt_after_native("strata_engine_step", 1):
            interrupted(opt.step)
    else:
        opt.step()
    opt.zero_grad()
    model(xs[3]).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    return off.master_parameters()


@pytest.mark.parametrize("takes_parts", [False, True])
def test_module_step_interrupted_before_and_after_the_engine_steps(takes_parts):
    """d4_module_step.py: OffloadedModule.step reset _handed (and the clip,
    the norms, the scaled-loss check) before the engine stepped: a Ctrl-C
    between left the engine holding the batch's gradients, which zero_grad()
    no longer dropped, and the next step added them to its own."""
    assert_same(_module_run(True, takes_parts), _module_run(False, takes_parts))


# ---- 2. a fetch or release interrupted ------------------------------------------

def _two_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    off = st.offload_module(model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, force_no_gpu=True)
    return model, off


@pytest.mark.parametrize("where", ["native fetch", "as_tensor", "release at its start"])
def test_forward_interrupted_at_a_fetch_or_release_leaves_nothing_fetched(where):
    """d3_fetch.py: a Ctrl-C as the native fetch returned (Engine.fetch lost
    the address), in the hooks' own fetch before it was recorded, or at the
    start of a release (the record went first): the group stayed fetched and
    every later step failed (STATE "group N is fetched and not released")."""
    def run(interrupt):
        model, off = _two_layers()
        x = torch.randn(2, 4)
        if interrupt:
            ctx = {"native fetch": lambda: interrupt_after_native("strata_engine_fetch", 2),
                   "as_tensor": lambda: interrupt_in(strata.Engine, "as_tensor"),
                   "release at its start": lambda: interrupt_in(strata.Engine, "release", after=False)}[where]
            with ctx():
                interrupted(lambda: model(x).sum().backward())
            assert not off._fetched
            off.optimizer.zero_grad()
        for _ in range(2):
            model(x).sum().backward()
            off.optimizer.step()
            off.optimizer.zero_grad()
        out = off.master_parameters()
        off.close()
        return out

    assert_same(run(True), run(False))


def test_grads_part_lend_holds_the_tensor_when_interrupted():
    """Ctrl-C as strata_engine_grads_part_lend returns: the lent tensor was
    held by nothing while the engine may still read it."""
    e = strata.Engine({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, force_no_gpu=True, world_size=1)
    e.add_param(0, "w", 8)
    e.build()
    assert e.takes_grad_parts(0)
    part = torch.ones(4)
    with interrupt_after_native("strata_engine_grads_part_lend", 1):
        interrupted(lambda: e.grads_part(0, 0, part, lend=True))
    assert any(t is part for t in e._lent.get(0, []))
    e.close()


# ---- 5. an engine made, then Ctrl-C -----------------------------------------

def test_engine_create_interrupted_leaks_no_native_engine():
    """d7_create.py: a Ctrl-C as strata_engine_create returned, before
    _NativeEngine held the handle: its threads stayed for good."""
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    strata.Engine(cfg, force_no_gpu=True).close()
    before = len(os.listdir("/proc/self/task"))
    for _ in range(2):
        with interrupt_after_native("strata_engine_create", 1):
            interrupted(lambda: strata.Engine(cfg, force_no_gpu=True))
    assert len(os.listdir("/proc/self/task")) == before


# ---- 6. old engines closed after the new are in place -----------------------------

def interrupt_in_folder_removal():
    """A Ctrl-C in a closed engine's swap-folder removal (Python, after its native destroy)."""
    return interrupt_in(group_engine, "_remove_swap_folders")


def test_regroup_interrupted_closing_the_retired_engine():
    """d6b_regroup.py: a cohort split closed the old engine before the
    cohorts held the new: a Ctrl-C in that close left them holding a closed
    engine (every later call: STATE)."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    opt = st.OffloadAdam([a, b], lr=0.1, force_no_gpu=True, config={})
    (a.sum() + b.sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    a.sum().backward()  # b gets no gradient: the cohort splits
    with interrupt_in_folder_removal():
        interrupted(opt.step)
    assert all(ge.engine._h is not None for ge in opt._engines)
    opt.zero_grad()
    (a.sum() + b.sum()).backward()
    opt.step()
    opt.state_dict()


def test_load_state_dict_interrupted_closing_the_old_engines():
    """d6c_load.py: the loaded engines were put in place only after the old
    were closed: a Ctrl-C in that close left the cohorts holding closed
    engines and the loaded state dropped."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    opt = st.OffloadAdam(m.parameters(), lr=0.1, force_no_gpu=True, config={})
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    sd = opt.state_dict()
    with interrupt_in_folder_removal():
        interrupted(lambda: opt.load_state_dict(sd))
    assert_same(opt.state_dict(), sd)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()


# ---- 7. quiet ------------------------------------------------------------------

class _ReadsAnother(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(self.a(x), self.b.weight)  # b.weight read outside b's forward: fetched on use


def test_quiet_flag_left_on_by_an_interrupt_is_turned_off():
    """d9_quiet.py: a Ctrl-C on entry to quiet.__exit__ left quiet on for
    good: a parameter read outside its module's forward computed with the
    placeholder (zeros), silently."""
    torch.manual_seed(0)
    m = _ReadsAnother()
    x = torch.randn(2, 4)
    off = st.offload_module(m, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, force_no_gpu=True)
    want = m(x)
    with interrupt_in(fou.quiet, "__exit__", after=False):
        interrupted(lambda: m(x))
    assert torch.equal(m(x), want)
    fou._tls.quiet = True  # (as the interrupt leaves it)
    off.optimizer.zero_grad()
    assert not fou._tls.quiet
    off.close()


# ---- 8. every failure of the binding is a strata.Error -----------------------------

def test_bad_arguments_raise_strata_error_naming_them():
    """docs/pytorch.md: every failure raises strata.Error. These raised
    KeyError or TypeError."""
    e = strata.Engine({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, force_no_gpu=True)
    e.add_param(0, "w", 8)
    e.build()
    cases = [
        (lambda: e.read_state(0, "bogus"), "bogus"),
        (lambda: e.write_state(0, "bogus", torch.zeros(8)), "bogus"),
        (lambda: e.grads(0, torch.zeros(8, dtype=torch.float64)), "float64"),
        (lambda: e.grads(0, torch.zeros(8).data_ptr(), dtype="f64"), "f64"),
        (lambda: e.grads_part(0, 0, torch.zeros(8, dtype=torch.float64)), "float64"),
        (lambda: e.takes_grad_parts(0, "f8"), "f8"),
        (lambda: e.stash(torch.zeros(8).data_ptr()), "nbytes"),
    ]
    for call, named in cases:
        with pytest.raises(strata.Error) as info:
            call()
        assert info.value.status == strata.INVALID and named in str(info.value), str(info.value)
    e.close()


# ---- 13. a refused or failed step is not a step ----------------------------------
# The engine's stats count discard_grads (a skipped step to it) and a failed
# step (left pending) as steps: they are read only where step() raised other
# than with the engine's Error, after its native call returned.

FP16 = {"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1000}}


def _fp16_backward(m, opt, n=8):
    loss = F.linear(torch.randn(4, n), m.weight.float(), m.bias.float()).pow(2).sum()
    opt.backward(loss)


@pytest.mark.parametrize("how", ["refused", "interrupted"])
def test_a_step_refused_handing_gradients_leaves_the_fp16_scale(how):
    """A step that fails handing the gradients (a sparse one, or a Ctrl-C as
    bucket 0's native grads returns: hand_grads drops them, discard_grads)
    is no step: no result, the loss scale and its hysteresis unchanged
    however often it repeats (before: a skipped step each, 16 -> 8 -> 4)."""
    torch.manual_seed(0)
    m = nn.Linear(8, 8).half()
    opt = OffloadAdam(m.parameters(), lr=0.1, force_no_gpu=True, bucket_numel=40, config=FP16)
    before = opt._scaler.state_dict()
    for _ in range(3):
        opt.zero_grad()
        _fp16_backward(m, opt)
        if how == "refused":
            m.bias.grad = m.bias.grad.to_sparse()
            with pytest.raises(strata.Error):
                opt.step()
        else:
            with interrupt_after_native("strata_engine_grads", 1):
                interrupted(opt.step)
        assert opt._scaler.state_dict() == before
        assert getattr(opt, "last_results", None) is None
        assert not opt._engines[0].handed


def test_ctrl_c_handing_the_second_engines_gradients_is_what_propagates():
    """Two engines, fp16: engine 0 steps, then a Ctrl-C as engine 1's native
    grads returns. The KeyboardInterrupt goes on (before: strata.Error STATE
    "1 of 2 engines skipped", the interrupt only its __context__); engine 0's
    clean step counts, engine 1 holds nothing and did not step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    opt = OffloadAdam([{"params": m[0].parameters()}, {"params": m[1].parameters()}], lr=0.1,
                      force_no_gpu=True, config=FP16)
    h = F.linear(torch.randn(2, 4), m[0].weight.float(), m[0].bias.float())
    opt.backward(F.linear(h, m[1].weight.float(), m[1].bias.float()).pow(2).sum())
    with interrupt_after_native("strata_engine_grads", 2):
        interrupted(opt.step)
    assert [ge.engine.steps for ge in opt._engines] == [1, 0]
    assert [skipped for _, skipped in opt.last_results] == [False]
    assert opt._scaler.state_dict()["scale"] == 16.0
    assert not opt._engines[1].handed


def test_a_nonfinite_error_from_the_engine_records_no_step():
    """strata.nonfinite "error": the engine refuses the step (INVALID,
    "nothing was updated"). As before the step counters were read: no
    result (last_results stays the last step's), and a step() run again
    with fresh gradients steps."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    opt = OffloadAdam(m.parameters(), lr=0.1, force_no_gpu=True, config={"strata": {"nonfinite": "error"}})
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    last = opt.last_results
    opt.zero_grad()
    m(torch.randn(2, 4)).sum().backward()
    m.weight.grad[0, 0] = float("nan")
    with pytest.raises(strata.Error) as err:
        opt.step()
    assert err.value.status == strata.INVALID, err.value
    assert opt.last_results == last
    assert not opt._engines[0].handed
    opt.zero_grad()
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert opt._engines[0].engine.steps == 2 and not opt.last_results[0][1]


def _pending_run(tmp_path, fail):
    """Two steps on NVMe; with `fail`, the first's writes fail (RLIMIT_FSIZE
    0: EFBIG, NOSPACE) and it is left pending, then step() is called again."""
    import resource
    import signal
    swap = tmp_path / ("fail" if fail else "clean")
    swap.mkdir()
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}},
           "strata": {"io_backend": "threads"}}
    opt = OffloadAdam(m.parameters(), lr=0.1, force_no_gpu=True, config=cfg)
    xs = [torch.randn(2, 8) for _ in range(2)]
    for i, x in enumerate(xs):
        opt.zero_grad()
        m(x).pow(2).sum().backward()
        if fail and i == 0:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
            err = None
            try:
                try:
                    opt.step()
                finally:
                    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
                    signal.signal(signal.SIGXFSZ, sig)
            except strata.Error as e:
                err = e
            assert err is not None and "not finished" in str(err), err
            assert opt._engines[0].handed, "the pending step's gradients are the engine's still"
        opt.step()
    out = params(m), opt.state_dict(), opt.last_results
    opt.close()
    return out


def test_a_failed_step_left_pending_finishes_when_step_is_called_again(tmp_path):
    """A step whose writes fail (NOSPACE) is pending in the engine: the
    documented recovery, step() again with the same options, finishes it,
    bitwise as a run where it never failed. Before, the failure read as a
    step (the counters moved): handed cleared, and the re-run's grads
    refused ("a failed step is pending")."""
    assert_same(_pending_run(tmp_path, True), _pending_run(tmp_path, False))
