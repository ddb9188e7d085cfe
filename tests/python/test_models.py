"""Real models nobody on the project wrote (torchvision's resnet18,
mobilenet_v3_small and VisionTransformer; torch.nn's Transformer,
TransformerEncoder, LSTM and GRU; a word_language_model-style LM with a tied
decoder) trained through both entry points of strata.torch beside
torch.optim.AdamW, the oracle (with a correctly rounded sqrt: oracle.py),
from the same initial weights:

- OffloadAdam(model.parameters()) is bitwise torch's AdamW: parameters,
  BatchNorm buffers, eval outputs and the state_dict's moments, with the
  state on NVMe and in host memory;
- offload_module(model) stepped by off.optimizer is within TOL (max |a-b| /
  max |b| per tensor) of it: master weights, buffers and eval outputs.

Also: a no-decay param group, OneCycleLR with clip_grad_norm_, 4 micro-batches
of accumulation, a frozen backbone (torch leaves frozen parameters untouched),
and parameters read outside their own module's forward (nn.MultiheadAttention
reads out_proj.weight; a parent reads a child's weight; F.linear on another
module's weight; a head tied by reading the embedding's weight), and the
offloaded model's forward before any step, in train and eval mode (where
TransformerEncoderLayer's fused path reads every weight itself)."""
import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import strata.torch as st  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402
from test_strata import nvme_config  # noqa: E402
from test_torch_training import LR, TOL, WD, config as module_config  # noqa: E402

STEPS = 3
CLIP = 0.2  # below 3 of the 4 norms of the run
SEED = 1234


def host_config():
    return {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}


def torchvision_models():
    """torchvision.models; a skip naming torchvision where it is missing,
    unless STRATA_REQUIRE_HF=1 (the torch-2 venv), where that fails."""
    try:
        import torchvision.models
    except ImportError as e:
        if os.environ.get("STRATA_REQUIRE_HF") == "1":
            raise
        pytest.skip(f"torchvision is not importable ({e})")
    return torchvision.models


# ---- The models: each a Case (the model, its batches, its loss, an eval input)

class Case:
    def __init__(self, model, batches, loss, eval_input):
        self.model, self.batches, self.loss, self.eval_input = model, batches, loss, eval_input

    def eval_output(self, model):
        model.eval()
        with torch.no_grad():
            out = model(*self.eval_input)
        model.train()
        return out[0] if isinstance(out, tuple) else out


def images(n, classes=10, size=32, batch=2):
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n + 1)]
    return data[:n], (data[n][0],)


def classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def vision_case(make, n):
    torch.manual_seed(0)
    model = make()
    batches, eval_input = images(n)
    return Case(model, batches, classify, eval_input)


def resnet18(n):
    tvm = torchvision_models()
    return vision_case(lambda: tvm.resnet18(weights=None, num_classes=10), n)


def mobilenet_v3_small(n):
    tvm = torchvision_models()
    return vision_case(lambda: tvm.mobilenet_v3_small(weights=None, num_classes=10), n)


def vision_transformer(n):
    vit = torchvision_models().vision_transformer
    return vision_case(lambda: vit.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                     hidden_dim=32, mlp_dim=64, num_classes=10), n)


VOCAB, SEQ = 50, 12


def tokens(n, batch=2, seq=SEQ, batch_first=True):
    g = torch.Generator().manual_seed(11)
    data = []
    for _ in range(n + 1):
        t = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        x, y = t[:, :-1], t[:, 1:]
        data.append((x, y) if batch_first else (x.t().contiguous(), y.t().contiguous()))
    return data[:n], (data[n][0],)


def next_token(model, batch):
    x, y = batch
    out = model(x)
    logits = out[0] if isinstance(out, tuple) else out
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class Seq2Seq(nn.Module):
    """torch.nn.Transformer on real-valued sequences, with a causal target mask."""

    def __init__(self):
        super().__init__()
        self.net = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                  dim_feedforward=64, batch_first=True)  # dropout 0.1, torch's default

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.net(src, tgt, tgt_mask=mask)


