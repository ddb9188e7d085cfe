"""Peak host memory (RSS) that the optimizer adds to a model's own training
loop, for torch AdamW and for OffloadAdam with its state in host memory and
on NVMe. Each (model, mode) runs in a fresh process:

  base   forward + backward only, no optimizer: the model's own peak
  torch  torch.optim.AdamW
  host   OffloadAdam, offload_optimizer.device "cpu"
  nvme   OffloadAdam, offload_optimizer.device "nvme" (NVME_DIR)

Models: resnet18 (torchvision's; without torchvision, a stand-in built from
torch.nn with resnet18's conv and linear shapes, 11.7M parameters) and a
stack of 18 Linear(4096, 4096) layers (302M parameters; torch AdamW on it
needs about 4.8 GB: parameters, gradients and two moments in fp32).

The increment of a mode is its peak RSS less base's; the ratio is nvme's
increment over torch's. The last line is
  host_memory nvme_over_torch=R
with R the largest ratio over the models (wanted: R <= 0.5).

Each mode's peak is the median of a few processes' (--repeats).

Usage: host_memory.py NVME_DIR [--models resnet18,linear300m] [--steps N] [--repeats K]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch

model_name, mode, swap, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)


def basic_block(cin, cout, stride):
    nn = torch.nn
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

        def forward(self, x):
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(y + (x if self.down is None else self.down(x)))
    return Block()


def resnet18_standin():
    # resnet18's layer shapes: 7x7 stem, four stages of two basic blocks, fc.
    nn = torch.nn
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [basic_block(cin, cout, stride), basic_block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return nn.Sequential(*layers)


if model_name == "resnet18":
    try:
        import torchvision
        model, source = torchvision.models.resnet18(), "torchvision"
    except ImportError:
        model, source = resnet18_standin(), "torch.nn stand-in"
    x = torch.randn(4, 3, 64, 64)
elif model_name == "linear300m":
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(18)])
    source = "18 x Linear(4096, 4096)"
    x = torch.randn(4, 4096)
else:
    raise SystemExit(f"unknown model {model_name}")

opt = None
if mode == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
elif mode in ("host", "nvme"):
    import strata.torch as st
    dev = {"host": {"device": "cpu"}, "nvme": {"device": "nvme", "nvme_path": swap}}[mode]
    opt = st.OffloadAdam(model.parameters(), lr=1e-3, force_no_gpu=True,
                         config={"zero_optimization": {"stage": 1, "offload_optimizer": dev}})
elif mode != "base":
    raise SystemExit(f"unknown mode {mode}")

t0 = time.perf_counter()
for _ in range(steps):
    model(x).square().mean().backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)  # the same in every mode, and in torch 1.13 and 2.x
wall = time.perf_counter() - t0
out = {"model": model_name, "source": source, "mode": mode,
       "params": sum(p.numel() for p in model.parameters()),
       "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "wall_s": wall}
if mode in ("host", "nvme"):
    ges = opt._engines
    s = [ge.engine.stats() for ge in ges]
    out["engine"] = {"groups": sum(ge.engine.num_groups for ge in ges),
                     "host_peak_mib": sum(x["host"]["peak"] for x in s) / 2**20,
                     "device_peak_mib": sum(x["device"]["peak"] for x in s) / 2**20}
print(json.dumps(out))
"""

MODES = ("base", "torch", "host", "nvme")
REPEATS = {"resnet18": 3, "linear300m": 1}  # processes per mode (the median's)


def run(model, mode, swap, steps):
    p = subprocess.run([sys.executable, "-c", CHILD, model, mode, swap, str(steps)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{model} {mode}: exit {p.returncode}\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("nvme_dir")
    ap.add_argument("--models", default="resnet18,linear300m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=None, help="processes per mode (default: 3 for resnet18, 1 for "
                    "linear300m); the median peak counts")
    a = ap.parse_args()
    swap = os.path.join(a.nvme_dir, f"host-memory-{os.getpid()}")
    os.makedirs(swap, exist_ok=True)
    worst = 0.0
    try:
        for model in a.models.split(","):
            # The peaks of a few processes vary by some MiB (the allocators'
            # luck): each mode's is the median of its runs.
            r = {}
            for m in MODES:
                runs = sorted((run(model, m, swap, a.steps) for _ in range(REPEATS[model] if a.repeats is None
                                                                             else a.repeats)),
                              key=lambda x: x["peak_rss_mib"])
                r[m] = runs[len(runs) // 2]
            base = r["base"]["peak_rss_mib"]
            inc = {m: r[m]["peak_rss_mib"] - base for m in MODES}
            print(f"{model} ({r['base']['source']}, {r['base']['params'] / 1e6:.1f}M params): "
                  f"base peak {base:.0f} MiB", flush=True)
            for m in MODES[1:]:
                extra = ""
                if "engine" in r[m]:
                    e = r[m]["engine"]
                    extra = (f"  [{e['groups']} groups; engine host tier peak {e['host_peak_mib']:.0f} MiB, "
                             f"device tier peak {e['device_peak_mib']:.0f} MiB]")
                print(f"  {m:5s} peak {r[m]['peak_rss_mib']:6.0f} MiB  +{inc[m]:6.0f} MiB  "
                      f"{r[m]['wall_s'] / a.steps:.2f} s/step{extra}", flush=True)
            ratio = inc["nvme"] / inc["torch"]
            worst = max(worst, ratio)
            print(f"  {model}: nvme_over_torch={ratio:.2f} host_over_torch={inc['host'] / inc['torch']:.2f}",
                  flush=True)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    print(f"host_memory nvme_over_torch={worst:.2f}")


if __name__ == "__main__":
    main()
