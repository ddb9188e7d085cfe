# torch.optim.AdamW over one n-element fp32 parameter at its fastest on the
# CPU: fused=True where this torch has it there (2.4 and later), else
# foreach=True (torch 1.13's best); the ready line says which. Timed on
# request: adam_bench writes a step count per line, we answer seconds per step.
# Run by adam_bench as a co-process so that torch and the kernels alternate in
# the same run (memory bandwidth here swings from minute to minute).
import sys
import time

import torch


def main():
    n, threads = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.empty(n).uniform_(-1, 1))
    p.grad = torch.empty(n).uniform_(-1e-3, 1e-3)
    variant = "fused"
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
        opt.step()  # allocates and touches the state (and raises where fused has no CPU kernel)
    except (RuntimeError, TypeError, ValueError):
        variant = "foreach"
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=True)
        opt.step()
    print("ready torch=%s threads=%d variant=%s" % (torch.__version__, torch.get_num_threads(), variant), flush=True)
    for line in sys.stdin:
        steps = int(line)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        print("%.9f" % ((time.perf_counter() - t0) / steps), flush=True)


if __name__ == "__main__":
    main()