def transformer(n):
    torch.manual_seed(0)
    model = Seq2Seq()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(2, 10, 32, generator=g), torch.randn(2, 9, 32, generator=g),
             torch.randn(2, 9, 32, generator=g)) for _ in range(n + 1)]
    return Case(model, data[:n], lambda m, b: F.mse_loss(m(b[0], b[1]), b[2]), data[n][:2])


class EncoderLM(nn.Module):
    """Embedding, nn.TransformerEncoder under a causal mask, a linear head."""

    def __init__(self, dim=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx):
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return self.head(self.encoder(self.embed(idx) + self.pos[:t], mask=mask))


def encoder_lm(n):
    torch.manual_seed(0)
    batches, eval_input = tokens(n)
    return Case(EncoderLM(), batches, next_token, eval_input)


class RecurrentRegressor(nn.Module):
    def __init__(self, cell):
        super().__init__()
        bidirectional = cell is nn.GRU
        self.rnn = cell(8, 16, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(32 if bidirectional else 16, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def recurrent(cell, n):
    torch.manual_seed(0)
    model = RecurrentRegressor(cell)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 7, 8, generator=g), torch.randn(2, 7, 3, generator=g)) for _ in range(n + 1)]
    return Case(model, data[:n], lambda m, b: F.mse_loss(m(b[0]), b[1]), (data[n][0],))


class RNNModel(nn.Module):
    """As pytorch/examples' word_language_model: an embedding encoder, a
    dropout-regularized LSTM over (seq, batch) input, a linear decoder whose
    weight is the encoder's (tied)."""

    def __init__(self, ntoken=VOCAB, ninp=32, nlayers=2, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, ninp, nlayers, dropout=dropout)
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.nlayers, self.nhid = nlayers, ninp

    def init_hidden(self, batch):
        return (torch.zeros(self.nlayers, batch, self.nhid), torch.zeros(self.nlayers, batch, self.nhid))

    def forward(self, idx, hidden=None):
        if hidden is None:
            hidden = self.init_hidden(idx.shape[1])
        out, hidden = self.rnn(self.drop(self.encoder(idx)), hidden)
        return self.decoder(self.drop(out)), hidden


def rnn_lm(n):
    torch.manual_seed(0)
    batches, eval_input = tokens(n, batch_first=False)
    return Case(RNNModel(), batches, next_token, eval_input)


MODELS = {
    "resnet18": resnet18,
    "mobilenet_v3_small": mobilenet_v3_small,
    "vision_transformer": vision_transformer,
    "transformer": transformer,
    "encoder_lm": encoder_lm,
    "lstm": lambda n: recurrent(nn.LSTM, n),
    "gru": lambda n: recurrent(nn.GRU, n),
    "rnn_lm_tied": rnn_lm,
}


# ---- Modules whose parameters are read outside their own forward

class AttentionClassifier(nn.Module):
    """nn.MultiheadAttention: its forward passes out_proj.weight to
    F.multi_head_attention_forward and never calls out_proj."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0])


class ParentReadsChild(nn.Module):
    """The parent computes with its child's weight and bias itself."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.tanh(x @ self.inner.weight.t() + self.inner.bias))


class LinearOn(nn.Module):
    """Projects with another module's weight, passed to its forward."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x, other):
        return F.linear(x, other.weight, self.bias)


class SiblingWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.proj = LinearOn()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.out(torch.tanh(self.proj(h, self.b)))


class HeadReadsEmbedding(nn.Module):
    """A head tied by reading the embedding's weight in the parent's forward
    (no decoder module at all), as many GPT implementations write it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.body = nn.Linear(16, 16)

    def forward(self, idx):
        return torch.tanh(self.body(self.embed(idx))) @ self.embed.weight.t()


