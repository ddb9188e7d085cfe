"""A second Ctrl-C while the first one's repair runs (test_interrupts.py's
scenarios). The first interrupt is injected where test_interrupts.py
injects it (KeyboardInterrupt raised as a native call returns or at the
start of a Python function); once it is raised, a real SIGINT is sent to
the process at a point of the code that finishes or undoes what the first
cut short (Engine.fetch's undo of a fetch whose address was lost, the
engine's step finished into the weights, what a step consumed reset).
Exactly one KeyboardInterrupt reaches the caller, none is left pending, the
SIGINT handler is Python's default again, and the state is what an
uninterrupted run gives: bitwise the same weights and state, no group left
fetched (a later step works). Before, the second interrupt cut the repair
short: a group stayed fetched (every later step: STATE), the weights a step
behind their masters, a step's clip kept for the next one."""
import contextlib
import functools
import os
import signal
import threading

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402
from strata._capi import _load  # noqa: E402
from strata.torch._offload_adam import OffloadAdam  # noqa: E402
from strata.torch._offloaded_module import OffloadedModule  # noqa: E402

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread()
                                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                                reason="needs the main thread with Python's default SIGINT handler")


# ---- where the interrupts land ------------------------------------------------------

def native(name, nth=1):
    """As the nth call (counted once armed) of the C function `name` returns."""
    return ("native", name, nth)


def entry(owner, name):
    """At the start of owner.name (a Python function), before it runs."""
    return ("entry", owner, name)


def _arm(point, action):
    """Patches `point` so that action() runs there, once; returns the undo."""
    if point[0] == "native":
        _, name, nth = point
        lib = _load()
        orig = getattr(lib, name)
        n = [0]

        def after_native(*a):
            r = orig(*a)
            n[0] += 1
            if n[0] == nth:
                setattr(lib, name, orig)
                action()
            return r

        setattr(lib, name, after_native)
        return lambda: setattr(lib, name, orig)
    _, owner, name = point
    orig = owner.__dict__[name]

    def at_entry(*a, **k):
        setattr(owner, name, orig)
        action()
        return orig(*a, **k)

    setattr(owner, name, at_entry)
    return lambda: setattr(owner, name, orig)


class _First(KeyboardInterrupt):
    """The first interrupt (a KeyboardInterrupt, told apart by its type)."""


@contextlib.contextmanager
def twice(first, second):
    """KeyboardInterrupt raised at `first`; once it is, a real SIGINT sent to
    this process at `second` (the default handler raises it there at once;
    a deferring one records it)."""
    fired, undo = [], []

    def send():
        fired.append("second")
        os.kill(os.getpid(), signal.SIGINT)

    def raise_first():
        fired.append("first")
        undo.append(_arm(second, send))
        raise _First("first")

    undo.append(_arm(first, raise_first))
    try:
        yield fired
    finally:
        for u in reversed(undo):
            u()
    assert fired == ["first", "second"], f"the interrupts that fired: {fired}"


def no_stray_interrupt(test):
    """A KeyboardInterrupt that escapes the test fails it (pytest would end
    the whole run)."""
    @functools.wraps(test)
    def run(*a, **k):
        try:
            return test(*a, **k)
        except KeyboardInterrupt as e:
            raise AssertionError(f"a KeyboardInterrupt escaped: {e!r}") from e
    return run


def interrupted_once(fn):
    """fn() raises one KeyboardInterrupt: the first one, or one raised while
    it was handled (its context); no other comes after it, and SIGINT's
    handler is Python's default again."""
    with pytest.raises(KeyboardInterrupt) as info:
        fn()
    e = info.value
    chain = []
    while e is not None:
        chain.append(e)
        e = e.__context__
    assert any(isinstance(k, _First) for k in chain), f"not the first interrupt, nor raised handling it: {chain}"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:
        for _ in range(3):  # (a pending one would be raised at these calls)
            len(str(chain))
    except KeyboardInterrupt:
        pytest.fail("a second KeyboardInterrupt came after the first")
    return info.value


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


# ---- OffloadAdam: the engine stepped, then Ctrl-C; another while the step is finished -----

def _train(fp16, first=None, second=None):
    """test_interrupts._train_one: three steps, the first interrupted at
    `first` and again at `second`."""
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
        loss = F.linear(x, m.weight.float(), m.bias.float()).pow(2).sum()
        if fp16:
            opt.backward(loss)
        else:
            loss.backward()
        if first is not None and i == 0:
            with twice(first, second):
                interrupted_once(opt.step)
            ge = opt._engines[0]
            assert ge.engine.steps == 1 and not ge.handed
            for p, master in zip(m.parameters(), ge.read_masters()):
                assert torch.equal(p, master.to(p.dtype))  # (the weights are the stepped masters)
        else:
            opt.step()
    out = params(m), opt.state_dict(), opt.loss_scale
    opt.close()
    return out


# Once the native step returned: the step counters read (_skipped_since), then
# the weights fetched and copied back (_finish_stepped, copy_params_back).
_FINISHING = {
    "step counters read": native("strata_engine_stats"),
    "finishing starts": entry(OffloadAdam, "_finish_stepped"),
    "copy-back fetch returns": native("strata_engine_fetch"),
}


@pytest.mark.parametrize("second", sorted(_FINISHING))
@pytest.mark.parametrize("fp16", [False, True])
@no_stray_interrupt
def test_second_interrupt_while_the_stepped_engine_is_finished(fp16, second):
    assert_same(_train(fp16, native("strata_engine_step"), _FINISHING[second]), _train(fp16))


