"""Two ranks of one test on this host: `argv(rank)` run as ranks 0 and 1
(torchrun's variables, a free port block of tests/free_ports.py for the
rendezvous and Strata's store), both waited for; each must exit 0. Returns
their outputs (stdout and stderr together)."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from free_ports import free_port_block  # noqa: E402


def run_two_ranks(argv, timeout, block=8):
    port = free_port_block(block)
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               STRATA_STORE_PORT=str(port + 1))
    procs = [subprocess.Popen(argv(r), env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
    return logs
