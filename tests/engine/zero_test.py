#!/usr/bin/env python3
"""ZeRO stages 0-3 over 1, 2 and 4 ranks (Gloo over loopback), started by
strata-launch: parameters after 20 steps match the 1-rank stage-0 run within
1e-6 relative; at 2 ranks, placements (device, host, NVMe) never change the
bits, and stages that reduce the same way (0 and 1: all-reduce; 2 and 3:
reduce-scatter) agree bitwise. Killing a rank makes every other rank exit
non-zero within the timeout, naming the collective. A step that fails on one
rank's disk part-way resumes on every rank to the clean bits. An 8-rank stage-3 run with
state on NVMe matches the 1-rank run.
With `buckets`, only the gradient reduction's buckets and overlap: at 2 and 4
ranks, reduce_bucket_size cut into many small uneven buckets, with and
without overlap_comm: reduce-scatter stages (2-3) give the bits of one
bucket, all-reduce stages (0-1) stay within 1e-6 of the 1-rank run (at 2
ranks; 4 ranks run 6 steps, compared among themselves), and
overlap_comm never changes the bits (at stage 3 it also gathers the next
group ahead, and does: the count is checked); gradients handed in parts
(grads_part: packed as they come, or lent and read where they lie, one
part given twice, a row and a tail
left out) reduce to the bits of the whole hand at every stage, a second
group's parts are refused while one is open, and without overlap_comm parts
are refused naming it; a rank that dies mid-backward fails the
others, naming the collective, through the communication thread.
With `frozen`, a frozen group (FreezeGroup) over 1, 2 and 3 ranks at every
stage: never stepped, the rest as at 1 rank, checkpoints resharded, and
ranks that freeze differently refused at build.
Usage: zero_test.py STRATA_LAUNCH ZERO_WORKER [buckets|frozen]"""
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from free_ports import free_port_block  # noqa: E402

import numpy as np

LAUNCH, WORKER = sys.argv[1], sys.argv[2]
work = tempfile.mkdtemp(prefix="strata-zero-", dir="/var/tmp")
failures = []
last_err = ""  # the latest run's stderr


def free_port():
    # Two: the ranks' store may take MASTER_PORT + 1 under torchrun's rules.
    return free_port_block(2)


