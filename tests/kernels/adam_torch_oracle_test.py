# Adam and AdamW against torch.optim (Debian's python3-torch): 100 steps with
# weight decay 0.01 and an lr that changes every step; param, exp_avg and
# exp_avg_sq must agree element-wise within 1e-6 relative on every CPU path.
# Then the same comparison with a deliberately wrong weight decay must fail,
# which shows the comparison can tell.   usage: <python3> this.py <driver>
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:
    print("skipped: no torch/numpy for %s (%s)" % (sys.executable, e))
    sys.exit(77)

N, STEPS, WD, BETAS, EPS, TOL = 4099, 100, 0.01, (0.9, 0.999), 1e-8, 1e-6


def problem(seed):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(N).astype(np.float32)
    grads = (rng.standard_normal((STEPS, N)) *
             np.exp2(rng.integers(-6, 3, (STEPS, N)))).astype(np.float32)
    lrs = [1e-3 * (1.0 + 0.5 * math.sin(t)) for t in range(1, STEPS + 1)]
    return p0, grads, lrs


def run_torch(mode, p0, grads, lrs):
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    cls = torch.optim.AdamW if mode == 0 else torch.optim.Adam
    opt = cls([p], lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for t in range(STEPS):
        p.grad = torch.from_numpy(grads[t].copy())
        opt.param_groups[0]["lr"] = lrs[t]
        opt.step()
    st = opt.state[p]
    return [p.detach().numpy().copy(), st["exp_avg"].numpy().copy(),
            st["exp_avg_sq"].numpy().copy()]


def run_driver(driver, isa, mode, p0, grads, lrs, wd_override=None):
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in"), os.path.join(d, "out")
        with open(src, "wb") as f:
            f.write(struct.pack("<qqq4d", N, STEPS, mode, BETAS[0], BETAS[1], EPS, WD))
            f.write(p0.tobytes())
            for t in range(STEPS):
                f.write(struct.pack("<d", lrs[t]))
                f.write(grads[t].tobytes())
        cmd = [driver, isa, src, dst] + ([] if wd_override is None else [repr(wd_override)])
        rc = subprocess.run(cmd).returncode
        if rc == 77:
            return None
        if rc != 0:
            raise SystemExit("driver %s failed with %d" % (cmd, rc))
        out = np.fromfile(dst, dtype=np.float32)
        return [out[0:N], out[N:2 * N], out[2 * N:3 * N]]


def max_rel(a, b):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = np.maximum(np.maximum(np.abs(a64), np.abs(b64)), 1e-30)
    return float(np.max(np.abs(a64 - b64) / scale))


def compare(ours, ref):
    return {name: max_rel(o, r) for name, o, r in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref)}


def main():
    driver = sys.argv[1]
    print("torch", torch.__version__)
    failures, tested = 0, 0
    for mode, name in ((0, "AdamW"), (1, "Adam")):
        p0, grads, lrs = problem(seed=mode + 1)
        ref = run_torch(mode, p0, grads, lrs)
        best = None
        for isa in ("scalar", "avx2", "avx512"):
            ours = run_driver(driver, isa, mode, p0, grads, lrs)
            if ours is None:
                print("%s %s: skipped: CPU lacks this path" % (name, isa))
                continue
            best, tested = isa, tested + 1
            errs = compare(ours, ref)
            ok = all(e <= TOL for e in errs.values())
            failures += not ok
            print("%s %s: max relative error %s -> %s" % (
                name, isa, " ".join("%s=%.3g" % kv for kv in errs.items()), "ok" if ok else "FAIL"))
        # A wrong weight decay must be caught by the same comparison.
        wrong = run_driver(driver, best, mode, p0, grads, lrs, wd_override=WD * 1.5)
        errs = compare(wrong, ref)
        caught = any(e > TOL for e in errs.values())
        failures += not caught
        print("%s %s with weight_decay %.3f instead of %.2f: param error %.3g -> %s" % (
            name, best, WD * 1.5, WD, errs["param"],
            "caught (comparison fails, as it must)" if caught else "NOT CAUGHT"))
    if tested == 0:
        print("skipped: no CPU path ran")
        return 77
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
