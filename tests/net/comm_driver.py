#!/usr/bin/python3
"""Multi-process comm tests over loopback, one scenario per invocation.

  kill      one rank SIGKILLs itself mid all_reduce: every other rank must
            exit non-zero within the timeout with an error naming the
            collective; under strata-launch the launcher exits 128+9.
  hang      one rank stops answering: the others time out naming the
            collective and find it alive (one may instead see the
            connection of a survivor that timed out first close).
  diverge   one rank's 4th collective differs (another op and size, or
            another label): every rank exits with COMM naming both sides,
            none crashes (Gloo used to abort on the size mismatch).
  torchrun  torchrun (python3 -m torch.distributed.run) starts 2 ranks of
            comm_worker; skipped (77) without torch.
  launcher  strata-launch: variables, [rank K] prefixes, failure and signal
            propagation, SIGKILL after the grace period, SIGTERM to itself.
Every process is bounded by a timeout and killed at the end.
"""
import argparse
import os
import re
import select
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from free_ports import free_port_block  # noqa: E402

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAILED: " + what, flush=True)


def free_port(pair=False):
    """A loopback port nobody listens on (and the next one too, if pair),
    outside the ephemeral range (tests/free_ports.py says why)."""
    return free_port_block(2 if pair else 1)


def start_ranks(worker, world, args):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([worker] + args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def finish(p, limit):
    """(returncode, output, seconds) of p, killing it after `limit` seconds."""
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return None, out + err, limit
    return p.returncode, out + err, time.monotonic() - t0


def wait_lines(p, want, limit):
    """True once p's stdout has had every line in `want`, False if p exits
    or `limit` seconds pass first. Reads the pipe's descriptor directly (the
    file object's buffer stays empty for a later communicate())."""
    fd, seen, buf = p.stdout.fileno(), set(), b""
    deadline = time.monotonic() + limit
    while not set(want) <= seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        chunk = os.read(fd, 4096)
        if not chunk:
            return False
        buf += chunk
        *lines, buf = buf.split(b"\n")
        seen.update(l.decode(errors="replace") for l in lines)
    return True


def scenario_victim(a, mode):
    # The timeout bounds the 4 processes' rendezvous and the three good
    # iterations too: generous, for a slow and loaded machine.
    world, timeout, victim = 4, 10, 1
    args = ["--mode", mode, "--timeout", str(timeout), "--victim", str(victim), "--hang-s", "60"]
    procs = start_ranks(a.worker, world, args)
    t0 = time.monotonic()
    survivors = [r for r in range(world) if r != victim]
    timed_out = 0  # hang: survivors that report the timeout themselves
    for r in survivors:
        # Start-up (rendezvous) plus three iterations, then at most the timeout.
        rc, out, _ = finish(procs[r], timeout + 20)
        elapsed = time.monotonic() - t0
        print(f"rank {r}: rc={rc} after {elapsed:.1f} s: {out.strip()}", flush=True)
        check(rc == 2, f"rank {r} exits 2 (a communicator error), got {rc}")
        check("all_reduce #4 (4096 floats) on rank %d of %d" % (r, world) in out,
              f"rank {r}'s error names the collective and its number")
        if mode == "hang":
            # Its own timeout, or (the survivors' timers fire within
            # milliseconds of each other: on a loaded machine one may exit
            # first) the connection that survivor closed on its way out.
            own = "TIMEOUT:" in out and f"timed out after {timeout} s" in out
            timed_out += own
            check(own or ("COMM:" in out and "closed its connection" in out),
                  f"rank {r} reports a timeout, or a survivor's closed connection after it")
            # The sleeper is alive: probed after the failure, it answers.
            answering = re.search(r"answering: ranks? ([0-9, ]+)", out)
            check(answering is not None and str(victim) in answering.group(1).replace(" ", "").split(",")
                  and "lost peer" not in out, f"rank {r} finds rank {victim} alive (it hangs, it is not lost)")
        else:
            check(re.search(rf"lost peers? .*rank {victim} at 127\.0\.0\.1:[0-9]+ \(connection refused: its process is gone\)",
                            out) is not None, f"rank {r} names rank {victim} as the peer lost")
        check(elapsed < timeout + 15, f"rank {r} exits within the timeout ({elapsed:.1f} s)")
    if mode == "hang":
        check(timed_out > 0, f"a survivor reports the timeout ({timed_out} of {len(survivors)})")
    if mode == "kill":
        rc, out, _ = finish(procs[victim], 10)
        check(rc == -signal.SIGKILL, f"the victim died by SIGKILL, got {rc}")
        # The same through strata-launch: the launcher reports the victim's death.
        t0 = time.monotonic()
        p = subprocess.run([a.launch, "--nproc", "3", "--master-port", "0", "--", a.worker] + args,
                           capture_output=True, text=True, timeout=60)
        print(p.stdout + p.stderr, flush=True)
        check(p.returncode == 128 + signal.SIGKILL, f"strata-launch exits 137, got {p.returncode}")
        check("rank 1 was killed by signal" in p.stderr, "strata-launch names the dead rank")
        check(time.monotonic() - t0 < 30, "strata-launch returns promptly")
    else:
        procs[victim].kill()
        finish(procs[victim], 10)


def scenario_diverge(a):
    world, victim = 3, 1
    for kind, theirs in (("op", "all_gather of 8 bytes for 'iteration 3'"),
                         ("label", "all_reduce of 16384 bytes for 'something else'")):
        procs = start_ranks(a.worker, world, ["--mode", "diverge-" + kind, "--timeout", "20",
                                              "--victim", str(victim)])
        for r in range(world):
            rc, out, took = finish(procs[r], 40)
            print(f"{kind}: rank {r}: rc={rc} after {took:.1f} s: {out.strip()}", flush=True)
            check(rc == 2, f"{kind}: rank {r} exits 2 (a communicator error), got {rc}")
            check("COMM:" in out and "ranks disagree" in out, f"{kind}: rank {r} reports the disagreement")
            check("all_reduce #4" in out or "all_gather #4" in out, f"{kind}: rank {r} names the collective")
            if r != victim:
                check(theirs in out, f"{kind}: rank {r} names the victim's side ({theirs})")
            else:
                check("all_reduce of 16384 bytes for 'iteration 3'" in out, f"{kind}: the victim names the others' side")


def scenario_torchrun(a):
    try:
        subprocess.run(["/usr/bin/python3", "-c", "import torch.distributed.run"], check=True,
                       capture_output=True, timeout=60)
    except Exception as e:  # no torch here: skipped, not passed
        print(f"skipped: torchrun not importable ({e})")
        sys.exit(77)
    port = free_port(pair=True)  # torchrun's store on port, ours on port + 1
    # --redirects 2 --tee 2: torch 1.13 on Python 3.11 cannot parse the default
    # "0" (Std.NONE is not iterable in 3.11's IntFlag); stderr teed works.
    cmd = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), "--redirects", "2", "--tee", "2", "--no_python",
           a.worker, "--timeout", "30"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    out = p.stdout + p.stderr
    print(out, flush=True)
    check(p.returncode == 0, f"torchrun exits 0, got {p.returncode}")
    for r in range(2):
        check(f"comm_worker rank {r}: gloo, 0 failures" in out, f"rank {r} ran every collective")


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def launch(a, nproc, script, *extra, limit=30):
    t0 = time.monotonic()
    p = subprocess.run([a.launch, "--nproc", str(nproc), "--master-port", "0", *extra, "--",
                        "sh", "-c", script], capture_output=True, text=True, timeout=limit)
    return p, time.monotonic() - t0


