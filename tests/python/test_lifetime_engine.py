"""strata.Engine's lifetime: a tensor that views the engine's memory (as_tensor,
fetch_tensor, grads_view) keeps the native engine until it goes, past close();
a process forked from the one that made an engine (a DataLoader worker) drops
it without destroying what the parent still uses."""
import gc
import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def engine(swap=None, trace=None, values=torch.arange(8, dtype=torch.float32)):
    cfg = {"zero_optimization": {"stage": 1}, "optimizer": ADAMW}
    if swap is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(swap)}
    if trace is not None:
        cfg["strata"] = {"trace_path": str(trace)}
    e = strata.Engine(cfg, force_no_gpu=True, world_size=1)
    e.add_param(0, "w", values)
    e.build()
    return e


def threads():
    return len(os.listdir("/proc/self/task"))


def run_script(code, timeout=60):
    """`code` in a fresh interpreter (this test's environment); its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


# ---- A. views outlive close() ------------------------------------------------

@pytest.mark.parametrize("which", ["fetch_tensor", "as_tensor"])
def test_view_taken_before_close_keeps_the_native_engine(which):
    """Before, close() destroyed the engine under the view: reads gave
    garbage, a write corrupted the heap."""
    values = torch.arange(8, dtype=torch.float32)
    gc.collect()  # (earlier tests' garbage)
    live = strata._live_native_engines()
    e = engine(values=values)
    assert strata._live_native_engines() == live + 1
    v = e.fetch_tensor(0) if which == "fetch_tensor" else e.as_tensor(e.fetch(0), e.group_numel(0))
    part = v[2:5]  # a view of the view holds it too
    e.close()
    with pytest.raises(strata.Error) as err:
        e.num_groups
    assert err.value.status == strata.STATE and "closed" in str(err.value)
    assert strata._live_native_engines() == live + 1, "close() destroyed the engine under a live view"
    junk = [torch.randn(256, 256) for _ in range(20)]  # allocations that would reuse freed memory
    assert torch.equal(v, values) and torch.equal(part, values[2:5])
    v.fill_(7.0)  # into the engine's memory, still its own
    junk += [torch.randn(256, 256) for _ in range(20)]
    gc.collect()
    assert torch.equal(part, torch.full((3,), 7.0))
    del v
    assert strata._live_native_engines() == live + 1
    del part  # the last view: the native engine goes at once (no collector needed)
    assert strata._live_native_engines() == live


def test_close_without_views_destroys_at_once_and_joins_threads(tmp_path):
    gc.collect()
    before = threads()
    e = engine(swap=tmp_path)
    assert threads() > before and os.listdir(tmp_path)
    e.close()
    assert threads() == before
    assert os.listdir(tmp_path) == [], "close() left the swap files"


def test_view_past_close_defers_swap_removal_to_the_last_view(tmp_path):
    trace = tmp_path / "trace.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    gc.collect()
    before = threads()
    e = engine(swap=swap, trace=trace)
    v = e.fetch_tensor(0)
    e.close()
    assert trace.exists(), "close() with a view alive still writes the trace"
    assert os.listdir(swap), "the engine lives on under its view, with its swap file"
    del v
    assert os.listdir(swap) == [] and threads() == before


def test_view_alive_at_exit_still_removes_the_swap_files(tmp_path):
    """A view still referenced when the interpreter exits (here leaked on
    purpose): the closed engine is destroyed at exit, its swap files with it."""
    out = run_script(f"""
        import ctypes, os, torch, strata
        cfg = {{"zero_optimization": {{"stage": 1, "offload_optimizer": {{"device": "nvme",
                 "nvme_path": {str(tmp_path)!r}}}}}, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}}
        e = strata.Engine(cfg, force_no_gpu=True, world_size=1)
        e.add_param(0, "w", torch.arange(8.0)); e.build()
        v = e.fetch_tensor(0)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(v))  # never freed
        e.close()
        print("files", len(os.listdir({str(tmp_path)!r})))
    """)
    assert "files 1" in out
    assert os.listdir(tmp_path) == []


def test_offload_module_param_view_reads_after_close():
    """/tmp/review-py/uaf.py: p.detach() of an offloaded parameter taken
    outside a forward, read after close()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    ref = model[0].weight.detach().clone()
    off = st.offload_module(model, {"zero_optimization": {"stage": 3}, "optimizer": ADAMW}, force_no_gpu=True)
    w = model[0].weight.detach()
    off.close()
    junk = [torch.randn(256, 256) for _ in range(20)]  # noqa: F841
    assert torch.equal(w, ref)
    w.fill_(7.0)
    junk = [torch.randn(256, 256) for _ in range(20)]  # noqa: F841
    assert torch.equal(model[0].weight, ref)


# ---- B. fork -----------------------------------------------------------------

