"""Demo: fp16 activation overflow (a layer's output grows past 65504).

What it reproduces
    A small MLP classifier in which one Linear layer, ``amplifier``, has
    weights 2e5x PyTorch's default init (entries ~1e4: an outlier layer).
    Its outputs reach ~1e5..1e6 (mean |x| ~1.5e5, max ~9e5 on the first
    batch).  A LayerNorm right after it (``post_norm``) brings them back to
    O(1), so in fp32 or bf16 the model computes a finite loss and trains.

Why it fails in fp16
    fp16 has a 5-bit exponent: its largest finite value is 65504.  Under
    ``torch.autocast(dtype=float16)`` the ``amplifier`` matmul writes its
    result in fp16, so every activation above 65504 becomes ``inf``.  The
    LayerNorm then computes ``inf - inf = nan`` and the LOSS itself is
    non-finite on every step (this is a forward-pass failure, not a gradient
    overflow: no loss scale can fix it).  bf16 has the same 8-bit exponent as
    fp32 (max ~3.4e38), so the same activations are representable.

Show the failure
    amp-tui train demos/activation_overflow.py --dtype fp16 --steps 60
Fix
    amp-tui train demos/activation_overflow.py --dtype bf16 --steps 60

Script options (ctx.argv; pass them after ``--``, e.g.
    ``amp-tui train demos/activation_overflow.py --dtype fp16 -- --gain 1000``):
``--gain`` (amplifier weight multiplier, default 2e5; with ``--gain 1000``
the outputs stay below ~5e3 and fp16 is fine), ``--width`` (hidden width,
default 128).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class OutlierMLP(nn.Module):
    def __init__(self, in_dim: int, width: int, classes: int, gain: float):
        super().__init__()
        self.inp = nn.Linear(in_dim, width)
        self.amplifier = nn.Linear(width, width)
        self.post_norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)
        with torch.no_grad():
            # The outlier layer: weights ~gain x the default init.
            self.amplifier.weight.mul_(gain)
            self.amplifier.bias.mul_(gain)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = self.amplifier(h)  # |h| ~ 1e5..1e6: inf in fp16 (max 65504)
        h = self.post_norm(h)  # back to O(1) in fp32 / bf16
        h = F.relu(self.hidden(h))
        return self.head(h)


def _parse(argv):
    p = argparse.ArgumentParser(prog="activation_overflow.py")
    p.add_argument("--gain", type=float, default=2e5)
    p.add_argument("--width", type=int, default=128)
    return p.parse_args(list(argv or []))


def setup(ctx=None):
    args = _parse(getattr(ctx, "argv", None))
    torch.manual_seed(0)
    in_dim, classes, batch, n_batches = 32, 10, 64, 16

    # Synthetic task: labels from a fixed random "teacher" projection.
    teacher = torch.randn(in_dim, classes)
    batches = []
    for _ in range(n_batches):
        x = torch.randn(batch, in_dim) * 4.0
        y = (x @ teacher).argmax(dim=1)
        batches.append((x, y))

    model = OutlierMLP(in_dim, args.width, classes, args.gain)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return {
        "model": model,
        "optimizer": optimizer,
        "loss_fn": loss_fn,
        "batches": batches,
        "max_grad_norm": 1.0,
    }
