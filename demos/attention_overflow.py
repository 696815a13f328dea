"""Demo: fp16 overflow in unscaled attention scores (q @ k^T > 65504).

What it reproduces
    A tiny transformer (token embedding + 2 blocks, no LayerNorm) on a copy
    task, with hand-written attention in ``blocks.0.attn`` / ``blocks.1.attn``
    that forgets the ``1/sqrt(head_dim)`` factor and whose query/key
    projections have grown large (as in a model trained without QK
    normalization).  Its attention scores ``q @ k.transpose(-2, -1)`` reach
    ~1.5e5 (1-3% of them above 65504 on the first batch).

Why it fails in fp16
    Under ``torch.autocast(dtype=float16)`` the ``q @ k^T`` matmul writes its
    result in fp16, whose largest finite value is 65504: the big scores become
    ``+inf``/``-inf``.  Softmax subtracts the row maximum, so it computes
    ``inf - inf = nan`` for every row that holds a ``+inf``, and the NaN flows
    into the output: the LOSS is non-finite on every step, before any
    gradient exists.  bf16 has fp32's 8-bit exponent (max ~3.4e38), so the
    same scores are representable (just coarsely rounded) and softmax stays
    finite.

Show the failure
    amp-tui train demos/attention_overflow.py --dtype fp16 --steps 60
Fix
    amp-tui train demos/attention_overflow.py --dtype bf16 --steps 60
(The code fix would be scaling scores by 1/sqrt(head_dim) or QK-norm.)

Script options (ctx.argv; pass them after ``--``, e.g.
    ``amp-tui train demos/attention_overflow.py --dtype fp16 -- --qk-gain 30``):
``--qk-gain`` (multiplier on the q/k projection weights, default 100; at 30
the scores stay below ~15000 and fp16 is fine), ``--dim`` (model width,
default 64), ``--heads`` (default 2), ``--batch`` (default 16).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, qk_gain: float):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim)
        with torch.no_grad():
            self.q.weight.mul_(qk_gain)
            self.k.weight.mul_(qk_gain)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads

        def split(z):
            return z.view(b, t, h, d // h).transpose(1, 2)  # (b, h, t, hd)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-2, -1)  # BUG: no / sqrt(d // h)
        attn = scores.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(y)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, qk_gain: float):
        super().__init__()
        self.attn = Attention(dim, heads, qk_gain)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, depth: int, qk_gain: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.5)
        self.blocks = nn.ModuleList(Block(dim, heads, qk_gain) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _parse(argv):
    p = argparse.ArgumentParser(prog="attention_overflow.py")
    p.add_argument("--qk-gain", type=float, default=100.0)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    return p.parse_args(list(argv or []))


def setup(ctx=None):
    args = _parse(getattr(ctx, "argv", None))
    torch.manual_seed(0)
    vocab, seq, batch, n_batches = 32, 16, args.batch, 16

    # Task: predict the token `shift` positions back (copy task), which
    # needs attention.
    shift = 3
    batches = []
    for _ in range(n_batches):
        tokens = torch.randint(0, vocab, (batch, seq))
        target = torch.roll(tokens, shifts=shift, dims=1)
        batches.append({"tokens": tokens, "target": target})

    model = TinyTransformer(vocab, seq, args.dim, heads=args.heads, depth=2, qk_gain=args.qk_gain)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(model, batch):
        logits = model(batch["tokens"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["target"].reshape(-1))

    return {
        "model": model,
        "optimizer": optimizer,
        "loss_fn": loss_fn,
        "batches": batches,
        "max_grad_norm": 1.0,
    }
