"""Activation offload (strata.torch.offload_activations): the tensors autograd
saves go to an engine's activation store (host memory, then NVMe) and come
back in backward; the run is bitwise the run without, standalone and under
offload_module (where views of offloaded parameters stay out: they come back
by fetch), and with an HF Llama within 5e-6 of torch's AdamW while its
activations exceed the store's host memory. Unredeemed stashes are dropped
when autograd lets go of them. Under torch.utils.checkpoint only what
checkpoint keeps from the forward (the segments' inputs) is stashed, never
what its recomputation saves."""
import contextlib
import gc
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import strata  # noqa: E402
import strata.torch as st  # noqa: E402
from tiny_gpt import VOCAB, CheckpointedGpt, TinyGpt, batches  # noqa: E402

LR, WD, STEPS, TOL = 1e-2, 0.01, 4, 5e-6


def act_keys(tmp_path, host="256KiB", nvme="16MiB", window="64KiB"):
    os.makedirs(tmp_path, exist_ok=True)
    return {"activation_host_bytes": host, "activation_nvme_bytes": nvme, "activation_prefetch_bytes": window,
            "nvme_paths": [str(tmp_path)]}


def train_torch(model, opt, acts=None):
    losses = []
    for x, y in batches(STEPS, 8, seed=4):
        if acts is not None:
            with acts:
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        else:
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_standalone_engine_is_bitwise_and_goes_to_nvme(tmp_path):
    ref_model = TinyGpt(seed=2)
    ref = train_torch(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD))
    e = strata.Engine({"strata": act_keys(tmp_path)}, force_no_gpu=True)
    e.add_param(0, "unused", torch.zeros(4))  # an engine has a group
    model = TinyGpt(seed=2)
    got = train_torch(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
                      st.offload_activations(e, threshold=4096))
    assert got == ref
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), n
    s = e.stats()
    assert s["act_nvme_bytes"] > 0 and s["act_host_bytes"] > 0, s
    assert s["act_live_bytes"] == 0 and s["act_redeemed"] > 0, s
    assert s["host"]["peak"] <= s["host"]["budget"] and s["nvme"]["peak"] <= s["nvme"]["budget"]
    e.close()


def module_run(tmp_path, acts, threshold=4096, make=lambda: TinyGpt(seed=5)):
    model = make()
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}},
           "strata": act_keys(tmp_path)}
    off = st.offload_module(model, cfg, force_no_gpu=True)
    losses = train_torch(model, off.optimizer, st.offload_activations(off, threshold) if acts else None)
    out = losses, off.master_parameters(), off.engine.stats()
    off.close()
    return out


def test_under_offload_module_is_bitwise_and_leaves_parameter_views_alone(tmp_path):
    plain = module_run(tmp_path / "a", acts=False)
    got = module_run(tmp_path / "b", acts=True)
    assert got[0] == plain[0]
    for n in plain[1]:
        assert torch.equal(got[1][n], plain[1][n]), n
    s = got[2]
    assert s["act_nvme_bytes"] > 0 and s["act_redeemed"] > 0 and s["act_live_bytes"] == 0, s
    assert plain[2]["act_redeemed"] == 0
    # Views of the parameters are not stashed: every stash is an activation,
    # so no stash is a whole group's size or smaller than the threshold.
    none = module_run(tmp_path / "c", acts=True, threshold=1 << 40)
    assert none[2]["act_redeemed"] == 0 and none[0] == plain[0]


def checkpointed_run(tmp_path, acts, standalone, reentrant):
    """CheckpointedGpt (every block and the head checkpointed) trained STEPS
    steps, its forward under offload_activations when `acts`, the loss
    outside it; under offload_module, or with torch's AdamW and an engine of
    the store's own (`standalone`)."""
    model = CheckpointedGpt(seed=5, reentrant=reentrant, head=True)
    if standalone:
        engine = strata.Engine({"strata": act_keys(tmp_path)}, force_no_gpu=True)
        engine.add_param(0, "unused", torch.zeros(4))
        opt, off = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), None
        target = engine
    else:
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
               "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"}},
               "strata": act_keys(tmp_path)}
        off = st.offload_module(model, cfg, force_no_gpu=True)
        opt, engine, target = off.optimizer, off.engine, off
    # 8 KiB: below every activation a segment saves (16 KiB and more), above
    # the token embedding's table (7.6 KiB), which torch 1.13's embedding saves
    # outside the segments (a plain tensor in the standalone run).
    offload = st.offload_activations(target, threshold=8192) if acts else None
    losses = []
    for x, y in batches(STEPS, 8, seed=4):
        with offload if offload is not None else contextlib.nullcontext():
            logits = model(x)
            if not standalone:  # backward inside too: a reentrant recomputation stashes nothing
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
        if standalone:  # the loss's own saved tensors outside the engine's hooks
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = off.master_parameters() if off else {n: p.detach().clone() for n, p in model.named_parameters()}
    out = losses, params, engine.stats(), model.inputs_bytes
    (off or engine).close()
    return out


