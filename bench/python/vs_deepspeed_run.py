"""One run of bench/vs_deepspeed.sh: an HF GPT-2 (random weights, fp32)
trained with one ds_config.json, under DeepSpeed ZeRO-3 (deepspeed.initialize)
or Strata (strata.torch.offload_module), offload to "cpu" or "nvme". Prints
one `vs_deepspeed_run ...` line: median step time, tokens/s, peak RSS, disk
bytes read and written per step (this process's /proc/self/io), the swap
folder's size, the final loss; and, for Strata, every config key it named as
ignored or left to the trainer (its "[strata W]" lines and "[strata I] config:" notes). Run under torchrun for several ranks.
"torch" is the floor: torch's AdamW with clip_grad_norm_, nothing offloaded
and nothing communicated (each rank trains its own copy), the step time no
offload engine can beat with torch's forward and backward. STATS=1 prints
Strata's engine stats after the run (a `vs_deepspeed_stats` line).
Usage: vs_deepspeed_run.py deepspeed|strata|torch cpu|nvme SWAP_DIR"""
import json
import os
import resource
import statistics
import sys
import time

import torch

ENGINE, OFFLOAD, SWAP = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS, WARMUP = int(os.environ.get("STEPS", "20")), int(os.environ.get("WARMUP", "2"))
BATCH, SEQ = int(os.environ.get("BATCH", "4")), int(os.environ.get("SEQ", "256"))
LR, WD = 1e-4, 0.01
CLIP = float(os.environ.get("CLIP", "1.0"))  # gradient_clipping (a large one: never clips, speculation commits)
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    # N_EMBD, N_LAYER: the model's size (51M by default; the larger runs of the note use 1600 x 24).
    embd, layers = int(os.environ.get("N_EMBD", "512")), int(os.environ.get("N_LAYER", "8"))
    cfg = GPT2Config(n_embd=embd, n_layer=layers, n_head=embd // 64, n_positions=SEQ, vocab_size=50257,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def ds_config():
    dev = {"device": OFFLOAD}
    # SUB_GROUP: zero_optimization.sub_group_size for both engines (unset: each one's default).
    sub = {"sub_group_size": int(float(os.environ["SUB_GROUP"]))} if os.environ.get("SUB_GROUP") else {}
    if OFFLOAD == "nvme":
        dev["nvme_path"] = SWAP
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": WD}},
            "zero_optimization": dict({"stage": 3, "offload_param": dict(dev), "offload_optimizer": dict(dev)}, **sub),
            "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}}


def strata_config():  # the same ds_config; STRATA_EXTRA (JSON) adds a "strata" section, for experiments
    cfg = ds_config()
    extra = os.environ.get("STRATA_EXTRA")
    if extra:
        cfg["strata"] = json.loads(extra)
    return cfg


def io_bytes():
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out.get("read_bytes", 0), out.get("write_bytes", 0)


def busiest_threads(n=4):
    """This process's n busiest threads over its life: [name, CPU seconds]
    (to tell a run slowed by a thread of its own from one slowed from outside)."""
    tick, out = os.sysconf("SC_CLK_TCK"), []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(") ", 1)
        except OSError:  # a thread that ended
            continue
        fields = rest.split()  # from the state on: utime and stime are the 12th and 13th
        out.append([name, round((int(fields[11]) + int(fields[12])) / tick, 2)])
    return sorted(out, key=lambda x: -x[1])[:n]


def du(path):
    total = 0
    for root, _, files in os.walk(path):
        for n in files:
            try:
                total += os.stat(os.path.join(root, n)).st_blocks * 512
            except OSError:
                pass
    return total


def say(text):
    """One line in one write: the ranks share the output, and print() under
    python -u writes the text and its newline apart (two ranks finishing
    together then run their lines into one)."""
    os.write(1, (text + "\n").encode())


def main():
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    m = model()
    g = torch.Generator().manual_seed(1 + RANK)
    data = [torch.randint(0, 50257, (BATCH, SEQ), generator=g) for _ in range(STEPS + WARMUP)]
    warned, phases = [], []  # phases: (forward, backward, step) seconds, for strata and torch
    if ENGINE == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        eng, _, _, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=ds_config())

        def step(x):
            loss = eng(input_ids=x, labels=x).loss
            eng.backward(loss)
            eng.step()
            return loss.item()
    elif ENGINE == "torch":
        opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)

        def update():
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    else:
        import strata.torch as st
        r, w = os.pipe()  # the engine's warnings go to stderr: catch them at creation
        saved = os.dup(2)
        os.dup2(w, 2)
        try:
            off = st.offload_module(m, strata_config(), force_no_gpu=True)
        finally:
            os.dup2(saved, 2)
            os.close(w)
        # Its warnings, and its notes on config keys it leaves to others or ignores.
        warned = [ln for ln in os.read(r, 1 << 20).decode(errors="replace").splitlines()
                  if "[strata W]" in ln or ("[strata I]" in ln and "config:" in ln)]
        os.close(r)

        def update():
            off.optimizer.step()
            off.optimizer.zero_grad()
    if ENGINE != "deepspeed":  # forward, backward and the update timed apart
        def step(x):
            # Wall seconds, and the calling thread's CPU seconds (what of a
            # phase's wall time this thread computed; the rest it waited,
            # or was preempted by other threads).
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = m(input_ids=x, labels=x).loss
            t1, c1 = time.perf_counter(), time.thread_time()
            loss.backward()
            t2, c2 = time.perf_counter(), time.thread_time()
            update()
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2, c1 - c0, c2 - c1))
            return loss.item()
    times, loss = [], None
    for i, x in enumerate(data):
        if i == WARMUP:
            r0, w0 = io_bytes()
            u0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        loss = step(x)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    r1, w1 = io_bytes()
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    rss = u1.ru_maxrss * 1024
    med = statistics.median(times)
    line = {"engine": ENGINE, "offload": OFFLOAD, "rank": RANK, "world": WORLD, "step_s": round(med, 4),
            "tokens_per_s": round(BATCH * SEQ * WORLD / med, 1), "peak_rss_mib": round(rss / 2**20, 1),
            "disk_read_mib_per_step": round((r1 - r0) / STEPS / 2**20, 1),
            "disk_written_mib_per_step": round((w1 - w0) / STEPS / 2**20, 1),
            "swap_mib": round(du(SWAP) / 2**20, 1) if OFFLOAD == "nvme" else 0, "last_loss": round(loss, 5),
            "params_m": round(sum(p.numel() for p in m.parameters()) / 1e6, 1),
            # The process's page faults (its allocator mapping memory afresh)
            # and the kernel's time for it and all else, per timed step.
            "minor_faults_per_step": round((u1.ru_minflt - u0.ru_minflt) / STEPS),
            "sys_s_per_step": round((u1.ru_stime - u0.ru_stime) / STEPS, 4),
            # Every thread's CPU seconds (user and kernel) per timed step.
            "cpu_s_per_step": round((u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime) / STEPS, 4),
            "busiest_threads": busiest_threads()}
    if phases:  # each phase's median over the timed steps (the update: optimizer step and zero_grad)
        ph = phases[WARMUP:]
        line["forward_s"], line["backward_s"], line["update_s"] = (
            round(statistics.median(p[k] for p in ph), 4) for k in (0, 1, 2))
        line["forward_cpu_s"], line["backward_cpu_s"] = (round(statistics.median(p[k] for p in ph), 4) for k in (3, 4))
    say("vs_deepspeed_run " + json.dumps(line))
    if ENGINE == "strata" and os.environ.get("STATS") == "1":
        # (which run and rank: the ranks' lines interleave in the log)
        say("vs_deepspeed_stats " + json.dumps({"offload": OFFLOAD, "rank": RANK, "world": WORLD,
                                                 **off.engine.stats()}))
    for wl in warned:
        say("vs_deepspeed_ignored " + wl.strip())


if __name__ == "__main__":
    main()
