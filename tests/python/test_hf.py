"""Hugging Face as users run it: transformers.Trainer (with its clipping and
an LR schedule), save_pretrained/from_pretrained, PEFT LoRA and accelerate,
with OffloadAdam and offload_module against torch.optim.AdamW on the same
run (with a correctly rounded sqrt: oracle.py). Small Llama and GPT-2 models
from configs with random weights (no downloads), on the CPU. Each test
skips, naming the package, when transformers / peft / accelerate is
missing, unless STRATA_REQUIRE_HF=1."""
import contextlib
import importlib
import os
import sys

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402

KINDS = ("llama", "gpt2")
LR, BETAS, EPS, WD, CLIP = 3e-3, (0.9, 0.999), 1e-8, 0.01, 1.0
STEPS, WARMUP, BATCH, SEQ, VOCAB = 8, 2, 4, 16, 128
TOL = 5e-6  # per tensor: max |got - torch| / max |torch|
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def need(*names):
    """The modules `names`; skips (or, with STRATA_REQUIRE_HF=1, fails) naming
    the first that does not import."""
    mods = []
    for name in names:
        try:
            mods.append(importlib.import_module(name))
        except Exception as e:  # an ImportError, or a package too new for this torch
            msg = f"{name} is not importable ({type(e).__name__}: {e})"
            if os.environ.get("STRATA_REQUIRE_HF") == "1":
                pytest.fail(msg + "; STRATA_REQUIRE_HF=1 requires it")
            pytest.skip(msg)
    return mods if len(mods) > 1 else mods[0]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Trainer and Accelerator share accelerate's process-wide state: each test starts from none."""
    yield
    try:
        from accelerate.state import AcceleratorState
    except Exception:
        return
    AcceleratorState._reset_state(reset_partial_state=True)


# ---- models, data, optimizers -------------------------------------------------

def build(kind, seed=0):
    tf = need("transformers")
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
        return tf.LlamaForCausalLM(cfg)
    # GPT-2 keeps its dropout (0.1): both runs draw the same masks from the same seed.
    cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    return tf.GPT2LMHeadModel(cfg)


def lora(model, kind, seed=0):
    peft = need("peft")
    torch.manual_seed(seed)  # lora_A's initial values
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=LORA_TARGETS[kind], task_type="CAUSAL_LM"))


class Tokens(torch.utils.data.Dataset):
    """STEPS * BATCH random sequences: one epoch of the run."""

    def __init__(self, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        x = self.ids[i]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}


def torch_adamw(model):
    """torch's AdamW with a correctly rounded sqrt (oracle.py): the oracle."""
    return oracle.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def offload_adam(model, path):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}}
    return st.OffloadAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, config=cfg,
                          force_no_gpu=True)


def offload(model, path):
    path.mkdir(parents=True, exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": str(path)}
    cfg = {"zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": dict(nvme)},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                     "weight_decay": WD}}}
    return st.offload_module(model, cfg, force_no_gpu=True)


def train(model, opt, out, callbacks=()):
    """transformers.Trainer over Tokens with `opt` and a linear warmup
    schedule, clipping at CLIP (Trainer's default max_grad_norm). Returns the
    Trainer and its logged gradient norms. `opt` None: the Trainer makes its
    own (torch's AdamW, linear schedule)."""
    tf = need("transformers")
    optimizers = (None, None) if opt is None else (opt, tf.get_linear_schedule_with_warmup(opt, WARMUP, STEPS))
    args = tf.TrainingArguments(output_dir=str(out), use_cpu=True, per_device_train_batch_size=BATCH,
                                max_steps=STEPS, max_grad_norm=CLIP, learning_rate=LR, weight_decay=WD,
                                logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0,
                                dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True)
    trainer = tf.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=optimizers,
                         callbacks=list(callbacks))
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == STEPS, trainer.state.log_history
    return trainer, norms


# ---- comparisons ----------------------------------------------------------------

