"""The lifetime of an OffloadedModule (review of offload_module's lifetime):
a model dropped without close() is freed (its engine closed, its threads
gone, its swap folders removed, at collection or at exit); a tensor handed
out before close() keeps the engine's memory it views; close() tears down
even where the masters cannot be read; a failed offload_module leaves no
engine or swap folder; a swap section shared by offload_param and
offload_optimizer gets one folder; calls after close() raise STATE."""
import copy
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2}}


def config(swap=None, shared=False, **strata_keys):
    zero = {"stage": 3}
    if swap is not None:
        sec = {"device": "nvme", "nvme_path": str(swap)}
        zero["offload_optimizer"] = sec
        zero["offload_param"] = sec if shared else dict(sec)
    cfg = {"zero_optimization": zero, "optimizer": copy.deepcopy(ADAMW)}
    if strata_keys:
        cfg["strata"] = strata_keys
    return cfg


def threads():
    return len(os.listdir("/proc/self/task"))


def left_in(folder):
    return sorted(os.path.join(r, n) for r, ds, fs in os.walk(folder) for n in ds + fs)


def train_step(model, off, n=64):
    model(torch.randn(2, n)).sum().backward()
    off.optimizer.step()


# ---- 1. a dropped model is freed ----------------------------------------------

def test_dropped_offloaded_models_are_freed_by_the_collector(tmp_path):
    """Three models offloaded and dropped without close(): after
    gc.collect() each OffloadedModule and its engine are gone, the engine's
    threads with them, and its swap folder removed. Before, the registry of
    offloaded parameters held every OffloadedModule: nothing was freed."""
    base = None  # threads after the first model is freed (the process's own pools started by then)
    for i in range(3):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        off = st.offload_module(model, config(tmp_path), force_no_gpu=True)
        train_step(model, off)
        alive = threads()
        refs = weakref.ref(off), weakref.ref(off.engine), weakref.ref(model)
        folders = list(off._folders)
        assert folders and all(os.path.isdir(f) for f in folders)
        del model, off
        gc.collect()
        assert [r() is None for r in refs] == [True] * 3, f"model {i}: OffloadedModule, engine, model alive"
        base = threads() if base is None else base
        assert threads() < alive and threads() <= base, f"model {i}: engine threads left ({threads()})"
        assert left_in(tmp_path) == [], f"model {i}: swap left: {left_in(tmp_path)}"


def test_a_parameter_kept_from_a_collected_model_refuses_reads():
    """A parameter kept after its model and OffloadedModule were collected
    holds a placeholder, not values: reading it raises STATE (never zeros)."""
    model = nn.Sequential(nn.Linear(8, 8))
    off = st.offload_module(model, config(), force_no_gpu=True)
    w = model[0].weight
    del model, off
    gc.collect()
    with pytest.raises(strata.Error, match="STATE: 0.weight: its offload_module was collected"):
        w.sum()
    with pytest.raises(strata.Error, match="STATE"):
        st.offload_module(nn.Sequential(nn.Linear(8, 8), _Holder(w)), config(), force_no_gpu=True)


