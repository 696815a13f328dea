"""The benchmark models: a deep MLP, a small GPT-like transformer and a residual stack of many
small modules, built from a seed, no downloads. `build` returns (model, batches, loss_fn,
description) with the model on the CPU and the batches on `device`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MlpSpec:
    depth: int = 24        # hidden Linear(width, width) layers (plus an input and an output layer)
    width: int = 256
    in_dim: int = 64
    classes: int = 10
    batch: int = 128

    @property
    def name(self) -> str:
        return f"mlp-{self.depth + 2}x{self.width}"

    def describe(self, params: int) -> str:
        return (f"MLP: {self.depth + 2} Linear layers (width {self.width}) with GELU, batch {self.batch}, "
                f"{params / 1e6:.2f} M parameters")


@dataclass(frozen=True)
class GptSpec:
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    vocab: int = 2048
    seq: int = 64
    batch: int = 8

    @property
    def name(self) -> str:
        return f"gpt-{self.layers}L-d{self.d_model}"

    def describe(self, params: int) -> str:
        return (f"GPT-like: {self.layers} blocks, d_model {self.d_model}, {self.heads} heads, vocab "
                f"{self.vocab}, seq {self.seq}, batch {self.batch}, tied head, "
                f"{params / 1e6:.2f} M parameters")


@dataclass(frozen=True)
class BlocksSpec:
    """Many small modules: where per-tensor work shows more than arithmetic."""

    blocks: int = 24       # residual blocks of LayerNorm + Linear(width, width)
    width: int = 128
    in_dim: int = 64
    classes: int = 10
    batch: int = 32

    @property
    def name(self) -> str:
        return f"blocks-{self.blocks}x{self.width}"

    def describe(self, params: int) -> str:
        return (f"Blocks: {self.blocks} residual blocks of LayerNorm + Linear (width {self.width}), "
                f"batch {self.batch}, {params / 1e6:.2f} M parameters")


class NormLinear(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + F.gelu(self.linear(self.norm(x)))


def blocks(spec: BlocksSpec) -> nn.Module:
    return nn.Sequential(nn.Linear(spec.in_dim, spec.width),
                         *(NormLinear(spec.width) for _ in range(spec.blocks)),
                         nn.LayerNorm(spec.width), nn.Linear(spec.width, spec.classes))


def mlp(spec: MlpSpec) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(spec.in_dim, spec.width), nn.GELU()]
    for _ in range(spec.depth):
        layers += [nn.Linear(spec.width, spec.width), nn.GELU()]
    layers.append(nn.Linear(spec.width, spec.classes))
    return nn.Sequential(*layers)


def classify_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """GPT-2's layout (pre-norm blocks, learned positions, head tied to the token embedding)."""

    def __init__(self, spec: GptSpec):
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.d_model)
        self.wpe = nn.Embedding(spec.seq, spec.d_model)
        self.h = nn.ModuleList(Block(spec.d_model, spec.heads) for _ in range(spec.layers))
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * spec.layers) if name.endswith("c_proj.weight") else std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def build(spec, device: str = "cpu", n_batches: int = 4, seed: int = 0):
    """(model on the CPU, batches on `device`, loss_fn, description)."""
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if isinstance(spec, (MlpSpec, BlocksSpec)):
        model = mlp(spec) if isinstance(spec, MlpSpec) else blocks(spec)
        batches = [(torch.randn(spec.batch, spec.in_dim, generator=g),
                    torch.randint(0, spec.classes, (spec.batch,), generator=g)) for _ in range(n_batches)]
        loss_fn = classify_loss
    else:
        model = TinyGPT(spec)
        batches = []
        for _ in range(n_batches):
            tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
            batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        loss_fn = lm_loss
    batches = [tuple(t.to(device) for t in b) for b in batches]
    params = sum(p.numel() for p in model.parameters())
    return model, batches, loss_fn, spec.describe(params)


# GPT-2 small: 12 blocks, d_model 768, 12 heads, vocab 50257 (seq shortened to 512 to fit the
# five-minute GPU check with every contender).
GPT2_SMALL = GptSpec(layers=12, d_model=768, heads=12, vocab=50257, seq=512, batch=8)
