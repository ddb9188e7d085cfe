"""The Python GPU tests (gpu_cases.py): strata.torch on CUDA against torch
on CUDA. Exits 77 ("skipped: ...") without a CUDA device, as every GPU test
does. STRATA_TEST_DEVICE=cpu runs the same cases on the CPU (a rehearsal)."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
try:
    import torch
except ImportError as e:
    print(f"skipped: torch is not importable ({e})")
    sys.exit(77)
dev = os.environ.get("STRATA_TEST_DEVICE", "cuda")
if dev == "cuda" and not torch.cuda.is_available():
    print("skipped: no CUDA device (torch.cuda.is_available() is False); STRATA_TEST_DEVICE=cpu rehearses these "
          "cases on the CPU")
    sys.exit(77)
import pytest  # noqa: E402

print(f"run_gpu.py: torch {torch.__version__} on {dev}"
      + (f" ({torch.cuda.get_device_name(0)})" if dev == "cuda" else ""), flush=True)
sys.exit(pytest.main(["-q", "-s", "-p", "no:cacheprovider", os.path.join(here, "gpu_cases.py"), *sys.argv[1:]]))
