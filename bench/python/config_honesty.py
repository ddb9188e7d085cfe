"""Same-config honesty (issue 36 item 4): the keys of Hugging Face's ZeRO-3
template (the ds_config.json its DeepSpeed integration guide starts users
from, with the "auto" values Trainer fills written as numbers) that a
Strata engine made from it names as ignored or left to the trainer. Builds
nothing: the engine's config notes and warnings come at creation (once a
process: run one variant a process). Prints one `config_honesty <variant>
<line>` per note, and `config_honesty <variant> (none)` when there is none.

Usage: config_honesty.py cpu|nvme SWAP_DIR"""
import copy
import os
import sys

import strata


def hf_zero3_template(offload):
    """HF's ZeRO-3 template, Trainer's "auto" values filled in (lr 1e-4, the
    batch and bucket sizes of a small model), offload to `offload`."""
    dev = {"device": offload, "pin_memory": True}
    if offload == "nvme":
        dev["nvme_path"] = sys.argv[2]
    return {
        "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                                     "warmup_num_steps": 100}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": copy.deepcopy(dev), "offload_param": copy.deepcopy(dev),
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": 262144, "stage3_prefetch_bucket_size": 235929,
            "stage3_param_persistence_threshold": 5120, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 2000,
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "wall_clock_breakdown": False,
    }


def notes_of(cfg):
    """The engine's warnings and config notes at creation (its stderr)."""
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        eng = strata.Engine(cfg, force_no_gpu=True)
        eng.close()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(w)
    text = os.read(r, 1 << 20).decode(errors="replace")
    os.close(r)
    return [ln.strip() for ln in text.splitlines()
            if "[strata W]" in ln or ("[strata I]" in ln and "config:" in ln)]


def main():
    offload = sys.argv[1]
    variant = "hf_zero3_" + offload
    lines = notes_of(hf_zero3_template(offload))
    for ln in lines:
        print(f"config_honesty {variant} {ln}", flush=True)
    if not lines:
        print(f"config_honesty {variant} (none)", flush=True)


if __name__ == "__main__":
    main()
