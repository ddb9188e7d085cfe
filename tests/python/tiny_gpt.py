"""A small GPT in plain torch (token and position embeddings, pre-norm
blocks of causal self-attention and an MLP, a head tied to the token
embedding, as GPT-2's): the model the PyTorch integration tests train."""
import math

import torch
import torch.nn.functional as F

VOCAB, CTX, DIM, HEADS, LAYERS = 61, 16, 32, 4, 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(DIM)
        # No bias: a key bias shifts every score of a query alike, so its
        # gradient is zero up to rounding noise, which Adam would amplify into
        # updates that differ between any two summation orders.
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.ln2 = torch.nn.LayerNorm(DIM)
        self.fc = torch.nn.Linear(DIM, 4 * DIM)
        self.out = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGpt(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(VOCAB, DIM)
        self.wpe = torch.nn.Embedding(CTX, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def batches(steps, batch, seed=1):
    """`steps` global batches of `batch` sequences (inputs, targets)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (steps, batch, CTX + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def loss_of(model, x, y):
    """The mean cross-entropy over every token of the batch."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def lr_factor(step):
    return 1.0 - step / 20.0  # a linear decay: the LR changes every step


class CheckpointedGpt(TinyGpt):
    """TinyGpt with each block under torch.utils.checkpoint (non-reentrant
    unless `reentrant`), and with `head`, ln_f and the head as one more
    checkpointed segment. `inputs_bytes` adds up the bytes of the tensors
    given to checkpoint (what it keeps until backward)."""

    def __init__(self, seed=0, reentrant=False, head=False):
        super().__init__(seed)
        self.reentrant, self.checkpoint_head, self.inputs_bytes = reentrant, head, 0

    def _checkpoint(self, fn, x):
        import torch.utils.checkpoint
        self.inputs_bytes += x.numel() * x.element_size()
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=self.reentrant)

    def _head(self, x):
        return self.head(self.ln_f(x))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = self._checkpoint(blk, x)
        return self._checkpoint(self._head, x) if self.checkpoint_head else self._head(x)
