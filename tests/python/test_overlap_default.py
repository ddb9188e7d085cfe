"""offload_module's overlapped step, on by default, against the same run with
overlap_step=False: bitwise the same master weights, moments and gradient
norms on real models (a GPT with tied weights, an nn.TransformerEncoder),
with clipping that never triggers, that triggers every step and on some
steps (clip_grad_norm_ and the config's gradient_clipping), grad
accumulation over 2 micro-batches, a NaN, fp16 with an overflow (torch 2:
torch 1.13 has no fp16 matmul on the CPU), state in host memory and on
NVMe. The engine's counters say what the overlap did: steps speculated,
committed, replayed (clipping applied) and discarded (a skipped step), and
groups updated before the end of backward. Training patterns an overlapped
step cannot serve (two backward passes summed into one step, a forward
between backward and step()) are recognised and not overlapped."""
import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import TinyGpt, batches, loss_of  # noqa: E402

STEPS = 5
LR, WD = 3e-3, 0.01
TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def config(tmp_path=None, **extra):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    if tmp_path is not None:
        os.makedirs(tmp_path, exist_ok=True)
        nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": nvme, "offload_param": dict(nvme)}
    cfg.update(copy.deepcopy(extra))
    # "always": the counts these tests check are those of a step that
    # speculates whenever it could (the default policy, "auto", is tested
    # in test_speculation_policy_default).
    cfg.setdefault("strata", {}).setdefault("speculation", "always")
    return cfg


class Encoder(torch.nn.Module):
    """A small nn.TransformerEncoder classifier (torch's own layers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(61, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(32, 61)

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx)))


MODELS = {"gpt": TinyGpt, "encoder": Encoder}


def train(make, cfg, overlap, clip=None, accum=1, steps=STEPS, nan_step=None, fp16=False, between=None):
    """`steps` steps of AdamW under a scheduler (stepped after step(), as
    torch wants), clip_grad_norm_(clip) after backward when clip is given,
    `accum` micro-batches a step (offload_module's grad_accumulation_steps),
    a NaN in the position embedding's gradient at step `nan_step`. Returns the masters, the moments,
    the norms (clip_grad_norm_'s, and step()'s), the skipped steps and the
    engine's stats."""
    model = make()
    if fp16:
        model = model.half()
    off = st.offload_module(model, cfg, force_no_gpu=True, grad_accumulation_steps=accum, overlap_step=overlap)
    opt = off.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 20.0)
    data = batches(steps * accum, 2)
    norms, skipped = [], []
    for s in range(steps):
        # A NaN in the gradient of the parameter backward reaches last (the
        # position embedding): groups before it were updated early.
        hook = model.wpe.weight.register_hook(lambda g: torch.full_like(g, float("nan"))) if s == nan_step else None
        for k in range(accum):
            x, y = data[s * accum + k]
            off.backward(loss_of(model, x, y))  # fp16: the loss times the engine's scale
        if hook is not None:
            hook.remove()
        if between is not None:
            between(model, s)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
        opt.zero_grad()
        norm, skip = opt.last_result
        norms.append(norm)
        skipped.append(skip)
    masters = off.master_parameters()
    moments = opt.state_dict()["state"]
    stats = off.engine.stats()
    off.close()
    return masters, moments, norms, skipped, stats


def assert_bitwise(a, b):
    ma, sa, na, ka, _ = a
    mb, sb, nb, kb, _ = b
    assert set(ma) == set(mb)
    bad = [n for n in ma if not torch.equal(ma[n], mb[n])]
    assert not bad, f"master weights differ: {bad}"
    for i in sa:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][k], sb[i][k]), f"parameter {i}'s {k} differs"
        assert float(sa[i]["step"]) == float(sb[i]["step"])
    assert na == nb, ("norms", na, nb)
    assert ka == kb, ("skipped", ka, kb)


def assert_counters(stats, speculated, committed=None, replayed=0, discarded=0):
    assert stats["speculated_steps"] == speculated, stats
    assert stats["committed_steps"] == (speculated - replayed - discarded if committed is None else committed), stats
    assert stats["replayed_steps"] == replayed, stats
    assert stats["discarded_steps"] == discarded, stats
    # A committed step updated its groups before the end of backward (a
    # replayed one may have dropped those not yet begun when step() came).
    done = stats["committed_steps"]
    assert stats["early_updates"] >= done if speculated else stats["early_updates"] == 0, stats


def check(make, cfg, clip=None, accum=1, nan_step=None, fp16=False):
    """The default (overlapped) run against overlap_step=False: bitwise the
    same; the overlapped one speculated every step but the first (which is
    never overlapped), the other none. Returns (overlapped, plain)."""
    got = train(make, cfg, None, clip=clip, accum=accum, nan_step=nan_step, fp16=fp16)
    ref = train(make, cfg, False, clip=clip, accum=accum, nan_step=nan_step, fp16=fp16)
    assert_bitwise(got, ref)
    assert_counters(ref[4], 0, committed=0)
    init = {n: p.detach().float() for n, p in make().named_parameters()}
    assert any(not torch.equal(got[0][n], init[n]) for n in init), "nothing trained"
    return got, ref


