"""Ranks on one host share its CPUs: each engine's CPU kernels take their
share (torchrun's ranks each have the whole mask), not the whole machine
each; ranks bound to CPUs of their own keep them."""
import math
import os
import subprocess
import sys

import pytest

import strata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from free_ports import free_port_block  # noqa: E402

# A rank: its CPUs (all, or the one given), an engine, its kernels' threads
# and the placement line.
RANK = r"""
import os, sys, strata
if sys.argv[1] != "all":
    os.sched_setaffinity(0, {int(sys.argv[1])})
e = strata.Engine("{}", force_no_gpu=True)
print(e.stats()["cpu_kernel_threads"], "|", e.placement, flush=True)
e.close()
"""


def cgroup_limited():
    # Where a cgroup caps the CPUs below the mask, the expectations below
    # would need its numbers: this test is about the ranks' share alone.
    probe = subprocess.run([sys.executable, "-c", "import strata; e = strata.Engine('{}', force_no_gpu=True); "
                            "print(e.stats()['cpu_kernel_threads'])"], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    return int(probe.stdout.split()[-1]) < len(os.sched_getaffinity(0))


def run_ranks(cpus):
    port = free_port_block(2)
    env = dict(os.environ, WORLD_SIZE=str(len(cpus)), LOCAL_WORLD_SIZE=str(len(cpus)), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), STRATA_STORE_PORT=str(port + 1))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, c], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, c in enumerate(cpus)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(cpus), outs
    return [tuple(o[0].strip().split(" | ", 1)) for o in outs]


def test_one_process_alone_takes_its_mask():
    if cgroup_limited():
        pytest.skip("a cgroup CPU limit below the mask here")
    e = strata.Engine("{}", force_no_gpu=True)
    n = len(os.sched_getaffinity(0))
    assert e.stats()["cpu_kernel_threads"] == n
    assert e.placement.endswith(f"CPU kernels: {n} thread" + ("s" if n > 1 else ""))
    e.close()


def test_two_ranks_on_the_same_cpus_take_half_each():
    if cgroup_limited():
        pytest.skip("a cgroup CPU limit below the mask here")
    n = len(os.sched_getaffinity(0))
    share = math.ceil(n / 2)
    for threads, line in run_ranks(["all", "all"]):
        assert int(threads) == share, line
        assert line.endswith(f"CPU kernels: {share} thread{'s' if share > 1 else ''} "
                             "(2 processes share these CPUs)"), line


def test_ranks_bound_to_cpus_of_their_own_keep_them():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: no two ranks on CPUs of their own")
    if cgroup_limited():
        pytest.skip("a cgroup CPU limit below the mask here")
    for threads, line in run_ranks([str(cpus[0]), str(cpus[1])]):
        assert int(threads) == 1, line
        assert line.endswith("CPU kernels: 1 thread"), line