@no_stray_interrupt
def test_second_interrupt_in_the_undo_of_the_copy_backs_lost_fetch():
    """The first as copy_params_back's native fetch returns: Engine.fetch
    releases it (the address was lost); the second at the start of that
    release left the group fetched, and the finishing copy fetched it
    again: held twice, every later step failed (STATE)."""
    assert_same(_train(False, native("strata_engine_fetch"), entry(strata.Engine, "release")), _train(False))


@no_stray_interrupt
def test_second_interrupt_where_two_engines_step():
    """Two engines (param groups): the first interrupted as its native step
    returns, the second as the finishing copy's fetch returns. The first
    engine's step is finished, the second's gradients dropped (as if the
    step had not started for it): test_interrupts.py's reference."""
    def run(interrupt):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        opt = OffloadAdam([{"params": m[0].parameters()}, {"params": m[1].parameters()}], lr=0.1,
                          force_no_gpu=True, config={})
        x1, x2 = torch.randn(2, 4), torch.randn(2, 4)
        m(x1).pow(2).sum().backward()
        if interrupt:
            with twice(native("strata_engine_step"), native("strata_engine_fetch")):
                interrupted_once(opt.step)
            assert not any(ge.handed for ge in opt._engines)
        else:
            for p in m[1].parameters():
                p.grad = None
            opt.step()
        opt.zero_grad()
        m(x2).pow(2).sum().backward()
        opt.step()
        out = params(m), opt.state_dict()
        opt.close()
        return out

    assert_same(run(True), run(False))


# ---- offload_module: a fetch interrupted, another in its undo -------------------------

def _two_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    off = st.offload_module(model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, force_no_gpu=True)
    return model, off


_FETCHES = {
    # Engine.fetch releases what its native call fetched; the second at that release's start.
    "native fetch, then its undo's release": (native("strata_engine_fetch", 2), entry(strata.Engine, "release")),
    # The hooks undo a fetch they had not recorded; the second at the start of its release.
    "as_tensor, then the hooks' release": (entry(strata.Engine, "as_tensor"), entry(strata.Engine, "_release_held")),
    # _release_held releases again; the second at that one's start.
    "release at its start, then its second try": (entry(strata.Engine, "release"), entry(strata.Engine, "release")),
}


@pytest.mark.parametrize("where", sorted(_FETCHES))
@no_stray_interrupt
def test_second_interrupt_in_the_undo_of_a_fetch_leaves_nothing_fetched(where):
    def run(interrupt):
        model, off = _two_layers()
        x = torch.randn(2, 4)
        if interrupt:
            with twice(*_FETCHES[where]):
                interrupted_once(lambda: model(x).sum().backward())
            off.optimizer.zero_grad()  # (ends a forward's scope a KeyboardInterrupt left open: torch 2.1+)
            assert not off._fetched
        for _ in range(2):
            model(x).sum().backward()
            off.optimizer.step()
            off.optimizer.zero_grad()
        out = off.master_parameters()
        off.close()
        return out

    assert_same(run(True), run(False))


# ---- offload_module: the step interrupted after the engine stepped; another as it is ended ---

_ENDING = {
    "step counters read": native("strata_engine_stats"),
    "ending starts": entry(OffloadedModule, "_end_step"),
}


@pytest.mark.parametrize("second", sorted(_ENDING))
@pytest.mark.parametrize("takes_parts", [False, True])
@no_stray_interrupt
def test_second_interrupt_while_the_module_step_is_ended(second, takes_parts):
    """The engine stepped, then Ctrl-C; a second as the step's end (what it
    consumed reset: its clip, the gradients handed) runs. Before, the step
    was not ended: the next step (a loop started again at backward, no
    zero_grad between) took the interrupted step's clip, silently."""
    def run(interrupt):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        off = st.offload_module(model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}}},
                                force_no_gpu=True, overlap_step=False)
        opt = off.optimizer
        if not takes_parts:
            for g in off._groups:
                g.takes_parts = False  # the path a GPU takes (whole grads calls)
        xs = [torch.randn(2, 4) * 10 for _ in range(3)]
        model(xs[0]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        model(xs[1]).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        if interrupt:
            with twice(native("strata_engine_step"), _ENDING[second]):
                interrupted_once(opt.step)
            assert not off._handed and off._clip_next is None
        else:
            opt.step()
        model(xs[2]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        out = off.master_parameters()
        off.close()
        return out

    assert_same(run(True), run(False))


# ---- the deferral itself --------------------------------------------------------------

@no_stray_interrupt
def test_deferred_raises_one_interrupt_at_its_end_and_leaves_custom_handlers():
    from strata.torch._signals import deferred

    with pytest.raises(KeyboardInterrupt):
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(ValueError):  # an exception going on: it goes on, the interrupt is dropped
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("goes on")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # nested: the outer section's
        with deferred():
            with deferred():
                os.kill(os.getpid(), signal.SIGINT)
            done = True
    assert done
    got = []
    custom = lambda signum, frame: got.append(signum)  # noqa: E731
    old = signal.signal(signal.SIGINT, custom)
    try:
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            assert got == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is custom
    finally:
        signal.signal(signal.SIGINT, old)
    errors = []

    def off_main():
        try:
            with deferred():
                assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        except BaseException as e:  # noqa: B902
            errors.append(e)

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert not errors