def run(nproc, stage, place, tag, extra=(), expect_fail=False, env=None):
    out = os.path.join(work, tag + ".bin")
    swap = os.path.join(work, tag)
    os.makedirs(swap, exist_ok=True)
    cmd = [LAUNCH, "--nproc", str(nproc), "--master-port", str(free_port()), "--",
           WORKER, str(stage), place, swap, out, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=None if env is None else {**os.environ, **env})
    global last_err
    last_err = p.stderr
    if expect_fail:
        return p
    if p.returncode != 0:
        failures.append(f"{tag}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
        return None
    return np.fromfile(out, dtype=np.float32)


def check(name, ok, detail=""):
    print(("ok: " if ok else "FAIL: ") + name + (f" ({detail})" if detail else ""))
    if not ok:
        failures.append(name + " " + detail)


def check_comm(world, stage):
    """The last run's collective stats (rank 0, engine_stats.h comm_s): at
    several ranks every step reduced every group's padded fp32 gradient
    once (stage 0: padded to one shard) and, at stages 1-3, gathered every
    group's P once (stage 3: for forward's fetch, kept for backward; 1-2:
    after the update); wall and CPU seconds were counted, CPU within wall;
    at one rank none of it."""
    m = re.search(r"groups (\d+) steps (\d+) .*comm_s ([\d.]+) comm_cpu_s ([\d.]+) reduced_bytes (\d+) "
                  r"gathered_bytes (\d+) padded (\d+) padded_one (\d+)", last_err)
    if m is None:
        check(f"world {world} stage {stage}: the worker reports its collective stats", False, last_err.strip()[-300:])
        return
    steps, wall, cpu = int(m.group(2)), float(m.group(3)), float(m.group(4))
    reduced, gathered, padded, padded_one = (int(m.group(k)) for k in (5, 6, 7, 8))
    name = f"world {world} stage {stage}: collective stats"
    if world == 1:
        check(name + " are zero at one rank", (wall, cpu, reduced, gathered) == (0, 0, 0, 0), m.group(0))
        return
    check(name + ": every group's gradient reduced once a step",
          reduced == steps * (padded if stage > 0 else padded_one), m.group(0))
    # Stage 3: the device budget holds every group gathered, so forward's gather serves backward too.
    # (P is fp32 in these runs: its gathered bytes are `padded`'s, fp32's.)
    check(name + ": P gathered once a step at stages 1-3, never at 0",
          gathered == (steps * padded if stage > 0 else 0), m.group(0))
    check(name + ": wall and CPU seconds counted, CPU within wall", 0 < cpu <= wall * 1.02 + 0.005, m.group(0))


ref = run(1, 0, "device", "ref")
check_comm(1, 0)
if ref is None:
    print("\n".join(failures))
    sys.exit(1)
scale = np.abs(ref).max()


def finish():
    subprocess.run(["rm", "-rf", work])
    if failures:
        print("\n".join(failures[:5]))
    print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
    sys.exit(1 if failures else 0)


if sys.argv[3:] == ["buckets"]:
    for world in (2, 4):
        # 4 ranks on 2 cores are slow: 6 steps, compared among themselves
        # (2 ranks run the 20 steps that the 1-rank reference has).
        steps = ("steps", "20" if world == 2 else "6")
        for stage in (0, 1, 2, 3):
            one = run(world, stage, "device", f"b1w{world}s{stage}", ("overlap", "0") + steps) if stage >= 2 else ref
            # 160 elements a collective: 40 columns of a 150-element shard at
            # 4 ranks, 80 of 300 at 2: several buckets a group, the last short.
            small = run(world, stage, "device", f"bsw{world}s{stage}", ("bucket", "160", "overlap", "0") + steps)
            # State on NVMe: G staged too, so the communication thread needs a
            # staging slot of its own beside the packed groups.
            over = run(world, stage, "nvme", f"bow{world}s{stage}", ("bucket", "160", "overlap", "1") + steps)
            if stage == 3 and over is not None:
                # The next group's gather ran on the communication thread.
                m = re.search(r"gathers_ahead (\d+) declined (\d+)", last_err)
                check(f"world {world} stage 3 with overlap_comm: groups were gathered ahead",
                      m is not None and int(m.group(1)) > 0, m.group(0) if m else last_err.strip()[-200:])
                # Copies are kept gathered (the budget holds them all): backward
                # queues no gather ahead that every rank would decline.
                check(f"world {world} stage 3 with overlap_comm: no gather ahead declined",
                      m is not None and int(m.group(2)) == 0, m.group(0) if m else last_err.strip()[-200:])
            if one is None or small is None or over is None:
                continue
            if world == 2:
                err = np.abs(small - ref).max() / scale
                check(f"world {world} stage {stage}, 160-element buckets, matches 1-rank stage 0", err <= 1e-6,
                      f"max rel diff {err:.2e}")
            if stage >= 2:
                check(f"world {world} stage {stage}: 160-element buckets == one bucket, bitwise (reduce-scatter)",
                      np.array_equal(small, one))
            check(f"world {world} stage {stage}: overlap_comm (state on NVMe) == without, bitwise",
                  np.array_equal(small, over))
            if world == 2:
                # Gradients in parts (grads_part): packed as they come, over
                # many buckets, one part given twice (added), one row left
                # out (zeros), a second group's parts refused while one is
                # open (the worker checks) — the bits of the whole hand of
                # the same gradient. 63 wide: a layer's 4032 elements fill
                # both ranks' 2048-element pieces, so that what a packed
                # buffer held before is another layer's gradient everywhere.
                extra = ("bucket", "160", "overlap", "1", "hole", "1", "dim", "63") + steps
                hole = run(world, stage, "nvme", f"bhw{world}s{stage}", extra)
                parts = run(world, stage, "nvme", f"bpw{world}s{stage}", extra + ("parts", "1"))
                if hole is not None and parts is not None:
                    check(f"world {world} stage {stage}: gradients in parts == the whole hand, bitwise",
                          np.array_equal(hole, parts))
                # Parts lent, the state in host memory: at stages 2-3 the
                # reduce-scatter reads them where they lie (G takes the sums
                # straight); at 0-1 they are packed. The same bits.
                lent = run(world, stage, "host", f"blw{world}s{stage}", extra + ("parts", "1", "lend", "1"))
                if hole is not None and lent is not None:
                    check(f"world {world} stage {stage}: gradients in parts lent == the whole hand, bitwise",
                          np.array_equal(hole, lent))
                    # Read where they lay at stages 2-3: every layer's reduction (of
                    # every step) from lent parts, all but the one group handed
                    # whole (each group pads to the same 4096 elements here); at
                    # 0-1 (an all-reduce in place) none.
                    m = re.search(r"groups (\d+) .* reduced_bytes (\d+) .* lent_reduced_bytes (\d+)", last_err)
                    n, red, lent_red = (int(x) for x in m.groups()) if m else (0, 0, -1)
                    check(f"world {world} stage {stage}: the reductions read the lent parts where they lay "
                          f"({'every layer' if stage >= 2 else 'none'})",
                          red > 0 and lent_red * n == (red * (n - 1) if stage >= 2 else 0),
                          m.group(0) if m else last_err.strip()[-200:])
    # Without overlap_comm the reduction's one buffer takes whole groups:
    # parts are refused, saying why.
    p = run(2, 3, "device", "bpno", ("overlap", "0", "steps", "1", "parts", "1"), expect_fail=True)
    check("parts without overlap_comm: refused, naming the setting",
          p.returncode != 0 and "overlap_comm is off" in p.stderr, p.stderr.strip()[-300:])
    # A rank dies while the others reduce in the background. The timeout also
    # bounds the rendezvous and the steps before the death: generous, for a
    # slow and loaded machine (a hang still fails the bound below).
    kill_timeout = 10
    port = free_port()
    procs = []
    start = time.time()
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([WORKER, "2", "device", os.path.join(work, "bkill"),
                                       os.path.join(work, "bkill.bin"), "kill-rank-1-at-step", "3", "timeout",
                                       str(kill_timeout), "bucket", "160", "overlap", "1"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    err = outs[0][1]
    check("overlap_comm: rank 0 fails when rank 1 dies, naming the background reduction and the collective",
          procs[0].returncode != 0 and "overlap_comm" in err and "reduce_scatter" in err,
          f"exit {procs[0].returncode}: {err.strip()[-300:]}")
    check("overlap_comm: the survivor stops within the timeout", time.time() - start < kill_timeout + 30)
    finish()
if sys.argv[3:] == ["frozen"]:
    # Layer 1 frozen (FreezeGroup): its parameters are never stepped (they
    # equal the initial values bitwise after the steps, at every stage and
    # rank count); the other groups match the 1-rank run with it frozen;
    # checkpoints with it reshard exactly; ranks that freeze differently are
    # refused at build, naming the group.
    fz = ("frozen", "1")
    lo, hi = 600, 1200  # layer 1 of TinyMlp(3, 24): 24 * 24 + 24 elements after layer 0's
    init = run(1, 0, "device", "finit", fz + ("steps", "0"))
    fref = run(1, 0, "device", "fref", fz)
    if init is None or fref is None:
        finish()
    fscale = np.abs(fref).max()
    check("1 rank: the frozen layer is unchanged bitwise, the others trained",
          np.array_equal(fref[lo:hi], init[lo:hi]) and not np.array_equal(fref[:lo], init[:lo]))
    for world in (2, 3):
        for stage in (0, 1, 2, 3):
            for place in ("device", "nvme") if world == 2 or stage == 3 else ("device",):
                w = run(world, stage, place, f"fz{world}s{stage}{place}", fz)
                if w is None:
                    continue
                err = np.abs(w - fref).max() / fscale
                check(f"frozen, world {world} stage {stage} on {place}: frozen layer unchanged bitwise, the rest "
                      f"matches 1 rank", np.array_equal(w[lo:hi], init[lo:hi]) and err <= 1e-6,
                      f"max rel diff {err:.2e}")
    # Saved at n ranks, loaded at m (stage 3: P sharded; stage 1: every rank
    # holds all of it and saves its slice), then trained on: the same weights.
    for n, m, stage in ((2, 3, 3), (3, 2, 3), (2, 3, 1), (2, 1, 3)):
        ck = os.path.join(work, f"fck{n}{m}{stage}")
        saved = run(n, stage, "nvme", f"fsave{n}{m}{stage}", fz + ("steps", "4", "save", ck))
        loaded = run(m, stage, "nvme", f"fload{n}{m}{stage}", fz + ("steps", "0", "load", ck))
        if saved is None or loaded is None:
            continue
        check(f"frozen, stage {stage}: saved at {n} ranks, loaded at {m}: weights identical",
              np.array_equal(saved, loaded) and np.array_equal(loaded[lo:hi], init[lo:hi]))
    p = run(2, 3, "device", "fmismatch", ("frozen", "1", "frozen-on-rank", "1"), expect_fail=True)
    err = p.stdout + p.stderr
    check("ranks freezing different groups: every rank fails at build, naming the group",
          p.returncode != 0 and "group 1 is frozen on rank 1 but not frozen on rank 0" in err
          and "failed on rank 1" in err, f"exit {p.returncode}: {err.strip()[-400:]}")
    finish()

results = {}
for world in (1, 2, 4):
    for stage in (0, 1, 2, 3):
        w = run(world, stage, "device", f"w{world}s{stage}")
        if w is None:
            continue
        results[(world, stage)] = w
        check_comm(world, stage)
        if (world, stage) == (2, 3):
            shm_err = last_err  # rank 0 says the ranks share memory
        err = np.abs(w - ref).max() / scale
        check(f"world {world} stage {stage} matches 1-rank stage 0", err <= 1e-6, f"max rel diff {err:.2e}")
# Placement never changes the bits; stages that reduce alike agree bitwise.
for stage in (1, 2, 3):
    for place in ("host", "nvme"):
        w = run(2, stage, place, f"w2s{stage}{place}")
        if w is not None and stage == 3:
            # The device budget holds every group gathered: each group is
            # gathered once a step (forward), kept for backward and for the
            # worker's own fetch after it.
            m = re.search(r"p_gathers (\d+) groups (\d+) steps (\d+)", last_err)
            check(f"world 2 stage 3 on {place}: each group gathered once a step",
                  m is not None and int(m.group(1)) == int(m.group(2)) * int(m.group(3)),
                  m.group(0) if m else last_err.strip()[-200:])
            if place == "nvme":
                # The step's new shard of P (W's bytes) went into the kept
                # copy (Residency::Refresh): a step reads this rank's W, M, V
                # from the disk and nothing of P back.
                m = re.search(r"last_step_read (\d+) wmv (\d+)", last_err)
                check("world 2 stage 3 on nvme: a step reads W, M, V alone, not P's shard back",
                      m is not None and int(m.group(1)) == int(m.group(2)),
                      m.group(0) if m else last_err.strip()[-200:])
        if w is not None and (2, stage) in results:
            check(f"world 2 stage {stage} on {place} == on device, bitwise", np.array_equal(w, results[(2, stage)]))
# bf16 compute, clipping that clips, and G homed on NVMe (the reduction's
# staged-G path) over 2 ranks: placement never changes the bits either
# (the loop above is fp32, G in host memory, no clipping).
for stage in (2, 3):
    opts = ("bf16", "1", "clip", "0.05")
    device = run(2, stage, "device", f"w2s{stage}bf16clip", opts)
    for place, home in (("host", "host"), ("nvme", "nvme"), ("nvme", "host")):
        w = run(2, stage, place, f"w2s{stage}bf16clip{place}{home}", opts + ("grad-home", home))
        if w is not None and device is not None:
            check(f"world 2 stage {stage}, bf16, clipping, on {place} with G on {home} == on device, bitwise",
                  np.array_equal(w.view(np.uint32), device.view(np.uint32)))
# The strict device arena (a GPU's stand-in: what is homed there is copied
# in and out, never addressed): at stage 3 over 2 ranks P's shard homed on
# the device goes into the gathered copy through host staging, which was
# never made (every fetch copied into a null buffer and crashed).
w = run(2, 3, "device", "w2s3strict", env={"STRATA_STRICT_DEVICE": "1"})
check("world 2 stage 3, P homed on the strict device arena == on the host arena, bitwise",
      w is not None and (2, 3) in results and np.array_equal(w, results[(2, 3)]), last_err.strip()[-300:])
# Step units over ranks: a wider model (96: a shard of 6144 elements a
# group at 2 ranks) on NVMe in units of 2048 gives the device run's bits;
# at stage 3 the step still reads W, M, V alone (each unit's new P went into
# the kept copy). Every step wrote behind (strata.write_behind "always";
# the staging pieces hold every unit).
units_bits = {}
for stage in (2, 3):
    wide = run(2, stage, "device", f"u2s{stage}dev", ("dim", "96"))
    units = run(2, stage, "nvme", f"u2s{stage}nvme", ("dim", "96", "sub-group", "2048", "write-behind", "always"))
    if units is not None:
        units_bits[stage] = units
        m = re.search(r"steps (\d+) .*write_behind_steps (\d+)", last_err)
        check(f"world 2 stage {stage} on nvme in units: every step wrote behind",
              m is not None and int(m.group(2)) == int(m.group(1)) > 0, m.group(0) if m else last_err.strip()[-200:])
    if wide is not None and units is not None:
        check(f"world 2 stage {stage} on nvme in step units == on device, bitwise", np.array_equal(wide, units))
    if units is not None and stage == 3:
        m = re.search(r"last_step_read (\d+) wmv (\d+)", last_err)
        check("world 2 stage 3 on nvme in units: a step reads W, M, V alone",
              m is not None and int(m.group(1)) == int(m.group(2)), m.group(0) if m else last_err.strip()[-200:])
    # The default ("auto") writes behind at several ranks where G is off
    # NVMe and P is too (stage 2 here), or P's gathered copies stay from step
    # to step (stage 3 within the device budget: the forward reads no P from
    # NVMe). A lost write is then agreed at the next step (below). At stage 3
    # with a device budget (96 KiB) that does not hold every copy at once,
    # the forward reads P from NVMe: the step writes before it returns, and
    # an info line says why.
    for budget in ("64MiB",) + (("96KiB",) if stage == 3 else ()):
        auto = run(2, stage, "nvme", f"u2s{stage}auto{budget}", ("dim", "96", "sub-group", "2048", "device-budget", budget))
        if auto is None:
            continue
        m = re.search(r"steps (\d+) last_step_read (\d+) wmv (\d+) write_behind_steps (\d+)", last_err)
        kept = budget == "64MiB"
        behind = m is not None and int(m.group(4)) == int(m.group(1)) > 0
        never = m is not None and int(m.group(4)) == 0 and "its gathered copies stay in memory" in last_err \
            and int(m.group(2)) > int(m.group(3))  # (the step read P back: the copies did not stay)
        check(f"world 2 stage {stage} on nvme in units, write_behind auto, device budget {budget}: " +
              ("every step wrote behind" if kept else "no step wrote behind, and it says why"),
              behind if kept else never, m.group(0) if m else last_err.strip()[-200:])
        if wide is not None:
            check(f"world 2 stage {stage} on nvme in units, write_behind auto, device budget {budget} == on device, "
                  "bitwise", np.array_equal(wide, auto))
# Gloo's bulk collectives go through shared memory (every rank is on this
# host); over TCP (strata.comm_shared_memory false) the bits are the same.
if (2, 3) in results:
    w = run(2, 3, "device", "w2s3tcp", ("tcp", "1"))
    tcp_err = last_err
    check("world 2 stage 3 over TCP (comm_shared_memory false): says so, and the same bits as through shared memory",
          w is not None and np.array_equal(w, results[(2, 3)]) and "collectives over TCP" not in tcp_err
          and "through shared memory" not in tcp_err and "through shared memory" in shm_err, tcp_err.strip()[-300:])
if (2, 0) in results and (2, 1) in results:
    check("world 2: stage 1 == stage 0 bitwise (both all-reduce)", np.array_equal(results[(2, 0)], results[(2, 1)]))
if (2, 2) in results and (2, 3) in results:
    check("world 2: stage 3 == stage 2 bitwise (both reduce-scatter)", np.array_equal(results[(2, 2)], results[(2, 3)]))
if (2, 0) in results and (2, 2) in results:
    same = np.array_equal(results[(2, 0)], results[(2, 2)])
    print(f"note: world 2, all-reduce vs reduce-scatter (stage 0 vs 2): {'bitwise equal' if same else 'differ in the last bits (Gloo sums in another order)'}")

# A write that fails behind step 4 on rank 1 (after step 4 returned), with
# write_behind "auto" where P and G are off NVMe: the ranks agree on it at
# the next step (or save, or gathered read), which fails on every rank at
# once, rank 1 naming the lost write and rank 0 naming rank 1; their
# communicator intact, both load step 3's checkpoint in place and train on
# to the clean bits.
def lost_write(stage, place, tag, what, extra, wants, ref=None):
    """Runs it; `extra`: the worker's options (what meets the loss first);
    `wants`: patterns the ranks' output must match; `ref`: the clean run's
    bits (else the units run's). Returns the output."""
    p = run(2, stage, place, tag, ("dim", "96", "sub-group", "2048", "behind-eio-rank-1-at-step", "4", "eio-skip",
                                   "5", "behind-reload", "1") + extra, expect_fail=True)
    err = p.stdout + p.stderr
    wants = list(wants) + [r"rank 0: loaded step 3's checkpoint in place", r"rank 1: loaded step 3's checkpoint in place"]
    missing = [w for w in wants if not re.search(w, err)]
    check(f"world 2 stage {stage}: a write lost behind step 4 on rank 1 {what}; both load step 3's checkpoint in "
          "place and finish", p.returncode == 0 and not missing and "lost write after step" not in err,
          f"exit {p.returncode}, missing {missing}: {err.strip()[-900:]}")
    clean = ref if ref is not None else units_bits.get(stage)
    if p.returncode == 0 and clean is not None:
        check(f"world 2 stage {stage}: {tag}: loaded in place after the lost write == clean, bitwise",
              np.array_equal(np.fromfile(os.path.join(work, tag + ".bin"), dtype=np.float32), clean))
    return err


def step_fails(first=None):
    """Rank 1's call (step 5, or `first` before it) names the lost write,
    rank 0's names rank 1."""
    call = f"{first} before step 5" if first else "step 5"
    return [r"step 5's W, M, V writes failed behind its update",  # rank 1's log, as the write fails
            rf"rank 1: {call} failed as planned: .*write_behind",
            rf"rank 0: {call} failed as planned: .*rank 1 lost a write behind step 5.*load the last checkpoint"]


# Each step prepared before its forward (overlap_step): rank 1 learns of the
# loss there, and its forward and backward go on with rank 0's until the step.
lost_write(2, "nvme", "bh2s2", "fails step 5 on every rank at once", ("prepare", "1"), step_fails())
# With speculation "always" each step is updated early (speculatively)
# during its backward (rank 0's step 5 too, held when the step fails, and
# dropped by the load).
err = lost_write(2, "nvme", "bh2s2spec", "fails step 5 on every rank at once, speculating",
                 ("prepare", "1", "speculation", "always"), step_fails())
spec = re.search(r"speculated_steps (\d+)", err)
check("world 2 stage 2, speculation always: steps speculated", spec is not None and int(spec.group(1)) > 0,
      spec.group(0) if spec else err.strip()[-200:])
# Met first by a checkpoint save: it fails on every rank, writing nothing.
lost_write(2, "nvme", "bh2s2save", "fails the next checkpoint save on every rank at once", ("behind-first", "save"),
           step_fails("save"))
after_loss = os.path.join(work, "bh2s2save", "after-loss")
check("world 2 stage 2: the save refused after the lost write wrote nothing (no partial folder either)",
      not os.path.isdir(after_loss) or not os.listdir(after_loss), str(os.listdir(after_loss)) if os.path.isdir(after_loss) else "")
# Met first by a read of the master weights (a gather over the ranks).
lost_write(2, "nvme", "bh2s2read", "fails the next read_master on every rank at once", ("behind-first", "read"),
           step_fails("read"))
# Then a load of a checkpoint that is not there (refused on every rank,
# nothing changed): the loss stays to be agreed, and step 5 still fails.
lost_write(2, "nvme", "bh2s2bad", "survives a refused load, and step 5 fails on every rank at once",
           ("behind-first", "badload"),
           step_fails() + [r"rank 0: a load of a missing checkpoint failed as planned",
                           r"rank 1: a load of a missing checkpoint failed as planned"])
# Stage 3 with P off NVMe (offload_param none, W, M, V on NVMe): "auto"
# writes behind, and a lost write is agreed at the step as at stage 2 (the
# forward's and backward's gathers go on meanwhile).
err = lost_write(3, "optnvme", "bh2s3opt", "fails step 5 on every rank at once, P off NVMe", ("prepare", "1"),
                 step_fails())
wb = re.search(r"steps (\d+) .*write_behind_steps (\d+)", err)
check("world 2 stage 3, P off NVMe: steps wrote behind by default", wb is not None and int(wb.group(2)) > 0,
      wb.group(0) if wb else err.strip()[-200:])
# Stage 3 with P on NVMe in copies kept from step to step ("auto"): the
# forward reads no P from NVMe, and the loss is agreed at the step as above.
err = lost_write(3, "nvme", "bh2s3p", "fails step 5 on every rank at once, P on NVMe in kept copies",
                 ("prepare", "1"), step_fails())
wb = re.search(r"steps (\d+) .*write_behind_steps (\d+)", err)
check("world 2 stage 3, P on NVMe in kept copies: steps wrote behind by default", wb is not None and int(wb.group(2)) > 0,
      wb.group(0) if wb else err.strip()[-200:])
# A read of a frozen group's P at stage 3 (an all-gather, of P on NVMe) is
# agreed first too: met first by read_master of frozen group 0, it fails on
# every rank at once (not one rank at the NVMe gate, the other in the
# gather); both load in place and finish as the clean run with group 0 frozen.
fz = run(2, 3, "nvme", "fz2s3", ("dim", "96", "sub-group", "2048", "frozen", "0"))
if fz is not None:
    lost_write(3, "nvme", "bh2s3fz", "fails the next read_master of a frozen group on every rank at once",
               ("frozen", "0", "behind-first", "read"), step_fails("read"), ref=fz)
# A read that gathers nothing is not agreed: rank 0 alone asking for a
# frozen group's exp_avg (which it does not keep) is refused at once
# (INVALID), and both ranks finish as the clean run.
fz1 = run(2, 3, "nvme", "fz2s3lone", ("dim", "96", "sub-group", "2048", "frozen", "0", "lone-frozen-read", "1"))
check("world 2 stage 3, writes agreed behind: rank 0 alone reading a frozen group's exp_avg is refused at once",
      fz1 is not None and "lone read of a frozen group's exp_avg refused at once: INVALID" in last_err
      and (fz is None or np.array_equal(fz1, fz)), last_err.strip()[-400:])
# A step whose copies do not all take its new P (at step 4 the 53-element
# group has no gradients, under skip_groups_without_grads: its copy goes,
# and the next forward loads its P from NVMe) waits for its writes before it
# returns: it does not count in write_behind_steps (steps 0-3 do; after step
# 4 the groups' update counts differ, and a step in two cohorts writes
# before it returns), and the bits are the device run's.
gl_opts = ("dim", "96", "sub-group", "2048", "gradless-at-step", "4")
gl_dev = run(2, 3, "device", "gl2s3dev", ("dim", "96", "gradless-at-step", "4"))
gl = run(2, 3, "nvme", "gl2s3", gl_opts)
if gl is not None:
    m = re.search(r"write_behind_steps (\d+)", last_err)
    check("world 2 stage 3, P on NVMe in kept copies, step 4 without one group's gradients: steps 0-3 wrote "
          "behind, step 4 waited for its writes", m is not None and int(m.group(1)) == 4,
          m.group(0) if m else last_err.strip()[-200:])
    if gl_dev is not None:
        check("world 2 stage 3, step 4 without one group's gradients: nvme == device, bitwise",
              np.array_equal(gl, gl_dev))
# The write lost at that step: rank 1 finds it as the step waits, and that
# step (not the next) fails on every rank at once; both load in place.
lost_write(3, "nvme", "bh2s3gl", "at a step whose copies do not all take its P fails that step on every rank at once",
           ("gradless-at-step", "4"),
           [r"step 5's W, M, V writes failed behind its update",
            r"rank 1: step 4 failed as planned: .*write_behind",
            r"rank 0: step 4 failed as planned: .*rank 1 lost a write behind step 5.*load the last checkpoint"],
           ref=gl)
# The same step failing on rank 0 too (its disk fails part-way through
# step 4): the step's agreement fails on every rank, and the ranks still
# agree on the writes at its end, so its first call fails on every rank
# naming the lost write (not rank 0's disk, with a second call to come that
# could only fail), and both load in place.
if gl is not None:
    lost_write(3, "nvme", "bh2s3gleio", "at a step that also fails on rank 0 fails its first call on every rank at once",
               ("gradless-at-step", "4", "eio-rank-0-at-step", "4"),
               [r"step 5's W, M, V writes failed behind its update",
                r"rank 1: step 4 failed as planned, first call: .*write_behind.*load the last checkpoint",
                r"rank 0: step 4 failed as planned, first call: .*rank 1 lost a write behind step 5.*load the last "
                r"checkpoint"],
               ref=gl)
# Where the step does not wait for its writes (stage 2), rank 1 finds the
# loss as the failed step 4 is called again: that call fails on every rank,
# each naming step 4's writes (the engine's step 5, the one pending), not
# the last step applied.
lost_write(2, "nvme", "bh2s2eio", "after a step that failed on rank 0 fails its second call on every rank at once",
           ("eio-rank-0-at-step", "4"),
           [r"step 5's W, M, V writes failed behind its update",
            r"rank 0: step 4 failed as planned, first call: IO",
            r"rank 1: step 4 failed as planned: .*step 5 left its W, M, V writes.*write_behind",
            r"rank 0: step 4 failed as planned: .*rank 1 lost a write behind step 5 .*load the last checkpoint"])
# Stage 3 with P on NVMe where the copies do not stay (a device budget of
# 96 KiB), under "always": the forward's fetches read P from NVMe, so a lost
# write cannot wait for the step. Rank 1 meets it first at prepare_step,
# which fails naming it; the others fail at their next collective, naming
# the barrier rank 1 went to ("lost write after step 5"), not at the
# timeout. Their communicator is closed with it: restarted from step 3's
# checkpoint, they train on to the clean bits.
for stage in (3,):
    opts = ("dim", "96", "sub-group", "2048", "write-behind", "always", "device-budget", "96KiB")
    p = run(2, stage, "nvme", f"bh2s{stage}", opts + ("prepare", "1", "behind-eio-rank-1-at-step", "4", "eio-skip", "5"),
            expect_fail=True)
    err = p.stdout + p.stderr
    check(f"world 2 stage {stage}, copies not kept: a write lost behind step 4 on rank 1 fails its prepare_step, "
          "naming it, and the other rank at once, naming the barrier",
          p.returncode not in (0, 134, 137, 139) and re.search(r"rank 1\] zero_worker: STATE: prepare_step: .*write_behind", err)
          is not None and re.search(r"rank 0\] zero_worker: .*lost write after step 5", err) is not None
          and "Aborted" not in err and "terminate called" not in err, f"exit {p.returncode}: {err.strip()[-600:]}")
    again = run(2, stage, "nvme", f"bh2s{stage}r", opts + ("load", os.path.join(work, f"bh2s{stage}", "behind-ck"),
                                                         "steps", "16"))
    if again is not None and stage in units_bits:
        check(f"world 2 stage {stage}: restarted from step 3's checkpoint == clean, bitwise",
              np.array_equal(again, units_bits[stage]))

# A step that fails part-way on one rank (its disk returns EIO) fails on
# every rank and, called again, finishes bitwise as the clean run.
for stage in (0, 1, 2, 3):
    for skip in (2, 9):
        w = run(2, stage, "nvme", f"eio{stage}_{skip}", ("eio-rank-1-at-step", "4", "eio-skip", str(skip)))
        if w is not None and (2, stage) in results:
            check(f"world 2 stage {stage}: a step failed on rank 1 after {skip} ops and resumed == clean, bitwise",
                  np.array_equal(w, results[(2, stage)]))

# Ranks that diverge (rank 1 skips a group's gradients, or steps with another
# lr) all fail with COMM naming both sides; none crashes, none exits 0 with
# other weights.
for stage in (0, 3):
    for how in ("grads", "lr"):
        p = run(2, stage, "device", f"div{stage}{how}", ("diverge-rank-1-at-step", "3", "diverge", how),
                expect_fail=True)
        err = p.stdout + p.stderr
        check(f"stage {stage}: rank 1 diverging ({how}) fails every rank with COMM naming both sides",
              p.returncode not in (0, 134, 137, 139) and "ranks disagree" in err and "COMM" in err
              and "Aborted" not in err and "terminate called" not in err, f"exit {p.returncode}: {err.strip()[-400:]}")

# 8 ranks, stage 3, state on NVMe.
w8 = run(8, 3, "nvme", "w8s3nvme")
if w8 is not None:
    err = np.abs(w8 - ref).max() / scale
    check("8 ranks stage 3 on NVMe matches 1 rank", err <= 1e-6, f"max rel diff {err:.2e}")

# Checkpoints saved by N ranks load at M (resharding, the 53-element group
# uneven): the gathered weights are exactly those saved, and training on
# from them matches training on at N ranks.
for n, m in ((4, 2), (2, 4), (4, 3)):
    for stage in (1, 3):
        ck = os.path.join(work, f"ck{n}{m}{stage}")
        saved = run(n, stage, "nvme", f"save{n}{m}{stage}", ("steps", "6", "save", ck))
        loaded = run(m, stage, "nvme", f"load{n}{m}{stage}", ("steps", "0", "load", ck))
        if saved is None or loaded is None:
            continue
        check(f"stage {stage}: saved at {n} ranks, loaded at {m}: weights identical", np.array_equal(saved, loaded))
        on_n = run(n, stage, "nvme", f"onn{n}{m}{stage}", ("steps", "4", "load", ck))
        on_m = run(m, stage, "nvme", f"onm{n}{m}{stage}", ("steps", "4", "load", ck))
        if on_n is not None and on_m is not None:
            err = np.abs(on_n - on_m).max() / np.abs(on_n).max()
            check(f"stage {stage}: 4 more steps at {m} ranks == at {n} ranks (moments resharded too)", err <= 1e-6,
                  f"max rel diff {err:.2e}")
# strata.state_format "compact" over ranks: placement never changes the
# bits; a step that fails part-way on one rank's disk resumes to the clean
# bits (P's bf16 half commits with W, M, V); compact checkpoints reshard
# exactly; an fp32 checkpoint loads into compact ranks within its bound.
compact = {}
for stage in (1, 2, 3):
    for place in ("device", "host", "nvme"):
        w = run(2, stage, place, f"c2s{stage}{place}", ("compact", "1"))
        if w is None:
            continue
        if place == "device":
            compact[stage] = w
            b = run(2, stage, "device", f"b2s{stage}", ("bf16", "1"))
            if b is not None:
                err = np.abs(w - b).max() / np.abs(b).max()
                # The update read back from the codes errs by about 20% RMS
                # (kernels/cpu/compact.h): 20 steps at lr 0.01 part the
                # weights by about 5% of the largest (measured 5.0e-02).
                check(f"compact world 2 stage {stage} near fp32 state with bf16 compute", 0 < err <= 0.1,
                      f"max rel diff {err:.2e}")
        elif stage in compact:
            check(f"compact world 2 stage {stage} on {place} == on device, bitwise", np.array_equal(w, compact[stage]))
for stage in (1, 3):
    w = run(2, stage, "nvme", f"ceio{stage}", ("compact", "1", "eio-rank-1-at-step", "4", "eio-skip", "5"))
    if w is not None and stage in compact:
        check(f"compact world 2 stage {stage}: a step failed on rank 1 part-way and resumed == clean, bitwise",
              np.array_equal(w, compact[stage]))
for n, m in ((2, 4), (4, 3)):
    ck = os.path.join(work, f"cck{n}{m}")
    saved = run(n, 3, "nvme", f"csave{n}{m}", ("compact", "1", "steps", "6", "save", ck))
    loaded = run(m, 3, "nvme", f"cload{n}{m}", ("compact", "1", "steps", "0", "load", ck))
    if saved is not None and loaded is not None:
        check(f"compact stage 3: saved at {n} ranks, loaded at {m}: weights identical", np.array_equal(saved, loaded))
ck = os.path.join(work, "ck_f32_to_compact")
saved = run(2, 3, "nvme", "f32save", ("steps", "6", "save", ck))
loaded = run(4, 3, "nvme", "cfromf32", ("compact", "1", "steps", "0", "load", ck))
if saved is not None and loaded is not None:
    err = np.abs(saved - loaded).max() / np.abs(saved).max()
    check("an fp32 checkpoint of 2 ranks loads into 4 compact ranks within the master's bound", 0 < err <= 2**-15,
          f"max rel diff {err:.2e}")

ck = os.path.join(work, "ckbad")
p = run(2, 3, "device", "badtags", ("steps", "1", "save", ck, "tag-by-rank", "1"), expect_fail=True)
check("ranks passing different tags: every rank fails, nothing written",
      p.returncode != 0 and "different folders or tags" in p.stderr and not os.path.exists(os.path.join(ck, "t0"))
      and not os.path.exists(os.path.join(ck, "t1")), p.stderr.strip()[-200:])

# Ranks that find different checkpoints (rank R loads ckmix<R>: steps 1 and
# 2) all refuse, naming it; before, each loaded its shard of another state
# and returned OK.
ck = os.path.join(work, "ckmix")
run(2, 3, "device", "mixsave0", ("steps", "1", "save", ck + "0"))
run(2, 3, "device", "mixsave1", ("steps", "2", "save", ck + "1"))
p = run(2, 3, "device", "mixload", ("steps", "0", "load", ck, "load-by-rank", "1"), expect_fail=True)
check("ranks loading different checkpoints: every rank fails, naming it",
      p.returncode != 0 and p.stderr.count("found another checkpoint") >= 2, p.stderr.strip()[-300:])

# A read of the master that fails on rank 1 alone (its disk, W on NVMe,
# stage 2): every rank fails at once, rank 0 naming rank 1; before, rank 0
# waited in a gather rank 1 never joined, until the timeout.
p = run(2, 2, "nvme", "readeio", ("steps", "1", "timeout", "120", "read-eio-rank-1", "1"), expect_fail=True)
check("a read failing on one rank: every rank fails at once, naming it",
      p.returncode != 0 and "failed on rank 1" in p.stderr and "timed out" not in p.stderr, p.stderr.strip()[-300:])

# A rank dies: the others fail within the timeout, naming the collective.
# The timeout also bounds the rendezvous and the steps before the death:
# generous, for a slow and loaded machine (a hang still fails the bound).
kill_timeout = 10
port = free_port()
procs = []
swap = os.path.join(work, "kill")
start = time.time()
for r in range(3):
    env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="3",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs.append(subprocess.Popen([WORKER, "3", "device", swap, os.path.join(work, "kill.bin"),
                                   "kill-rank-1-at-step", "3", "timeout", str(kill_timeout)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
outs = [p.communicate(timeout=120) for p in procs]
elapsed = time.time() - start
check("the killed rank died by SIGKILL", procs[1].returncode == -9, str(procs[1].returncode))
for r in (0, 2):
    err = outs[r][1]
    named = any(op in err for op in ("all_gather", "reduce_scatter", "all_reduce", "barrier", "broadcast"))
    check(f"rank {r} exits non-zero naming the collective", procs[r].returncode != 0 and named,
          f"exit {procs[r].returncode}: {err.strip()[-300:]}")
check("survivors stop within the timeout", elapsed < kill_timeout + 30, f"{elapsed:.1f} s")

finish()
