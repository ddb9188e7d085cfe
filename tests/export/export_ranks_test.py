#!/usr/bin/python3
"""strata-export on checkpoints that the engine saved from several ranks
(strata-launch + tests/engine's zero_worker: stage 0 writes one file, stages
1-3 one file per rank, a 53-element group uneven over the ranks): the f32
and bf16 exports, read back by hand (check_safetensors.py), equal the
gathered master weights rank 0 wrote after the save.
Usage: export_ranks_test.py STRATA_LAUNCH ZERO_WORKER STRATA_EXPORT CHECK_SAFETENSORS_PY"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

LAUNCH, WORKER, EXPORT, CHECK = sys.argv[1:5]
try:
    import numpy  # noqa: F401  (check_safetensors.py needs it)
except ImportError:
    print("skipped: /usr/bin/python3 with numpy (Debian's python3-numpy) is not available")
    sys.exit(77)
work = tempfile.mkdtemp(prefix="strata-export-ranks-", dir="/var/tmp")
failures = []


def case(nproc, stage):
    tag = f"n{nproc}s{stage}"
    swap, ck, out = (os.path.join(work, tag + x) for x in ("-swap", "-ckpt", "-master.bin"))
    os.makedirs(swap)
    # --master-port 0: strata-launch picks a free port outside the kernel's
    # ephemeral range (a port from bind(0) could be some connection's local
    # port by the time rank 0 listens: tests/free_ports.py).
    p = subprocess.run([LAUNCH, "--nproc", str(nproc), "--master-port", "0", "--", WORKER, str(stage),
                        "nvme", swap, out, "steps", "2", "save", ck], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        failures.append(f"{tag}: training exit {p.returncode}\n{p.stdout}\n{p.stderr}")
        return
    m = json.load(open(os.path.join(ck, "t", "manifest.json")))
    want_files = 1 if stage == 0 else nproc
    if len(m["files"]) != want_files:
        failures.append(f"{tag}: {len(m['files'])} data files, expected {want_files}")
    # The reference: rank 0's gathered master weights, group after group (no padding).
    ref, base = [], 0
    for g in m["groups"]:
        ref += [{"name": t["name"], "numel": t["numel"], "at": base + t["offset"]} for t in g["tensors"]]
        base += g["numel"]
    ref_json = os.path.join(work, tag + "-ref.json")
    json.dump(ref, open(ref_json, "w"))
    for dtype in ("f32", "bf16"):
        st = os.path.join(work, f"{tag}.{dtype}.safetensors")
        e = subprocess.run([EXPORT, ck, st, "--dtype", dtype], capture_output=True, text=True)
        if e.returncode != 0:
            failures.append(f"{tag} {dtype}: export exit {e.returncode}: {e.stderr}")
            continue
        c = subprocess.run(["/usr/bin/python3", CHECK, st, dtype, ref_json, out], capture_output=True, text=True)
        print(("ok: " if c.returncode == 0 else "FAIL: ") + f"{tag} {dtype}: {c.stdout.strip()}")
        if c.returncode != 0:
            failures.append(f"{tag} {dtype}: {c.stdout}{c.stderr}")


for nproc, stage in ((2, 0), (2, 1), (3, 3), (4, 2)):
    case(nproc, stage)
shutil.rmtree(work, ignore_errors=True)
if failures:
    print("\n".join(failures))
    sys.exit(1)
