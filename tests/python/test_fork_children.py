"""Engines made inside a multiprocessing child and left for exit to free.

multiprocessing ends a child it forked (the "fork" and "forkserver" start
methods: a Process, a Pool's worker) with os._exit after its own exit handler
(multiprocessing.util._exit_function): neither atexit nor weakref.finalize's
exit hook runs there. Before, such an engine was never destroyed: its swap
files (and offload_module's swap folder) stayed on disk and its trace was never
written. Each case runs a script in a fresh interpreter, whose main process
holds an engine of its own that no child may touch."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent('''
    import gc, json, multiprocessing as mp, os, sys, threading, time, weakref
    import numpy as np
    import torch
    import strata
    import strata.torch as st

    ROOT, METHOD, RUNNER, SCENARIO = sys.argv[1:5]
    KEEP = []  # what a child keeps until it exits (a script's module-level objects)


    def paths(name):
        swap = os.path.join(ROOT, name, "swap")
        os.makedirs(swap, exist_ok=True)
        return swap, os.path.join(ROOT, name, "trace.json")


    def raw_engine(name):
        swap, trace = paths(name)
        sec = {"device": "nvme", "nvme_path": swap}
        e = strata.Engine({"zero_optimization": {"stage": 1, "offload_optimizer": sec},
                           "optimizer": {"type": "AdamW"}, "strata": {"trace_path": trace}},
                          force_no_gpu=True, world_size=1)
        e.add_param(0, "w", 1 << 12)
        e.build()
        e.grads(0, np.ones(1 << 12, np.float32))
        e.step()
        return e


    def module(name):
        swap, trace = paths(name)
        sec = {"device": "nvme", "nvme_path": swap}
        model = torch.nn.Linear(16, 16)
        off = st.offload_module(model, {"zero_optimization": {"stage": 3, "offload_optimizer": sec,
                                                              "offload_param": dict(sec)},
                                        "optimizer": {"type": "AdamW"}, "strata": {"trace_path": trace}},
                                force_no_gpu=True)
        model(torch.randn(2, 16)).sum().backward()
        off.optimizer.step()
        return model, off


    def adam(name):
        swap, _ = paths(name)
        model = torch.nn.Linear(16, 16)
        opt = st.OffloadAdam(model.parameters(), config={"zero_optimization": {
            "stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": swap}}}, force_no_gpu=True)
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        return model, opt


    def swap_entries(name):
        return sorted(os.listdir(os.path.join(ROOT, name, "swap")))


    def work(i):
        e, (model, off) = raw_engine(f"engine{i}"), module(f"module{i}")
        if SCENARIO == "closed":  # closed by hand, then exit: the cleanup runs once
            e.close()
            off.close()
        elif SCENARIO == "viewed":  # closed while views of its memory live until exit
            KEEP.append(e.fetch_tensor(0))
            e.close()
            KEEP.append(model.weight.detach())
            off.close()
            assert swap_entries(f"engine{i}") and swap_entries(f"module{i}"), "freed under a view"
        elif SCENARIO == "thread":  # a non-daemon thread still drives both as the target returns
            def drive():
                for _ in range(10):
                    time.sleep(0.05)
                    e.grads(0, np.ones(1 << 12, np.float32))
                    e.step()
                    model(torch.randn(2, 16)).sum().backward()
                    off.optimizer.step()
                with open(os.path.join(ROOT, f"thread{i}.done"), "w"):
                    pass
            threading.Thread(target=drive).start()
        elif SCENARIO == "grandchild":  # a process forked from the child leaves through atexit
            pid = os.fork()
            if pid == 0:
                sys.exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            assert swap_entries(f"engine{i}") and swap_entries(f"module{i}"), "the grandchild's exit removed them"
            e.grads(0, np.ones(1 << 12, np.float32))
            e.step()
            model(torch.randn(2, 16)).sum().backward()
            off.optimizer.step()
        elif SCENARIO == "dropped":  # dropped in the child: nothing at exit keeps them alive
            from multiprocessing import util
            refs = [weakref.ref(e), weakref.ref(off)]
            del e, model, off
            gc.collect()
            assert all(r() is None for r in refs), "kept alive by an exit handler"
            assert swap_entries(f"engine{i}") == [] and swap_entries(f"module{i}") == [], "not freed when dropped"
            assert os.path.exists(os.path.join(ROOT, f"engine{i}", "trace.json"))
            before = len(util._finalizer_registry)
            for _ in range(3):
                e2, (m2, o2) = raw_engine(f"again{i}"), module(f"again{i}")
                del e2, m2, o2
                gc.collect()
            assert len(util._finalizer_registry) == before, "the exit handlers of dropped engines stay registered"
            return os.getpid()
        KEEP.append((e, model, off))
        if SCENARIO == "left":
            KEEP.append(adam(f"adam{i}"))
        return os.getpid()


    if __name__ == "__main__":
        ctx = mp.get_context(METHOD)
        parent = raw_engine("parent")  # (copied into fork children: theirs only to drop)
        parent_swap = swap_entries("parent")
        if RUNNER == "process":
            p = ctx.Process(target=work, args=(0,))
            p.start()
            p.join(120)
            exitcodes = [p.exitcode]
        else:
            pool = ctx.Pool(2)
            try:
                pool.map(work, [0, 1], chunksize=1)
                workers = list(pool._pool)
                pool.close()
                pool.join()
                exitcodes = [w.exitcode for w in workers]
            finally:
                pool.terminate()
        assert swap_entries("parent") == parent_swap, "a child's exit touched the parent's swap files"
        assert not os.path.exists(os.path.join(ROOT, "parent", "trace.json")), "a child wrote the parent's trace"
        parent.grads(0, np.ones(1 << 12, np.float32))
        parent.step()
        parent.close()
        print(json.dumps({"exitcodes": exitcodes}))
''')


def run(tmp_path, method, runner, scenario):
    """The script's children's exit codes; the script's stderr must be clean:
    multiprocessing prints (and swallows) what an exit handler raises."""
    script = tmp_path / "fork_children_script.py"
    script.write_text(SCRIPT)
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, str(script), str(root), method, runner, scenario], capture_output=True,
                       text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    return root, json.loads(r.stdout.strip().splitlines()[-1])["exitcodes"]


def left_on_disk(root):
    """Every swap file or swap folder left under any nvme_path."""
    return sorted(os.path.relpath(os.path.join(dirpath, n), root)
                  for name in os.listdir(root) if os.path.isdir(root / name / "swap")
                  for dirpath, dirs, files in os.walk(root / name / "swap") for n in dirs + files)


def check_traces(root, names):
    for name in names:
        trace = root / name / "trace.json"
        assert trace.exists(), f"{name}: its trace was never written"
        with open(trace) as f:
            json.load(f)


def test_fork_process_child_frees_its_engines_at_exit(tmp_path):
    """A raw Engine, an offload_module and an OffloadAdam made in a
    fork-started Process and left for exit: their swap files and folders go,
    their traces are written. Before: strata-swap.r0.s0.bin and the
    strata-...-<childpid>-... folders stayed, and no trace."""
    root, exitcodes = run(tmp_path, "fork", "process", "left")
    assert exitcodes == [0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])


def test_fork_pool_worker_frees_its_engines_at_exit(tmp_path):
    """The same in the workers of a fork-started Pool (close() and join():
    terminate() kills the workers, where nothing can run)."""
    root, exitcodes = run(tmp_path, "fork", "pool", "left")
    assert exitcodes == [0, 0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "engine1", "module1", "parent"])


def test_forkserver_child_frees_its_engines_at_exit(tmp_path):
    """forkserver's children end with os._exit too."""
    root, exitcodes = run(tmp_path, "forkserver", "process", "left")
    assert exitcodes == [0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])