def small_case(make):
    def build(n):
        torch.manual_seed(0)
        model = make()
        if isinstance(model, HeadReadsEmbedding):
            batches, eval_input = tokens(n)
            return Case(model, batches, next_token, eval_input)
        g = torch.Generator().manual_seed(9)
        data = [(torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 4, generator=g)) for _ in range(n + 1)]
        return Case(model, data[:n], lambda m, b: F.mse_loss(m(b[0]), b[1]), (data[n][0],))
    return build


READ_OUTSIDE = {
    "multihead_attention": small_case(AttentionClassifier),
    "parent_reads_child": small_case(ParentReadsChild),
    "f_linear_other_weight": small_case(SiblingWeight),
    "head_reads_embedding": small_case(HeadReadsEmbedding),
}


# ---- Training and comparing

def train(model, opt, case, steps, accum=1, divide=True, sched=None, clip=None):
    """`steps` optimizer steps of `accum` micro-batches each (the loss divided
    by accum where `divide`: torch's way; offload_module averages itself);
    returns the clip_grad_norm_ norms. Dropout draws alike in every run."""
    model.train()
    norms = []
    for s in range(steps):
        opt.zero_grad()
        for m in range(accum):
            torch.manual_seed(SEED + s * accum + m)
            loss = case.loss(model, case.batches[s * accum + m])
            (loss / accum if divide and accum > 1 else loss).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
    return norms


def rel(a, b):
    """max |a-b| / max |b| (0 where both are all zeros)."""
    a, b = a.detach().double(), b.detach().double()
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def worst(actual, expected):
    assert set(actual) == set(expected), (sorted(set(actual) ^ set(expected)))
    rels = {n: rel(actual[n], expected[n]) for n in expected}
    name = max(rels, key=rels.get, default=None)
    return name, rels.get(name, 0.0)


def assert_bitwise(actual, expected, what):
    assert set(actual) == set(expected), (what, sorted(set(actual) ^ set(expected)))
    differ = [n for n in expected if not torch.equal(actual[n], expected[n])]
    if differ:
        name, r = worst(actual, expected)
        raise AssertionError(f"{what}: {len(differ)} of {len(expected)} tensors differ from torch's (first "
                             f"{differ[0]}); worst {name}: relative difference {r:.3g}")


def assert_within(actual, expected, what):
    name, r = worst(actual, expected)
    assert r <= TOL, f"{what}: worst {name}: relative difference {r:.3g} (bar {TOL})"


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def buffers(model):
    return {n: b.clone() for n, b in model.named_buffers()}


def torch_run(case, steps, groups=None, make_sched=None, **kw):
    """The oracle: a copy of the case's model trained with torch.optim.AdamW
    (its sqrt correctly rounded)."""
    model = copy.deepcopy(case.model)
    opt = oracle.AdamW(groups(model) if groups else model.parameters(), lr=LR, weight_decay=WD)
    norms = train(model, opt, case, steps, sched=make_sched(opt) if make_sched else None, **kw)
    return model, opt, norms


def assert_moments_bitwise(opt, ref_opt):
    """The optimizer's state_dict moments and step counts against torch's,
    which has state for the parameters it stepped, and only those."""
    mine, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert theirs, "torch has no state: nothing to compare"
    assert sorted(mine) == sorted(theirs), "state for other parameters than torch's"
    for key in ("exp_avg", "exp_avg_sq"):
        assert_bitwise({i: mine[i][key] for i in theirs}, {i: s[key] for i, s in theirs.items()},
                       f"state_dict {key}")
    assert {i: float(mine[i]["step"]) for i in theirs} == {i: float(s["step"]) for i, s in theirs.items()}


def offload_adam_run(case, steps, cfg, groups=None, make_sched=None, **kw):
    model = copy.deepcopy(case.model)
    opt = st.OffloadAdam(groups(model) if groups else model.parameters(), lr=LR, weight_decay=WD, config=cfg,
                         force_no_gpu=True)
    norms = train(model, opt, case, steps, sched=make_sched(opt) if make_sched else None, **kw)
    return model, opt, norms