def _in_child(body):
    """Forks; the child runs body() and leaves with os._exit (0: it returned
    True). Returns the child's exit status, waiting at most 20 s."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() else 2
        except BaseException as e:  # noqa: BLE001 (the child must never return into pytest)
            print("child:", type(e).__name__, e, flush=True)
        os._exit(code)
    deadline = time.time() + 20
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


class _Cycle:
    def __init__(self, obj):
        self.obj, self.me = obj, self


def test_forked_child_collecting_engines_leaves_the_parent_s(tmp_path):
    """/tmp/review-py/fork.py, fork2.py: before, the child's collector (or
    close()) destroyed the parent's engine in the child: it joined threads
    the child does not have (std::system_error, abort) or hung."""
    model = nn.Linear(64, 64)
    opt = st.OffloadAdam(model.parameters(), config={"zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path)}}}, force_no_gpu=True)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    kept = engine()  # the child calls it: refused, naming the fork
    dropped = engine()
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs)
    assert files
    gc.disable()  # the collector has not reached the garbage yet when the child starts
    try:
        _Cycle(opt), _Cycle(dropped)
        del opt, dropped

        def child():
            gc.collect()  # OffloadAdam and Engine __del__ run here
            try:
                kept.num_groups
            except strata.Error as e:
                if e.status != strata.STATE or "fork" not in str(e):
                    return False
            else:
                return False
            kept.close()
            return True

        status = _in_child(child)
    finally:
        gc.enable()
    assert status == 0, f"child status {status}"
    assert sorted(os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs) == files, \
        "the child removed the parent's swap files"
    assert kept.num_groups == 1 and kept.read_master(0).numel() == 8
    kept.close()
    gc.collect()  # the parent's own garbage: destroyed here, as always
    assert os.listdir(tmp_path) == []


def test_forked_child_exiting_normally_does_not_abort(tmp_path):
    """/tmp/review-py/fork3.py: the child leaves with sys.exit(0): interpreter
    finalization runs the engines' __del__ and the exit handlers."""
    out = run_script(f"""
        import os, sys, time, torch, torch.nn as nn, strata, strata.torch as st
        swap = {str(tmp_path)!r}
        files = lambda: sorted(os.path.join(r, f) for r, d, fs in os.walk(swap) for f in fs)
        model = nn.Linear(64, 64)
        opt = st.OffloadAdam(model.parameters(), config={{"zero_optimization": {{"stage": 1,
            "offload_optimizer": {{"device": "nvme", "nvme_path": swap}}}}}}, force_no_gpu=True)
        model(torch.randn(2, 64)).sum().backward(); opt.step()
        e = strata.Engine({{"zero_optimization": {{"stage": 1}}}}, force_no_gpu=True, world_size=1)
        e.add_param(0, "w", 8); e.build()
        v = e.fetch_tensor(0); e.close()  # a closed engine with a view: destroyed at exit in the parent only
        before = files()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        for _ in range(200):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9); print("child hung"); sys.exit(1)
        print("child status", status)
        assert files() == before, "the child removed the parent's swap files"
        model(torch.randn(2, 64)).sum().backward(); opt.step()
        print("parent step ok")
    """)
    assert "child status 0" in out and "parent step ok" in out
    assert os.listdir(tmp_path) == []


def test_dataloader_fork_worker_collecting_an_optimizer():
    """/tmp/review-py/dl.py: a DataLoader worker (fork) whose collector
    reaches a dropped optimizer."""
    from torch.utils.data import DataLoader, TensorDataset
    model = nn.Linear(32, 32)
    gc.disable()
    try:
        _Cycle(st.OffloadAdam(model.parameters(), config={"zero_optimization": {"stage": 1}}, force_no_gpu=True))

        def init(_):
            gc.enable()
            gc.collect()

        dl = DataLoader(TensorDataset(torch.randn(8, 32)), batch_size=4, num_workers=1,
                        multiprocessing_context="fork", worker_init_fn=init, timeout=20)
        assert [x.shape for (x,) in dl] == [torch.Size([4, 32])] * 2
    finally:
        gc.enable()


def test_close_from_another_thread_waits_for_the_running_call():
    """A call running on one thread (a step of 16 Mi parameters) while another
    thread closes the Engine (a watchdog, a signal handler): the call's
    arguments hold the native engine, so it is destroyed when the call
    returns, not under it (a segfault before); later calls raise STATE.
    In a fresh interpreter: a crash there fails this test, not the run."""
    out = run_script(textwrap.dedent("""
        import ctypes, threading, time, strata
        e = strata.Engine({"optimizer": {"type": "AdamW"}}, world_size=1, force_no_gpu=True)
        N = 1 << 22
        for k in range(4):
            e.add_param(k, f"p{k}", N)
        e.build()
        g = (ctypes.c_float * N)()
        errs, steps = [], [0]
        def worker():
            try:
                while True:
                    for k in range(4):
                        e.grads(k, ctypes.addressof(g), dtype="f32")
                    e.step()
                    steps[0] += 1
            except strata.Error as ex:
                errs.append(ex.status)
        th = threading.Thread(target=worker)
        th.start()
        while steps[0] < 2:
            time.sleep(0.01)
        for _ in range(20):  # close at some moment inside a call
            time.sleep(0.003)
        e.close()
        th.join()
        print("done", steps[0] >= 2, errs == [strata.STATE], strata._live_native_engines())
        """), timeout=120)
    assert "done True True 0" in out, out
