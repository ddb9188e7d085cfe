"""The oracle of the bitwise optimizer tests: torch's own Adam/AdamW code, as
the torch in the process runs it, with one change: its float32 square roots
are correctly rounded (IEEE 754's sqrt), as Strata's kernels round them.

    opt = oracle.AdamW(model.parameters(), lr=..., weight_decay=...)  # a torch.optim.AdamW
    with oracle.correctly_rounded_sqrt():                             # or around any step
        torch_opt.step()

Why not torch's AdamW as it comes: torch's float32 Tensor.sqrt() is not
correctly rounded on every CPU. PyPI's torch 2 takes it from MKL's VML, and on
an AMD EPYC with AVX-512 (torch 2.15) 2613 of 16384 square roots of [0, 0.01)
are one ulp off IEEE's, whatever ATEN_CPU_CAPABILITY (avx2, default) or
MKL_ENABLE_INSTRUCTIONS (AVX2) says; its float64 sqrt too (199 of 16384).
One ulp of sqrt(exp_avg_sq) is one rounding of the update, which training then
spreads. Debian's torch 1.13 rounds as IEEE says.

Why not AdamW(fused=True), whose CPU sqrt is IEEE's: it does not exist before
torch 2.4 (the suite runs on Debian's 1.13 too), and it is not torch's default
arithmetic: on ATen's AVX2 and AVX-512 paths it rounds exp_avg_sq of a
tensor's last numel % 8 elements other than the single-tensor and foreach
AdamW (torch 2.15; its scalar path, ATEN_CPU_CAPABILITY=default, does not).
test_oracle.py checks the rest of the tensor.

So everything here is torch's (the first-moment formula of this torch, weight
decay, bias correction, addcdiv, param groups, state_dict, schedulers) except
Tensor.sqrt and torch._foreach_sqrt of float32 CPU tensors during step():
there numpy's float64 sqrt (the CPU's sqrtpd, IEEE) rounded once to float32,
which for a float32 input is the correctly rounded float32 sqrt (53 >= 2*24+2
bits). Where torch's own sqrt is IEEE's this changes no bit: there the oracle
is torch's AdamW, bitwise. test_oracle.py checks both claims.
"""
import contextlib

import numpy as np
import torch

__all__ = ["AdamW", "correctly_rounded_sqrt", "ieee_sqrt", "torch_sqrt_misrounded"]


def ieee_sqrt(x, ulps=0):
    """sqrt of a float32 CPU tensor, correctly rounded, laid out as x.
    ulps != 0 moves every result that many ulps up (a mutant for the tests
    of the tests: an update one rounding off)."""
    with np.errstate(invalid="ignore"):  # sqrt(-x) is NaN, as torch's
        r = np.sqrt(x.detach().numpy().astype(np.float64)).astype(np.float32)
    for _ in range(abs(ulps)):
        r = np.nextafter(r, np.float32(np.inf if ulps > 0 else -np.inf))
    return torch.empty_like(x).copy_(torch.from_numpy(r))


def torch_sqrt_misrounded(n=1 << 14, seed=7):
    """How many of n float32 square roots of [0, 0.01) torch's Tensor.sqrt()
    rounds other than IEEE in this process (0 where it is IEEE's)."""
    v = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 0.01
    return int(torch.count_nonzero(v.sqrt() != ieee_sqrt(v)))


@contextlib.contextmanager
def correctly_rounded_sqrt(ulps=0):
    """Within: Tensor.sqrt and torch._foreach_sqrt of float32 CPU tensors are
    ieee_sqrt (others: torch's). Yields a list whose [0] counts the tensors
    taken, so that a caller can tell a torch that took its roots some other
    way. Not thread-safe: only for a test's optimizer step."""
    calls = [0]
    tensor_sqrt, foreach_sqrt = torch.Tensor.sqrt, torch._foreach_sqrt

    def one(x):
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return tensor_sqrt(x)
        calls[0] += 1
        return ieee_sqrt(x, ulps)

    def many(xs):
        return [one(x) for x in xs]

    torch.Tensor.sqrt, torch._foreach_sqrt = one, many
    try:
        yield calls
    finally:
        torch.Tensor.sqrt, torch._foreach_sqrt = tensor_sqrt, foreach_sqrt


def _unhooked(step):
    """Optimizer.__init__ wraps a class's step once in its hook runner (marked
    `hooked`); this class's own step is wrapped too, so the base's hooks
    would run twice."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW, single-tensor or foreach as asked, whose float32
    square roots are correctly rounded. `ulps` (tests of the tests only)
    moves every square root that many ulps. fused=True is refused: it has
    its own sqrt and its own arithmetic."""

    def __init__(self, params, *args, ulps=0, **kw):
        if kw.get("fused"):
            raise ValueError("oracle.AdamW: fused=True takes no torch sqrt to correct; use torch.optim.AdamW")
        super().__init__(params, *args, **kw)
        self.ulps = ulps

    def step(self, closure=None):
        loss = None
        if closure is not None:  # the model's own sqrt stays torch's
            with torch.enable_grad():
                loss = closure()
        with correctly_rounded_sqrt(self.ulps) as calls:
            _unhooked(torch.optim.AdamW.step)(self)
        stepped = any(p.grad is not None for g in self.param_groups for p in g["params"])
        if stepped and not calls[0]:
            raise RuntimeError(f"oracle.AdamW: torch {torch.__version__}'s AdamW took no square root through "
                               "Tensor.sqrt or torch._foreach_sqrt: the oracle cannot correct it (tests/python/oracle.py)")
        return loss