def assert_frozen(model, ref, frozen):
    """Parameters that do not require grad are as they were, bitwise, in
    torch's run (which skips them) and in ours."""
    assert_bitwise({n: ref.get_parameter(n) for n in frozen}, frozen, "torch's frozen parameters")
    assert_bitwise({n: model.get_parameter(n) for n in frozen}, frozen, "frozen parameters")


def check_offload_adam(case, steps, cfg, groups=None, frozen=None, **kw):
    """OffloadAdam against torch's AdamW, bitwise; returns both models."""
    ref, ref_opt, ref_norms = torch_run(case, steps, groups, **kw)
    model, opt, norms = offload_adam_run(case, steps, cfg, groups, **kw)
    try:
        if frozen:
            assert_frozen(model, ref, frozen)
        assert_bitwise(params(model), params(ref), "parameters")
        assert_bitwise(buffers(model), buffers(ref), "buffers")
        assert_moments_bitwise(opt, ref_opt)
        masters = {i: s["master_param"] for i, s in opt.state_dict()["state"].items()}
        in_order = [p for g in opt.param_groups for p in g["params"]]  # the state_dict's numbering
        assert_bitwise(masters, {i: in_order[i].detach() for i in masters}, "master_param")
        expected = case.eval_output(ref)
        assert expected.abs().max() > 0, "torch's eval output is zeros: nothing to compare"
        assert_bitwise({"out": case.eval_output(model)}, {"out": expected}, "eval output")
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= TOL * b, ("clip_grad_norm_", norms, ref_norms)
    finally:
        opt.close()
    return model, ref, norms, ref_norms


def check_offload_module(case, steps, tmp_path, accum=1, frozen=None, make_sched=None, **kw):
    """offload_module + off.optimizer against torch's AdamW, within TOL:
    master weights, buffers, eval outputs, and the parameters after close."""
    ref, ref_opt, ref_norms = torch_run(case, steps, accum=accum, make_sched=make_sched, **kw)
    model = copy.deepcopy(case.model)
    off = st.offload_module(model, module_config(tmp_path), force_no_gpu=True, grad_accumulation_steps=accum)
    try:
        norms = train(model, off.optimizer, case, steps, accum=accum, divide=False,
                      sched=make_sched(off.optimizer) if make_sched else None, **kw)
        if frozen:
            assert_frozen(model, ref, frozen)
        masters = off.master_parameters()
        assert_within(masters, {n: ref.get_parameter(n) for n in masters}, "master weights")
        assert {n for n, p in ref.named_parameters() if p.requires_grad} <= set(masters)
        assert_within(buffers(model), buffers(ref), "buffers")
        expected = case.eval_output(ref)
        assert expected.abs().max() > 0, "torch's eval output is zeros: nothing to compare"
        assert_within({"out": case.eval_output(model)}, {"out": expected}, "eval output")
        assert off.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= TOL * b, ("clip_grad_norm_", norms, ref_norms)
    finally:
        off.close()
    assert_within(params(model), params(ref), "parameters after close")
    return model, ref, norms, ref_norms


# ---- The tests

@pytest.mark.parametrize("device", ["nvme", "cpu"])
@pytest.mark.parametrize("name", list(MODELS))
def test_offload_adam_is_bitwise_adamw(name, device, tmp_path):
    case = MODELS[name](STEPS)
    check_offload_adam(case, STEPS, nvme_config(tmp_path) if device == "nvme" else host_config())


@pytest.mark.parametrize("name", list(MODELS))
def test_offload_module_matches_adamw(name, tmp_path):
    check_offload_module(MODELS[name](STEPS), STEPS, tmp_path)


def no_decay_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    assert decay and rest
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("name", ["encoder_lm", "resnet18"])
def test_offload_adam_no_decay_group(name, tmp_path):
    # offload_module has one param group: this split is OffloadAdam's.
    check_offload_adam(MODELS[name](STEPS), STEPS, nvme_config(tmp_path), groups=no_decay_groups)