# A non-reentrant checkpoint of torch 2.1+ keeps a segment's inputs through
# the saved-tensor hooks around the checkpoint call (torch.utils.checkpoint's
# _checkpoint_hook era); torch 1.13's keeps them in its own closure, where no
# hook sees them. A reentrant one saves them as any autograd Function does.
CHECKPOINT_INPUTS_PASS_HOOKS = hasattr(torch.utils.checkpoint, "_checkpoint_hook")


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpoint", "checkpoint-reentrant"])
@pytest.mark.parametrize("standalone", [False, True], ids=["offload_module", "engine"])
def test_under_checkpoint_only_the_checkpointed_inputs_are_stashed(tmp_path, standalone, reentrant):
    plain = checkpointed_run(tmp_path / "a", False, standalone, reentrant)
    got = checkpointed_run(tmp_path / "b", True, standalone, reentrant)
    assert got[0] == plain[0]
    for n in plain[1]:
        assert torch.equal(got[1][n], plain[1][n]), n
    s, inputs = got[2], got[3]
    assert inputs == STEPS * 3 * 8 * 16 * 32 * 4  # three segments a step, each input (8, 16, 32) float32
    # Had the recomputation's saved tensors, or the first forward's inside a
    # segment, been stashed, this would be several times more.
    moved = reentrant or CHECKPOINT_INPUTS_PASS_HOOKS
    want = inputs if moved else 0
    assert s["act_host_bytes"] == want, (s["act_host_bytes"], want, torch.__version__)
    assert s["act_redeemed"] == (STEPS * 3 if moved else 0), s
    assert s["act_live_bytes"] == 0, s


def test_a_graph_freed_unread_drops_its_stashes(tmp_path):
    e = strata.Engine({"strata": act_keys(tmp_path)}, force_no_gpu=True)
    e.add_param(0, "unused", torch.zeros(4))
    model = TinyGpt(seed=1)
    x, y = batches(1, 8)[0]
    with st.offload_activations(e, threshold=4096):
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    assert e.stats()["act_live_bytes"] > 0
    del loss
    gc.collect()
    assert e.stats()["act_live_bytes"] == 0
    e.close()


def test_refusals_name_the_argument(tmp_path):
    with pytest.raises(strata.Error, match="threshold"):
        st.offload_activations(strata.Engine({}, force_no_gpu=True), threshold=-1)
    with pytest.raises(strata.Error, match="neither an offload_module result nor a strata.Engine"):
        st.offload_activations(object())


def test_hf_llama_within_tol_of_torch_with_activations_past_the_host_arena(tmp_path):
    tf = pytest.importorskip("transformers")
    import oracle

    def make():
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
        return tf.LlamaForCausalLM(cfg)

    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, VOCAB, (4, 128), generator=g) for _ in range(3)]
    ref_model = make()
    opt = oracle.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD)
    for x in data:
        ref_model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model = make()
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}},
           "strata": act_keys(tmp_path, host="512KiB", nvme="64MiB", window="128KiB")}
    off = st.offload_module(model, cfg, force_no_gpu=True)
    with st.offload_activations(off, threshold=16384):
        for x in data:
            model(input_ids=x, labels=x).loss.backward()
            off.optimizer.step()
            off.optimizer.zero_grad()
    s = off.engine.stats()
    got = off.master_parameters()
    off.close()
    assert s["act_nvme_bytes"] > 512 * 1024, s  # more than the arena went through NVMe
    for n, p in ref_model.named_parameters():
        want = p.detach()
        rel = (got[n] - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        assert rel <= TOL, (n, rel)