def test_spawn_child_frees_its_engines_at_exit(tmp_path):
    """spawn's children leave through interpreter exit, which frees the
    engines (before, OffloadAdam's swap folder stayed there, empty: its
    __del__ ran too late in the interpreter's teardown to remove it)."""
    root, exitcodes = run(tmp_path, "spawn", "process", "left")
    assert exitcodes == [0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])


def test_fork_child_closing_its_engines_itself(tmp_path):
    """close() in the child, then exit: the cleanup runs once (a second run
    would raise in the exit handler, or destroy the engine twice)."""
    root, exitcodes = run(tmp_path, "fork", "process", "closed")
    assert exitcodes == [0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])


def test_fork_child_engines_closed_but_viewed_until_exit(tmp_path):
    """Closed while a tensor viewing their memory lives (fetch_tensor, a
    parameter's detach()): the engines wait for the views, and exit frees
    them (in the main process the atexit handler and weakref.finalize do)."""
    root, exitcodes = run(tmp_path, "fork", "process", "viewed")
    assert exitcodes == [0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])


def test_fork_child_thread_still_driving_the_engines(tmp_path):
    """A non-daemon thread of the child still steps both when the target
    returns: the engines are freed after it ends (as interpreter exit would:
    non-daemon threads first), not under it."""
    root, exitcodes = run(tmp_path, "fork", "process", "thread")
    assert exitcodes == [0]
    assert (root / "thread0.done").exists(), "the thread did not finish its steps"
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])


def test_fork_child_own_fork_leaves_its_engines_alone(tmp_path):
    """A process forked from the child (os.fork, leaving through sys.exit,
    which runs multiprocessing's exit handler there too) does not free the
    child's engines: they step after it, and go at the child's own exit."""
    root, exitcodes = run(tmp_path, "fork", "process", "grandchild")
    assert exitcodes == [0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])


def test_fork_child_exit_handlers_keep_nothing_alive(tmp_path):
    """The exit handlers registered in a child hold neither the Engine nor
    the OffloadedModule: dropped, they are freed at once, and their handlers
    go with them (a child that makes engines in a loop does not grow them)."""
    root, exitcodes = run(tmp_path, "fork", "process", "dropped")
    assert exitcodes == [0]
    assert left_on_disk(root) == []
    check_traces(root, ["engine0", "module0", "parent"])