class _Holder(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p


def test_a_model_alive_at_exit_has_its_swap_folder_removed(tmp_path):
    """A model never closed and alive at interpreter exit: its engine is
    closed and its swap folder removed at exit. Before, the folder and its
    swap file stayed on disk."""
    script = textwrap.dedent(f"""
        import torch, torch.nn as nn, strata.torch as st
        sec = {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}
        cfg = {{"zero_optimization": {{"stage": 3, "offload_optimizer": sec, "offload_param": dict(sec)}},
               "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}}}}
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        off = st.offload_module(model, cfg, force_no_gpu=True)
        model(torch.randn(2, 64)).sum().backward(); off.optimizer.step()
        print("swap", off._folders)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "swap" in out.stdout
    assert left_in(tmp_path) == [], left_in(tmp_path)


# ---- 2. a view handed out before close() --------------------------------------

@pytest.mark.parametrize("swap", [False, True])
def test_close_keeps_the_memory_a_handed_out_view_reads(tmp_path, swap):
    """w = p.detach() taken outside a forward views the engine's memory:
    after close() it still reads the weights, a write into it and
    allocations crash nothing, and the engine is freed (its swap folder
    removed) once the last such view dies. Before, close() freed the memory
    under w: it read garbage, and a write corrupted the heap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    want = model[0].weight.detach().clone()
    off = st.offload_module(model, config(tmp_path if swap else None), force_no_gpu=True)
    engine = weakref.ref(off.engine)
    w = model[0].weight.detach()
    row = w[3]  # a view of the view
    off.close()
    assert engine()._h is not None, "close() freed the engine's memory under a live view of it"
    assert type(model[0].weight) is nn.Parameter and torch.equal(model[0].weight, want)
    junk = [torch.randn(1024, 1024) for _ in range(8)]
    assert torch.equal(w, want), "the view no longer reads the weights after close()"
    w.fill_(7.0)
    junk += [torch.randn(256, 256) for _ in range(40)]
    gc.collect()
    assert torch.equal(row, torch.full((1024,), 7.0)) and torch.equal(model[0].weight, want)
    assert engine() is not None and (left_in(tmp_path) != []) == swap  # kept for w
    del w
    gc.collect()
    assert engine() is not None  # row views it still
    del row, junk
    gc.collect()
    assert engine() is None, "the engine outlived every view of it"
    assert left_in(tmp_path) == [], left_in(tmp_path)


def test_close_without_views_frees_the_engine_at_once(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64))
    off = st.offload_module(model, config(tmp_path), force_no_gpu=True)
    e = off.engine
    train_step(model, off)
    off.close()
    assert e._h is None and left_in(tmp_path) == []


# ---- 4. close() where the masters cannot be read ------------------------------

def test_close_keeps_the_model_when_the_masters_cannot_be_read():
    """strata.nonfinite "apply" with the overlapped step: after a backward
    the early updates are final and the masters unreadable until step().
    close() raises STATE naming them and what to do, and closes nothing: the
    weights stay for step(), after which close() gives them. (A close that
    tore down all the same left NaN: the weights lost where a step() would
    have kept them.)"""
    cfg = config(**{"nonfinite": "apply"})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    off = st.offload_module(model, cfg, force_no_gpu=True, overlap_step=True)
    for _ in range(3):
        train_step(model, off)
    model(torch.randn(2, 64)).sum().backward()  # final early updates of a step not made yet
    with pytest.raises(strata.Error) as err:
        off.close()
    assert err.value.status == strata.STATE
    msg = str(err.value)
    assert "nothing was closed" in msg and "step()" in msg and "0.weight" in msg, msg
    assert off.engine is not None, "close() closed the engine of weights it could not read"
    off.optimizer.step()
    masters = off.master_parameters()
    off.close()
    assert off.engine is None
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and torch.equal(p, masters[name]), name


def test_close_after_step_gives_the_masters():
    cfg = config(**{"nonfinite": "apply"})
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    off = st.offload_module(model, cfg, force_no_gpu=True, overlap_step=True)
    for _ in range(2):
        train_step(model, off)
    masters = off.master_parameters()
    off.close()
    for name, p in model.named_parameters():
        assert torch.equal(p, masters[name]), name


# ---- 5. a failed offload_module ---------------------------------------------

def _spy_engines(monkeypatch):
    live = []
    orig = strata.Engine.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        live.append(self)

    monkeypatch.setattr(strata.Engine, "__init__", spy)
    return live


def test_a_refused_offload_leaves_no_engine_or_swap(tmp_path, monkeypatch):
    """One Linear under 70 names (69 aliases of its weight, over the
    checkpoint's 64) is refused after the engine was made: the engine is
    closed and its swap folder removed then, and the model is as it was.
    Before, the engine stayed open (threads) and its folder on disk."""
    live = _spy_engines(monkeypatch)
    before = threads()
    shared = nn.Linear(8, 8)
    want = shared.weight.detach().clone()
    model = nn.Sequential(*([shared] * 70))
    with pytest.raises(strata.Error, match="64 aliases"):
        st.offload_module(model, config(tmp_path), force_no_gpu=True)
    assert len(live) == 1 and live[0]._h is None, "the engine was left open"
    assert left_in(tmp_path) == [], left_in(tmp_path)
    assert threads() <= before
    assert {type(p) for p in model.parameters()} == {nn.Parameter} and torch.equal(shared.weight, want)
    assert len(shared._forward_pre_hooks) == 0


@pytest.mark.parametrize("exc", [strata.Error(strata.NOMEM, "simulated"), KeyboardInterrupt()])
def test_an_offload_interrupted_after_the_engine_undoes_everything(tmp_path, monkeypatch, exc):
    """Any exception after the engine exists (a BaseException too: Ctrl-C
    during build) closes it, removes its folder and gives the model back
    untouched, so that it can be offloaded again."""
    live = _spy_engines(monkeypatch)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    want = {k: v.clone() for k, v in model.state_dict().items()}

    def failing_build(self):
        raise exc

    monkeypatch.setattr(strata.Engine, "build", failing_build)
    with pytest.raises(type(exc)):
        st.offload_module(model, config(tmp_path), force_no_gpu=True)
    assert live[-1]._h is None and left_in(tmp_path) == []
    monkeypatch.undo()
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    off = st.offload_module(model, config(tmp_path), force_no_gpu=True)  # again: not "offloaded already"
    train_step(model, off, 16)
    off.close()


def test_an_offload_adam_engine_that_fails_to_build_leaves_no_swap(tmp_path, monkeypatch):
    """OffloadAdam's group engine (_GroupEngine) closes its engine and
    removes its folder when anything after the engine's creation raises."""
    live = _spy_engines(monkeypatch)
    monkeypatch.setattr(strata.Engine, "build", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
    sec = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(KeyboardInterrupt):
        st.OffloadAdam(nn.Linear(16, 16).parameters(),
                       config={"zero_optimization": {"stage": 1, "offload_optimizer": sec}})
    assert live and all(e._h is None for e in live)
    assert left_in(tmp_path) == [], left_in(tmp_path)


# ---- 7. one swap section for both offloads -----------------------------------

def test_a_shared_swap_section_gets_one_folder(tmp_path):
    """The docs' Hugging Face example gives offload_param and
    offload_optimizer the same dict: the engine gets one folder directly
    under nvme_path, removed by close(). Before, the subfolder was appended
    twice (strata-X/strata-X) and the outer one left after close()."""
    cfg = config(tmp_path, shared=True)
    model = nn.Sequential(nn.Linear(64, 64))
    off = st.offload_module(model, cfg, force_no_gpu=True)
    assert len(off._folders) == 1 and os.path.dirname(off._folders[0]) == str(tmp_path), off._folders
    train_step(model, off)
    off.close()
    assert left_in(tmp_path) == [], left_in(tmp_path)
    sec = cfg["zero_optimization"]["offload_param"]
    assert sec["nvme_path"] == str(tmp_path)  # the caller's dict untouched
    opt = st.OffloadAdam(nn.Linear(64, 64).parameters(),
                         config={"zero_optimization": {"stage": 1, "offload_optimizer": sec, "offload_param": sec}})
    opt.close()
    assert left_in(tmp_path) == [], left_in(tmp_path)


# ---- 8. calls after close() -------------------------------------------------

CALLS = {
    "optimizer.step": lambda off, osd: off.optimizer.step(),
    "optimizer.state_dict": lambda off, osd: off.optimizer.state_dict(),
    "optimizer.load_state_dict": lambda off, osd: off.optimizer.load_state_dict(osd),
    "step": lambda off, osd: off.step(),
    "clip_grad_norm_": lambda off, osd: off.clip_grad_norm_(1.0),
    "master_parameters": lambda off, osd: off.master_parameters(),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_calls_after_close_raise_state(call):
    """Each raises strata.Error STATE naming the call and that the module
    was closed. Before: AttributeError ('NoneType' object has no attribute
    ...)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    off = st.offload_module(model, config(), force_no_gpu=True)
    train_step(model, off, 16)
    osd = off.optimizer.state_dict()
    off.close()
    with pytest.raises(strata.Error) as err:
        CALLS[call](off, osd)
    assert err.value.status == strata.STATE
    name = call.split(".")[-1]
    assert name in str(err.value) and "closed" in str(err.value), str(err.value)


def test_a_forked_child_dropping_an_offloaded_model_leaves_the_parents(tmp_path):
    """A DataLoader worker forked from a trainer drops its copy of the model
    (its collector, its exit): the parent's engine and swap folder stay, and
    the parent trains on bitwise as a run that never forked."""
    def run(fork):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        swap = tmp_path / ("forked" if fork else "plain")
        swap.mkdir()
        off = st.offload_module(model, config(swap), force_no_gpu=True)
        torch.manual_seed(1)
        train_step(model, off)
        if fork:
            pid = os.fork()
            if pid == 0:  # the child: drop everything, collect, exit
                code = 0
                try:
                    del off, model
                    gc.collect()
                except BaseException:
                    code = 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            assert os.listdir(swap), "the child removed the parent's swap folder"
        train_step(model, off)
        masters = off.master_parameters()
        off.close()
        return masters
    forked, plain = run(True), run(False)
    for name, w in plain.items():
        assert torch.equal(forked[name], w), name
