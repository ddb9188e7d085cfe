"""offload_module with a device budget well below the model: groups are
evicted and fetched again (autograd's saved views of parameters come back
through the unpack hook), and the run is bitwise the run with the whole
model resident: placement never changes a bit. The budget holds.

With every block under torch.utils.checkpoint (non-reentrant and
reentrant) it trains under a budget below one checkpointed block's groups:
the recomputation inside backward saves views of the parameters as places
(fetched again when backward uses them), so no group stays pinned for the
segment's backward (issue 34). So under torch's save_on_cpu hooks.

ctest also runs this file under STRATA_STRICT_DEVICE=1 (label strict): there
a released group's memory is filled with NaN at once and copies lag, so a
backward that read a released buffer (as the CUDA path did when pack missed
every view, issue 32) cannot pass."""
import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import strata.torch as st  # noqa: E402
from tiny_gpt import VOCAB, CheckpointedGpt, TinyGpt, batches  # noqa: E402

BUDGET = 48 * 1024  # bytes: about 0.4 of TinyGpt's fp32 parameters
# Checkpointed, a block's backward needs its recomputation (each group in
# turn) while the tied embedding and the group of the op that asked for it
# are fetched: 8 + 24 + 24 KiB on the device (the engine rounds a group up).
# Half the parameters; and below one block's groups on the device (88 KiB),
# which the recomputation pinned until their gradients before issue 34. The
# strict arena hands a group the block freed last, whatever its size (the
# embedding gets a 24 KiB one), so there it takes 16 KiB more.
STRICT = os.environ.get("STRATA_STRICT_DEVICE") == "1"
BUDGET_CHECKPOINTED = (72 if STRICT else 56) * 1024


class SavedOnCpu(TinyGpt):
    """Its forward under torch's save_on_cpu hooks: the blocks' forwards put
    strata's own on top of them (views of parameters are places, the rest
    goes to save_on_cpu), so no group is pinned either."""

    def forward(self, idx):
        with torch.autograd.graph.save_on_cpu():
            return super().forward(idx)


CHECKPOINTS = {None: None, "checkpoint": lambda: CheckpointedGpt(seed=3),
               "checkpoint-reentrant": lambda: CheckpointedGpt(seed=3, reentrant=True),
               "save_on_cpu": lambda: SavedOnCpu(seed=3)}
LR, WD, CLIP, TOL = 1e-2, 0.01, 1.0, 5e-6


def run(budget, overlap=None, checkpoint=None, raising=False):
    """raising: before each step's forward, a forward that raises inside
    block 1's fc, an offloaded module (a hook cuts its input short)."""
    model = CHECKPOINTS[checkpoint]() if checkpoint else TinyGpt(seed=3)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}},
           "gradient_clipping": CLIP}
    if budget:
        cfg["strata"] = {"device_budget": budget}
    off = st.offload_module(model, cfg, force_no_gpu=True, overlap_step=overlap)
    losses = []
    armed = [False]

    def cut(mod, inp):
        return (inp[0][..., :-1],) if armed[0] else None
    model.blocks[1].fc.register_forward_pre_hook(cut)
    for x, y in batches(4, 3, seed=5):
        if raising:
            armed[0] = True
            with pytest.raises(RuntimeError, match="shapes cannot be multiplied|size mismatch"):
                model(x)
            armed[0] = False
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        off.optimizer.step()
        assert not off.optimizer.last_result[1], "a step was skipped (non-finite gradients)"
        off.optimizer.zero_grad()
        losses.append(loss.item())
    out = losses, off.master_parameters(), off.engine.stats()
    off.close()
    return out


def torch_run():
    """The oracle: torch's AdamW with clip_grad_norm_, nothing offloaded."""
    model = TinyGpt(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x, y in batches(4, 3, seed=5):
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("overlap,checkpoint", [(None, None), (False, None), (None, "checkpoint"),
                                                (None, "checkpoint-reentrant"), (None, "save_on_cpu")],
                         ids=["overlap", "no-overlap", "checkpoint", "checkpoint-reentrant", "save_on_cpu"])
def test_budget_below_the_model_is_bitwise_resident(overlap, checkpoint):
    model_bytes = sum(p.numel() * 4 for p in TinyGpt().parameters())
    budget = BUDGET_CHECKPOINTED if checkpoint and checkpoint.startswith("checkpoint") else BUDGET
    assert budget <= (0.67 if STRICT else 0.52) * model_bytes
    small = run(budget, overlap, checkpoint)
    big = run(None, overlap, checkpoint)
    assert small[0] == big[0], (small[0], big[0])
    assert all(torch.isfinite(torch.tensor(small[0])))
    for name in big[1]:
        assert torch.equal(small[1][name], big[1][name]), name
    # And it trained as torch does (a run whose backward read poisoned
    # memory skips every step and stays bitwise equal to itself).
    ref_losses, ref = torch_run()
    for name, want in ref.items():
        got = small[1][name]
        rel = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        assert rel <= TOL, (name, rel)
    init = dict(TinyGpt(seed=3).named_parameters())
    assert all(not torch.equal(small[1][n], init[n].detach()) for n in ref), "nothing trained"
    s = small[2]
    assert s["device"]["budget"] == budget
    assert 0 < s["device"]["peak"] <= budget, s["device"]
    # Evicted and brought back: more moved to the device than with room for all.
    assert s["host_to_device"] > big[2]["host_to_device"], (s["host_to_device"], big[2]["host_to_device"])


@pytest.mark.parametrize("checkpoint", [None, "checkpoint", "checkpoint-reentrant"])
def test_a_forward_that_raises_leaves_nothing_fetched(checkpoint):
    # A forward that raises inside an offloaded module (a trainer skipping a
    # bad batch) ends its modules' scopes: nothing stays fetched (before,
    # on torch < 2.1, every later step failed "group N is fetched and not
    # released", and a budget run would hold the groups), no saved-tensor
    # hooks of ours stay entered, and training goes on bitwise as without it.
    from strata.torch import _saved_tensors
    budget = BUDGET_CHECKPOINTED if checkpoint else BUDGET
    raised = run(budget, None, checkpoint, raising=True)
    assert _saved_tensors.owner_of(_saved_tensors.top()) is None, _saved_tensors.top()
    clean = run(budget, None, checkpoint)
    assert raised[0] == clean[0], (raised[0], clean[0])
    for name in clean[1]:
        assert torch.equal(raised[1][name], clean[1][name]), name
    assert 0 < raised[2]["device"]["peak"] <= budget, raised[2]["device"]
