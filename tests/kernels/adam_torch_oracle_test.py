# Adam and AdamW against torch.optim (Debian's python3-torch, or any torch
# given as the interpreter): 100 steps with weight decay 0.01 and an lr that
# changes every step; param, exp_avg and exp_avg_sq must be bitwise torch's on
# every CPU path, with the first-moment formula of this torch
# (moment_update: "mul_add" for torch 1.x's exp_avg.mul_(b1).add_(g, alpha=1-b1),
# "lerp" for torch >= 2.0's exp_avg.lerp_(g, 1-b1)). torch's single-tensor and
# foreach implementations both. betas (0.3, 0.99) take lerp's other weight
# branch (1 - beta1 >= 0.5). torch runs with its float32 sqrt correctly
# rounded (tests/python/oracle.py: PyPI torch's is not on every CPU, e.g. 2613
# of 16384 one ulp off on an AMD EPYC; our kernels' sqrt is IEEE's); where
# this torch's own sqrt is IEEE's, plain torch must be that bitwise too. Then
# three comparisons that must fail, to show the comparison can tell: the
# other moment_update, a wrong weight decay, and torch with every sqrt one ulp
# up (an update one rounding off).
#   usage: <python3> this.py <driver>
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import oracle  # noqa: E402

N, STEPS, WD, EPS = 4099, 100, 0.01, 1e-8
TORCH_MAJOR = int(torch.__version__.split(".")[0])
MOMENT = "lerp" if TORCH_MAJOR >= 2 else "mul_add"
OTHER_MOMENT = "mul_add" if MOMENT == "lerp" else "lerp"


def problem(seed):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(N).astype(np.float32)
    grads = (rng.standard_normal((STEPS, N)) *
             np.exp2(rng.integers(-6, 3, (STEPS, N)))).astype(np.float32)
    lrs = [1e-3 * (1.0 + 0.5 * math.sin(t)) for t in range(1, STEPS + 1)]
    return p0, grads, lrs


def run_torch(mode, betas, foreach, p0, grads, lrs, correct=True, ulps=0):
    """torch's Adam/AdamW; correct: with its float32 sqrt correctly rounded,
    and then `ulps` ulps up."""
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    cls = torch.optim.AdamW if mode == 0 else torch.optim.Adam
    opt = cls([p], lr=lrs[0], betas=betas, eps=EPS, weight_decay=WD, foreach=foreach)
    for t in range(STEPS):
        p.grad = torch.from_numpy(grads[t].copy())
        opt.param_groups[0]["lr"] = lrs[t]
        if not correct:
            opt.step()
            continue
        with oracle.correctly_rounded_sqrt(ulps) as calls:
            opt.step()
        if calls[0] != 1:
            raise SystemExit("torch %s took %d square roots through Tensor.sqrt/_foreach_sqrt, not 1: "
                             "oracle.py cannot correct them" % (torch.__version__, calls[0]))
    st = opt.state[p]
    return [p.detach().numpy().copy(), st["exp_avg"].numpy().copy(),
            st["exp_avg_sq"].numpy().copy()]


def run_driver(driver, isa, moment, mode, betas, p0, grads, lrs, wd_override=None):
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in"), os.path.join(d, "out")
        with open(src, "wb") as f:
            f.write(struct.pack("<qqq4d", N, STEPS, mode, betas[0], betas[1], EPS, WD))
            f.write(p0.tobytes())
            for t in range(STEPS):
                f.write(struct.pack("<d", lrs[t]))
                f.write(grads[t].tobytes())
        cmd = [driver, isa, moment, src, dst] + ([] if wd_override is None else [repr(wd_override)])
        rc = subprocess.run(cmd).returncode
        if rc == 77:
            return None
        if rc != 0:
            raise SystemExit("driver %s failed with %d" % (cmd, rc))
        out = np.fromfile(dst, dtype=np.float32)
        return [out[0:N], out[N:2 * N], out[2 * N:3 * N]]