def step_norms(run, clip):
    """step()'s norms of a run with clip_grad_norm_ (every other entry)."""
    return run[2][1::2] if clip is not None else run[2]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_speculation_policy_default(name, tmp_path):
    """strata.speculation "auto" (the default), the optimizer state on NVMe:
    clipped at every step, the steps are overlapped without speculating
    (nothing speculated, replayed or updated early: no update is paid for
    twice), bitwise the run without overlap; never clipped, every overlapped
    step speculates and commits. In host memory without a GPU it never
    speculates, clipped or not (backing up what an early update changes
    would cost what the update does)."""
    cfg = config(tmp_path / "swap", strata={"speculation": "auto"})
    got, _ = check(MODELS[name], cfg, clip=1e-3)
    assert min(step_norms(got, 1e-3)) > 1e-3  # every step clipped
    assert_counters(got[4], 0, committed=0)
    assert got[4]["unspeculated_steps"] == STEPS - 1, got[4]  # the first is not overlapped at all
    got, _ = check(MODELS[name], cfg, clip=1e6)
    assert_counters(got[4], STEPS - 1)
    assert got[4]["unspeculated_steps"] == 0, got[4]
    got, _ = check(MODELS[name], config(strata={"speculation": "auto"}), clip=1e6)
    assert_counters(got[4], 0, committed=0)
    assert got[4]["unspeculated_steps"] == STEPS - 1, got[4]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_clipping_commits_every_speculation(name):
    got, _ = check(MODELS[name], config())
    assert_counters(got[4], STEPS - 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_clip_grad_norm_that_never_triggers(name):
    got, _ = check(MODELS[name], config(), clip=1e6)
    assert max(got[2]) < 1e6
    assert_counters(got[4], STEPS - 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_clip_grad_norm_that_triggers_every_step(name):
    got, _ = check(MODELS[name], config(), clip=1e-3)
    assert min(got[2]) > 1e-3, got[2]
    assert_counters(got[4], STEPS - 1, replayed=STEPS - 1)


def test_config_clipping_triggers_on_some_steps():
    # gradient_clipping between the steps' norms: some steps clip, some not.
    norms = step_norms(train(TinyGpt, config(), False), None)
    clip = sorted(norms[1:])[len(norms[1:]) // 2]  # the median of the speculated steps' norms
    clip = float(clip) * (1 + 1e-6)
    got, _ = check(TinyGpt, config(gradient_clipping=clip))
    clipped = sum(n > clip for n in step_norms(got, None)[1:])
    assert 0 < clipped < STEPS - 1, (norms, clip)
    assert_counters(got[4], STEPS - 1, replayed=clipped)


def test_config_clipping_that_triggers_every_step_on_nvme(tmp_path):
    got, _ = check(TinyGpt, config(tmp_path / "swap", gradient_clipping=1e-3))
    assert min(step_norms(got, None)) > 1e-3
    assert_counters(got[4], STEPS - 1, replayed=STEPS - 1)


def test_nvme_without_clipping(tmp_path):
    got, _ = check(Encoder, config(tmp_path / "swap"))
    assert_counters(got[4], STEPS - 1)


@pytest.mark.parametrize("clip", [None, 1e6, 1e-3], ids=["noclip", "clip-never", "clip-always"])
def test_grad_accumulation_over_two_micro_batches(clip):
    got, _ = check(TinyGpt, config(), clip=clip, accum=2)
    replayed = STEPS - 1 if clip == 1e-3 else 0
    assert_counters(got[4], STEPS - 1, replayed=replayed)


def test_a_nan_discards_the_speculation_and_skips_the_step():
    got, _ = check(TinyGpt, config(), nan_step=2)
    assert got[3] == [s == 2 for s in range(STEPS)]
    assert_counters(got[4], STEPS - 1, discarded=1)


@pytest.mark.skipif(not TORCH2, reason="torch 1.13 has no fp16 matmul on the CPU")
def test_fp16_with_dynamic_loss_scaling_and_an_overflow():
    # The scale doubles after 2 good steps, to 2^16, where this model's
    # gradients overflow fp16: that step is skipped (its early updates
    # discarded) and the scale halves.
    cfg = config(fp16={"enabled": True, "initial_scale_power": 15, "hysteresis": 1, "loss_scale_window": 2})
    got, _ = check(TinyGpt, cfg, fp16=True)
    skipped = got[3][1:]  # the speculated steps'
    assert any(skipped) and not all(skipped), got[3]
    stats = got[4]
    # Every step that went ahead committed; an overflowed one discarded its
    # early updates, if it had any (an overflow from the first group on
    # leaves none: the engine speculates no group whose gradients are not
    # finite).
    assert stats["committed_steps"] == skipped.count(False), stats
    assert stats["discarded_steps"] <= skipped.count(True), stats
    assert stats["speculated_steps"] == stats["committed_steps"] + stats["discarded_steps"], stats
    assert stats["replayed_steps"] == 0 and stats["early_updates"] >= stats["committed_steps"], stats


def test_two_backward_passes_into_one_step_are_not_overlapped():
    # torch-style accumulation (backward twice, one step) without
    # grad_accumulation_steps: the engine sums, as torch does; an overlapped
    # step would have updated the groups after the first backward.
    def twice(model, s):
        x, y = batches(STEPS, 2, seed=7)[s]
        loss_of(model, x, y).backward()

    got = train(TinyGpt, config(), None, between=twice)
    ref = train(TinyGpt, config(), False, between=twice)
    assert_bitwise(got, ref)
    assert_counters(got[4], 0, committed=0)


def test_a_forward_between_backward_and_step_is_not_overlapped():
    def evaluate(model, s):
        with torch.no_grad():
            model(batches(1, 2, seed=9)[0][0])

    got = train(Encoder, config(), None, between=evaluate)
    ref = train(Encoder, config(), False, between=evaluate)
    assert_bitwise(got, ref)
    assert_counters(got[4], 0, committed=0)


def test_a_forward_between_backward_and_step_after_overlapped_steps_undoes_the_speculation():
    # The engine undoes the step's speculative early updates when a group
    # updated early is fetched again: the forward sees the parameters before
    # the step, and the step is that of overlap_step=False; later steps are
    # not overlapped (a forward there each time would waste the speculation).
    data = batches(4, 2)

    def run(overlap):
        model = TinyGpt()
        off = st.offload_module(model, config(), force_no_gpu=True, overlap_step=overlap)
        for x, y in data[:2]:
            loss_of(model, x, y).backward()
            off.optimizer.step()
        loss_of(model, *data[2]).backward()
        with torch.no_grad():
            out = model(data[2][0])
        off.optimizer.step()
        loss_of(model, *data[3]).backward()
        off.optimizer.step()
        stats, masters = off.engine.stats(), off.master_parameters()
        off.close()
        return out, stats, masters

    out, stats, masters = run(None)
    ref_out, _, ref_masters = run(False)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(masters[n], w) for n, w in ref_masters.items())
    assert stats["speculated_steps"] == 2 and stats["replayed_steps"] == 1  # the second; the third undone
    assert stats["committed_steps"] == 1


def test_overlap_step_off_and_bad_values():
    model = TinyGpt()
    with pytest.raises(strata.Error, match="overlap_step"):
        st.offload_module(model, config(), force_no_gpu=True, overlap_step="yes")
    got = train(TinyGpt, config(), True)
    assert_counters(got[4], STEPS - 1)


def test_state_between_backward_and_step_of_an_overlapped_step_is_the_state_before_it():
    # A read of the state of a group updated early, between backward and
    # step(), makes the engine undo the speculation first: the read gives
    # the state before the step, as with overlap_step=False, and the step is
    # still exact.
    data = batches(3, 2)

    def run(overlap):
        model = TinyGpt()
        off = st.offload_module(model, config(gradient_clipping=1e-3), force_no_gpu=True, overlap_step=overlap)
        for x, y in data[:2]:
            loss_of(model, x, y).backward()
            off.optimizer.step()
        loss_of(model, *data[2]).backward()
        mid = off.master_parameters()
        opt_state = off.optimizer.state_dict()["state"]
        off.optimizer.step()
        after = off.master_parameters()
        stats = off.engine.stats()
        off.close()
        return mid, opt_state, after, stats

    mid, opt_state, after, stats = run(None)
    ref_mid, ref_state, ref_after, _ = run(False)
    assert all(torch.equal(mid[n], w) for n, w in ref_mid.items())
    for i, s in ref_state.items():
        assert all(torch.equal(opt_state[i][k], v) for k, v in s.items() if torch.is_tensor(v))
    assert all(torch.equal(after[n], w) for n, w in ref_after.items())
    assert stats["replayed_steps"] == 2


def test_a_second_backward_over_the_same_graph_is_not_overlapped():
    # One Linear whose input needs no gradient: its backward saves only the
    # input, so a second backward over the graph fetches nothing, but hands
    # the group a second gradient, which an early update would have missed.
    def run(overlap):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 4)
        off = st.offload_module(lin, config(), force_no_gpu=True, overlap_step=overlap)
        g = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            loss = lin(torch.randn(16, 8, generator=g)).pow(2).mean()
            loss.backward(retain_graph=True)
            loss.backward()
            off.optimizer.step()
        out = off.master_parameters(), off.engine.stats()
        off.close()
        return out

    (got, stats), (ref, _) = run(None), run(False)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert_counters(stats, 0, committed=0)