def scenario_launcher(a):
    p, _ = launch(a, 3, 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT";'
                        ' echo e$RANK >&2; printf tail')
    print(p.stdout + p.stderr, flush=True)
    check(p.returncode == 0, f"all ranks ok: exit 0, got {p.returncode}")
    lines = p.stdout.splitlines()
    for r in range(3):
        check(any(l.startswith(f"[rank {r}] {r} 3 {r} 3 127.0.0.1 ") for l in lines), f"rank {r}'s variables")
        check(f"[rank {r}] tail" in lines, f"rank {r}'s unterminated last line")
        check(f"[rank {r}] e{r}" in p.stderr.splitlines(), f"rank {r}'s stderr")
    ports = {l.split()[-1] for l in lines if not l.endswith("tail")}
    check(len(ports) == 1 and ports != {"0"}, f"one chosen MASTER_PORT, got {ports}")
    # Outside the ephemeral range, where no connection's local port can hold it.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = (int(x) for x in f.read().split())
    port = int(next(iter(ports))) if len(ports) == 1 else 0
    check(not lo <= port <= hi, f"the chosen MASTER_PORT {port} is outside the ephemeral range {lo}-{hi}")

    p, took = launch(a, 3, 'if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 60')
    check(p.returncode == 3 and took < 10, f"a failing rank stops the others: rc {p.returncode}, {took:.1f} s")
    check("rank 1 exited with code 3" in p.stderr, "the launcher names the failed rank")

    p, took = launch(a, 2, 'if [ "$RANK" = 0 ]; then kill -9 $$; fi; exec sleep 60')
    check(p.returncode == 137 and took < 10, f"a killed rank: rc {p.returncode}, {took:.1f} s")

    p, took = launch(a, 2, 'if [ "$RANK" = 1 ]; then sleep 0.3; exit 5; fi; trap "" TERM; sleep 60',
                     "--grace", "1")
    check(p.returncode == 5 and took < 10, f"SIGKILL after the grace: rc {p.returncode}, {took:.1f} s")

    # A rank whose own process dies while a child of it lives on (a shell
    # wrapper killed): the child is stopped too, not left behind the launcher.
    p, took = launch(a, 2, 'if [ "$RANK" = 0 ]; then sleep 317 & sleep 0.5; kill -9 $$; fi; exec sleep 60',
                     "--grace", "1")
    time.sleep(0.3)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid) == b"sleep\x00317\x00"]
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    check(p.returncode == 137 and not left, f"a dead rank's child goes too: rc {p.returncode}, left {left}")

    # Once per host (--nnodes): node-major ranks, the node's index as torchrun names it.
    script = 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $MASTER_ADDR $MASTER_PORT"'
    p = subprocess.run([a.launch, "--nnodes", "3", "--node-rank", "1", "--nproc", "2", "--master-addr", "10.213.0.1",
                        "--master-port", "29411", "--", "sh", "-c", script],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "NODE_RANK": "7"})
    print(p.stdout + p.stderr, flush=True)
    for local in range(2):
        want = f"[rank {2 + local}] {2 + local} 6 {local} 2 1 3 10.213.0.1 29411"
        check(want in p.stdout.splitlines(), f"--nnodes 3 --node-rank 1: local rank {local} gets '{want}'")
    for bad, words in ((["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is not below --nnodes 2"),
                       (["--nnodes", "2", "--node-rank", "1", "--master-port", "0"], "works on one host only"),
                       (["--nnodes", "2", "--node-rank", "1", "--master-port", "29411"], "needs --master-addr")):
        p = subprocess.run([a.launch, "--nproc", "1", *bad, "--", "true"], capture_output=True, text=True, timeout=30)
        check(p.returncode == 2 and words in p.stderr, f"{' '.join(bad)} refused naming it: {p.stderr.strip()}")

    # A progress bar ('\r' redraws, no newline until it closes) is forwarded
    # as it goes, each redraw with the prefix (it was held, unseen, until the
    # rank's exit, the launcher's buffer growing all run); a line longer than
    # 64 KiB goes on in pieces, none lost.
    q = subprocess.Popen([a.launch, "--nproc", "1", "--", "sh", "-c",
                          "printf 'step 1\\r'; printf 'step 2\\r'; sleep 60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fd, got, deadline = q.stdout.fileno(), b"", time.monotonic() + 30
    while b"step 2\r" not in got and time.monotonic() < deadline:
        if select.select([fd], [], [], 1)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            got += chunk
    q.kill()
    q.communicate()
    check(got == b"[rank 0] step 1\r[rank 0] step 2\r", f"the progress bar's redraws forwarded as they come: {got!r}")
    p, _ = launch(a, 1, "head -c 200000 /dev/zero | tr '\\0' x")
    pieces = p.stdout.split("\n")
    check(p.returncode == 0 and "".join(l.removeprefix("[rank 0] ") for l in pieces) == "x" * 200000
          and all(l.startswith("[rank 0] ") and len(l) <= 65536 + 9 for l in pieces if l),
          f"a 200000-byte line in prefixed pieces of at most 64 KiB: {[len(l) for l in pieces]}")

    # SIGTERM once the launcher forwards both ranks' first line: it installs
    # its handler before it starts a rank, so it is in place by then (a fixed
    # sleep could signal a launcher not yet that far on a loaded machine).
    q = subprocess.Popen([a.launch, "--nproc", "2", "--", "sh", "-c", "echo up; exec sleep 60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    up = wait_lines(q, ["[rank 0] up", "[rank 1] up"], 30)
    check(up, "the launcher forwards both ranks' first line")
    t0 = time.monotonic()
    q.send_signal(signal.SIGTERM)
    rc, _, _ = finish(q, 20)
    took = time.monotonic() - t0
    check(rc == 128 + signal.SIGTERM and took < 10, f"SIGTERM to the launcher: rc {rc}, {took:.1f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--launch", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("scenario", choices=["kill", "hang", "diverge", "torchrun", "launcher"])
    a = ap.parse_args()
    if a.scenario in ("kill", "hang"):
        scenario_victim(a, a.scenario)
    elif a.scenario == "diverge":
        scenario_diverge(a)
    elif a.scenario == "torchrun":
        scenario_torchrun(a)
    else:
        scenario_launcher(a)
    print("FAILED: " + "; ".join(FAILURES) if FAILURES else "ok", flush=True)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