def differing(a, b):
    """Elements whose bits differ (NaN equals NaN)."""
    same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    return int(np.count_nonzero(~same))


def max_rel(a, b):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = np.maximum(np.maximum(np.abs(a64), np.abs(b64)), 1e-30)
    return float(np.max(np.abs(a64 - b64) / scale))


def compare(ours, ref):
    names = ("param", "exp_avg", "exp_avg_sq")
    return ({n: differing(o, r) for n, o, r in zip(names, ours, ref)},
            {n: max_rel(o, r) for n, o, r in zip(names, ours, ref)})


def text(diff, rel):
    return " ".join("%s=%d/%d (max rel %.3g)" % (k, diff[k], N, rel[k]) for k in diff)


def must_differ(label, what, ours, ref):
    """A comparison that must fail; returns 1 when it did not."""
    diff, rel = compare(ours, ref)
    caught = any(diff.values())
    print("%s %s: %s -> %s" % (label, what, text(diff, rel),
                               "caught (comparison fails, as it must)" if caught else "NOT CAUGHT"))
    return not caught


def main():
    driver = sys.argv[1]
    print("torch %s: its first moment is %s" % (torch.__version__, MOMENT))
    off = oracle.torch_sqrt_misrounded()
    print("torch's own float32 sqrt: %s" % ("IEEE's" if not off else
          "%d of 16384 results not correctly rounded (torch's own Adam is then not compared bitwise)" % off))
    failures, tested = 0, 0
    cases = ((0, "AdamW", (0.9, 0.999)), (1, "Adam", (0.9, 0.999)), (0, "AdamW", (0.3, 0.99)))
    for k, (mode, name, betas) in enumerate(cases):
        p0, grads, lrs = problem(seed=k + 1)
        label = "%s betas=%s" % (name, betas)
        best = None
        for foreach in (False, True):
            ref = run_torch(mode, betas, foreach, p0, grads, lrs)
            plain = run_torch(mode, betas, foreach, p0, grads, lrs, correct=False)
            diff, rel = compare(plain, ref)
            same = not any(diff.values())
            failures += not same and not off
            print("%s foreach=%s: torch's own sqrt against a correctly rounded one: %s -> %s" % (
                label, foreach, text(diff, rel), "bitwise" if same else "FAIL" if not off else
                "differs (its sqrt is not IEEE's here)"))
            for isa in ("scalar", "avx2", "avx512"):
                ours = run_driver(driver, isa, MOMENT, mode, betas, p0, grads, lrs)
                if ours is None:
                    print("%s %s: skipped: CPU lacks this path" % (label, isa))
                    continue
                best, tested = isa, tested + 1
                diff, rel = compare(ours, ref)
                bitwise = not any(diff.values())
                failures += not bitwise
                print("%s foreach=%s %s moment_update=%s: differing elements %s -> %s" % (
                    label, foreach, isa, MOMENT, text(diff, rel), "bitwise" if bitwise else "FAIL"))
        if best is None:
            continue
        ref = run_torch(mode, betas, False, p0, grads, lrs)
        # The other formula must not pass for this torch's.
        failures += must_differ(label, "%s moment_update=%s (not this torch's)" % (best, OTHER_MOMENT),
                                run_driver(driver, best, OTHER_MOMENT, mode, betas, p0, grads, lrs), ref)
        # A wrong weight decay must be caught by the same comparison.
        failures += must_differ(label, "%s with weight_decay %.3f instead of %.2f" % (best, WD * 1.5, WD),
                                run_driver(driver, best, MOMENT, mode, betas, p0, grads, lrs, wd_override=WD * 1.5),
                                ref)
        # So must an update one rounding off: torch with every sqrt one ulp up.
        failures += must_differ(label, "%s against torch with sqrt one ulp up" % best,
                                run_driver(driver, best, MOMENT, mode, betas, p0, grads, lrs),
                                run_torch(mode, betas, False, p0, grads, lrs, ulps=1))
    if tested == 0:
        print("skipped: no CPU path ran")
        return 77
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