def one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=4)  # betas cycle too


@pytest.mark.parametrize("entry", ["offload_adam", "offload_module"])
@pytest.mark.parametrize("sched, clip", [(one_cycle, None), (None, CLIP), (one_cycle, CLIP)],
                         ids=["one_cycle", "clip_grad_norm", "one_cycle+clip_grad_norm"])
def test_one_cycle_lr_and_clip_grad_norm(sched, clip, entry, tmp_path):
    # The word_language_model LM, as its training script runs it: clipped.
    case = rnn_lm(4)
    check = check_offload_adam if entry == "offload_adam" else check_offload_module
    cfg = nvme_config(tmp_path) if entry == "offload_adam" else tmp_path
    *_, norms, ref_norms = check(case, 4, cfg, make_sched=sched, clip=clip)
    if clip is not None:
        assert len(norms) == 4 and any(n > CLIP for n in ref_norms), ("the run must clip", ref_norms)


@pytest.mark.parametrize("entry", ["offload_adam", "offload_module"])
def test_accumulation_over_four_micro_batches(entry, tmp_path):
    case = mobilenet_v3_small(4 * STEPS)  # BatchNorm sees each micro-batch; dropout draws per micro-batch
    if entry == "offload_adam":
        check_offload_adam(case, STEPS, nvme_config(tmp_path), accum=4)
    else:
        check_offload_module(case, STEPS, tmp_path, accum=4)


@pytest.mark.parametrize("entry", ["offload_adam", "offload_module"])
def test_frozen_backbone_is_untouched(entry, tmp_path):
    case = resnet18(STEPS)
    for n, p in case.model.named_parameters():
        p.requires_grad_(n.startswith("fc."))
    frozen = {n: p.detach().clone() for n, p in case.model.named_parameters() if not p.requires_grad}
    if entry == "offload_adam":  # AdamW(model.parameters()), the frozen ones included
        model, *_ = check_offload_adam(case, STEPS, nvme_config(tmp_path), frozen=frozen)
    else:
        model, *_ = check_offload_module(case, STEPS, tmp_path, frozen=frozen)
    assert not torch.equal(model.fc.weight, case.model.fc.weight), "fc trained"


@pytest.mark.parametrize("entry", ["offload_adam", "offload_module"])
@pytest.mark.parametrize("name", list(READ_OUTSIDE))
def test_parameter_read_outside_its_module_forward(name, entry, tmp_path):
    case = READ_OUTSIDE[name](STEPS)
    if entry == "offload_adam":
        check_offload_adam(case, STEPS, nvme_config(tmp_path))
    else:
        check_offload_module(case, STEPS, tmp_path)


@pytest.mark.parametrize("name", list(MODELS) + list(READ_OUTSIDE))
def test_offloaded_forward_equals_the_original(name):
    # Before any step: the offloaded model computes what the model did, in
    # train mode with autograd and in eval mode without (where torch's
    # TransformerEncoderLayer takes its fused path over every weight).
    case = (MODELS.get(name) or READ_OUTSIDE[name])(1)
    with torch.no_grad():  # a zero-initialized head (ViT's) would hide every other weight
        for p in case.model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0, 0.02)
    ref = copy.deepcopy(case.model)
    model = copy.deepcopy(case.model)
    off = st.offload_module(model, {}, force_no_gpu=True)
    try:
        outs = []
        for m in (model, ref):
            torch.manual_seed(SEED)
            out = m(*case.eval_input)
            outs.append({"train": (out[0] if isinstance(out, tuple) else out).detach(),
                         "eval": case.eval_output(m)})
        assert all(o.abs().max() > 0 for o in outs[1].values()), "the reference outputs are zeros"
        assert_within(outs[0], outs[1], "forward outputs")
    finally:
        off.close()