def weights(model):
    """{name: a copy of the parameter} (tied ones once, as named_parameters gives them)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_diffs(got, ref):
    return {n: ((got[n].float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
            for n, r in ref.items()}


def assert_bitwise(got, ref, what):
    missing = sorted(set(ref) - set(got))
    assert not missing, f"{what}: no {missing}"
    differ = [n for n in ref if not torch.equal(got[n], ref[n])]
    rel = rel_diffs(got, ref)
    worst = max(rel, key=rel.get)
    assert not differ, (f"{what}: {len(differ)} of {len(ref)} tensors differ from torch's bits; worst "
                        f"{worst} at {rel[worst]:.3g} relative; differing: {differ[:6]}")


def key_rows(name):
    """GPT-2's fused query/key/value bias (c_attn's): the slice of the key
    rows, else None. A key bias shifts every score of a query alike, so its
    gradient is zero but for rounding noise, which Adam turns into updates
    of noise: two fp32 runs that round differently agree there on nothing
    but that the values stay noise. (A LoRA B on c_attn is not such: its
    key rows get a real gradient, u_j = A x_j varies over the tokens;
    measured bitwise equal to torch's at the first step.)"""
    if name.endswith("c_attn.bias"):
        return slice(64, 128)
    return None


def rel_diffs_fused(got, ref, noise):
    """rel_diffs, with the key rows of key_rows() tensors left out of the
    difference and checked instead to stay below `noise` of the tensor's
    largest value in both runs."""
    out, not_noise = {}, {}
    for n, r in ref.items():
        g, r = got[n].float(), r.float()
        scale = r.abs().max().clamp_min(1e-30)
        k = key_rows(n)
        if k is not None:
            rows = torch.ones(r.shape[0], dtype=torch.bool)
            rows[k] = False
            worst = max(g[k].abs().max(), r[k].abs().max()) / scale
            if not worst <= noise:
                not_noise[n] = f"{worst.item():.3g}"
            g, r = g[rows], r[rows]
        out[n] = ((g - r).abs().max() / scale).item()
    return out, not_noise


def assert_close(got, ref, what, tol=TOL, noise=1e-3):
    missing = sorted(set(ref) - set(got))
    assert not missing, f"{what}: no {missing}"
    rel, not_noise = rel_diffs_fused(got, ref, noise)
    assert not not_noise, f"{what}: key rows beyond noise ({noise} of the tensor's largest value): {not_noise}"
    bad = {n: f"{r:.3g}" for n, r in rel.items() if not r <= tol}
    assert not bad, f"{what}: {len(bad)} of {len(ref)} tensors beyond {tol} relative: {dict(list(bad.items())[:6])}"


def assert_trained(final, initial, what):
    """The run moved the weights (a comparison of two runs that did nothing proves nothing)."""
    moved = [n for n in initial if not torch.equal(final[n], initial[n])]
    assert len(moved) >= len(initial) // 2, f"{what}: only {len(moved)} of {len(initial)} tensors moved"


def is_placeholder(p):
    """An offloaded parameter between uses: strata.torch.is_fetched says no
    (it is True for a parameter not under offload_module), and its storage
    holds at most one element, read with torch functions off so that the
    look itself fetches nothing."""
    if getattr(st, "is_fetched", None) is not None and st.is_fetched(p):
        return False
    off = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    with off() if off is not None else contextlib.nullcontext():
        t = p.data
        storage = t.untyped_storage().nbytes() if hasattr(t, "untyped_storage") else t.storage().nbytes()
        return storage <= t.element_size()


def reference(kind, tmp_path, ckpt=False, adapters=False):
    model = build(kind)
    if adapters:
        model = lora(model, kind)
    if ckpt:
        model.gradient_checkpointing_enable()
    initial = weights(model)
    _, norms = train(model, torch_adamw(model), tmp_path / "torch-run")
    final = weights(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert_trained({n: final[n] for n in trainable}, {n: initial[n] for n in trainable}, f"{kind} torch run")
    return initial, final, norms


# ---- 1. Trainer + OffloadAdam: bitwise torch AdamW --------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_trainer_offload_adam_equals_adamw_bitwise(kind, tmp_path):
    initial, ref, ref_norms = reference(kind, tmp_path)
    model = build(kind)
    assert_bitwise(weights(model), initial, "the initial weights")
    opt = offload_adam(model, tmp_path / "swap")
    _, norms = train(model, opt, tmp_path / "strata-run")
    # Trainer's clip goes through accelerate to torch.nn.utils.clip_grad_norm_,
    # which strata.torch sends to the OffloadAdam: its norms are the engine's.
    assert norms == pytest.approx(ref_norms, rel=1e-5), (norms, ref_norms)
    assert any(n > CLIP for n in ref_norms), f"the run must clip: {ref_norms}"
    assert_bitwise(weights(model), ref, f"{kind}: Trainer + OffloadAdam")
    assert norms == ref_norms, "bitwise weights, so bitwise norms (torch's own clip_grad_norm_ on one rank)"
    masters = dict(zip((n for n, _ in model.named_parameters()), opt._engines[0].read_masters()))
    assert_bitwise(masters, ref, f"{kind}: OffloadAdam's masters")


# ---- 2. Trainer + offload_module: torch AdamW within TOL ---------------------------

@pytest.mark.parametrize("ckpt", (False, True), ids=("plain", "checkpointing"))
@pytest.mark.parametrize("kind", KINDS)
def test_trainer_offload_module_equals_adamw(kind, ckpt, tmp_path):
    _, ref, ref_norms = reference(kind, tmp_path, ckpt=ckpt)
    model = build(kind)
    if ckpt:
        model.gradient_checkpointing_enable()
    off = offload(model, tmp_path / "swap")
    _, norms = train(model, off.optimizer, tmp_path / "strata-run")
    assert norms == pytest.approx(ref_norms, rel=1e-5), (norms, ref_norms)
    assert_close(off.master_parameters(), ref, f"{kind}: Trainer + offload_module")
    real = [n for n, p in model.named_parameters() if not is_placeholder(p)]
    assert not real, f"after train() these are still real tensors, not placeholders: {real[:6]}"
    off.close()


def test_trainer_with_its_own_optimizer_under_offload_module_is_not_silent(tmp_path):
    """Trainer without optimizers= makes torch's AdamW over the model's
    parameters, whose gradients go to the engine, never to .grad: that
    optimizer would step nothing. Training must then either still happen or
    fail naming the cause, never finish with the weights unchanged."""
    model = build("llama")
    off = offload(model, tmp_path / "swap")
    before = off.master_parameters()
    try:
        train(model, None, tmp_path / "run")
    except strata.Error as e:
        assert "optimizer" in str(e), e
        off.close()
        return
    after = off.master_parameters()
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    off.close()
    assert moved, ("Trainer's own optimizer trained nothing and nothing said so: the gradients went to the engine, "
                   "which no step consumed")


# ---- 3. save_pretrained / from_pretrained -----------------------------------------

def assert_reloads(tf, directory, expected, what, like=None):
    """from_pretrained(directory) holds `expected` bitwise (and is a model of
    `like`'s type, when given)."""
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(directory))
    if like is not None:
        assert type(loaded) is type(like)
    assert_bitwise(dict(loaded.state_dict().items()), expected, what)


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_after_offload_module(kind, tmp_path):
    tf = need("transformers")
    model = build(kind)
    initial = weights(model)
    off = offload(model, tmp_path / "swap")
    trainer, _ = train(model, off.optimizer, tmp_path / "run")
    masters = off.master_parameters()
    assert_trained(masters, initial, f"{kind} offload_module run")
    trainer.save_model(str(tmp_path / "by-trainer"))
    model.save_pretrained(str(tmp_path / "by-model"))
    for d in ("by-trainer", "by-model"):
        assert_reloads(tf, tmp_path / d, masters, f"{kind}: from_pretrained({d})", like=model)
    off.close()


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_after_offload_adam(kind, tmp_path):
    tf = need("transformers")
    model = build(kind)
    initial = weights(model)
    opt = offload_adam(model, tmp_path / "swap")
    train(model, opt, tmp_path / "run")
    final = weights(model)
    assert_trained(final, initial, f"{kind} OffloadAdam run")
    masters = dict(zip((n for n, _ in model.named_parameters()), opt._engines[0].read_masters()))
    assert_bitwise(final, masters, f"{kind}: the parameters are the masters")
    model.save_pretrained(str(tmp_path / "saved"))
    assert_reloads(tf, tmp_path / "saved", final, f"{kind}: from_pretrained after OffloadAdam")


# ---- 4. PEFT LoRA -------------------------------------------------------------------

def placeholder_watch(frozen):
    """A TrainerCallback that records, at each step's end, whether every
    frozen parameter is a placeholder."""
    tf = need("transformers")

    class Watch(tf.TrainerCallback):
        seen = []

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append(all(is_placeholder(p) for p in frozen))

    return Watch()


@pytest.mark.parametrize("kind", KINDS)
def test_lora_offload_module(kind, tmp_path):
    need("transformers", "peft")
    _, ref, _ = reference(kind, tmp_path, adapters=True)
    model = lora(build(kind), kind)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    frozen_names = [n for n, p in model.named_parameters() if not p.requires_grad]
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and adapters and all("lora_" in n for n in adapters), sorted(adapters)[:4]
    off = offload(model, tmp_path / "swap")
    # The base weights live in the tiers, not in host tensors of their own.
    total = sum(off.engine.group_numel(g) for g in range(off.engine.num_groups))
    everything = sum(p.numel() for p in model.parameters())
    assert total == everything, (f"the engine holds {total} elements of the model's {everything} "
                                 f"({sum(p.numel() for p in frozen)} frozen)")
    assert all(is_placeholder(p) for p in frozen), "frozen base weights are placeholders"
    watch = placeholder_watch(frozen)
    train(model, off.optimizer, tmp_path / "strata-run", callbacks=[watch])
    assert watch.seen and all(watch.seen), f"frozen weights were real tensors between steps: {watch.seen}"
    assert all(not p.requires_grad for p in frozen), "the base stays frozen"
    after = model.state_dict()
    assert_bitwise({n: after[n] for n in frozen_names}, {n: before[n] for n in frozen_names},
                   f"{kind}: frozen base weights after LoRA training under offload_module")
    assert_close({n: after[n] for n in adapters}, {n: ref[n] for n in adapters},
                 f"{kind}: LoRA adapters under offload_module")
    off.close()


@pytest.mark.parametrize("kind", KINDS)
def test_lora_offload_adam_over_all_parameters(kind, tmp_path):
    need("transformers", "peft")
    _, ref, _ = reference(kind, tmp_path, adapters=True)
    model = lora(build(kind), kind)
    before = weights(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    # model.parameters(), the frozen base included: what most scripts pass.
    opt = offload_adam(model, tmp_path / "swap")
    train(model, opt, tmp_path / "strata-run")
    after = weights(model)
    assert_bitwise({n: after[n] for n in frozen}, {n: before[n] for n in frozen},
                   f"{kind}: frozen base weights after LoRA training with OffloadAdam")
    assert_bitwise({n: after[n] for n in after if n not in frozen}, {n: ref[n] for n in ref if n not in frozen},
                   f"{kind}: LoRA adapters with OffloadAdam")


# ---- 5. accelerate --------------------------------------------------------------------

def accelerate_run(kind, make_opt):
    """A plain accelerate loop: prepare(model, optimizer, dataloader, scheduler),
    backward, clip, step. Returns the model's weights and the norms."""
    accelerate, tf = need("accelerate", "transformers")
    acc = accelerate.Accelerator(cpu=True)
    model = build(kind)
    opt, keep = make_opt(model)
    sched = tf.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    torch.manual_seed(2)  # GPT-2's dropout masks
    norms = []
    for batch in loader:
        loss = model(**batch).loss
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
    AcceleratorState = importlib.import_module("accelerate.state").AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    model = acc.unwrap_model(model)
    return model, keep, norms


@pytest.mark.parametrize("kind", KINDS)
def test_accelerate_prepare_offload_adam(kind, tmp_path):
    ref_model, _, ref_norms = accelerate_run(kind, lambda m: (torch_adamw(m), None))
    ref = weights(ref_model)
    assert_trained(ref, weights(build(kind)), f"{kind} accelerate torch run")
    model, opt, norms = accelerate_run(kind, lambda m: (lambda o: (o, o))(offload_adam(m, tmp_path / "swap")))
    assert norms == pytest.approx(ref_norms, rel=1e-5), (norms, ref_norms)
    assert_bitwise(weights(model), ref, f"{kind}: accelerate + OffloadAdam")


@pytest.mark.parametrize("kind", KINDS)
def test_accelerate_prepare_offload_module(kind, tmp_path):
    ref_model, _, ref_norms = accelerate_run(kind, lambda m: (torch_adamw(m), None))
    ref = weights(ref_model)

    def make(m):
        off = offload(m, tmp_path / "swap")
        return off.optimizer, off
    model, off, norms = accelerate_run(kind, make)
    assert norms == pytest.approx(ref_norms, rel=1e-5), (norms, ref_norms)
    assert_close(off.master_parameters(), ref, f"{kind}: accelerate + offload_module")
    off.close()
