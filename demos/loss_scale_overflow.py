"""Demo: GradScaler's default initial loss scale (65536) is too large for a large loss.

What it reproduces
    An MLP regression whose targets have magnitude ~300-400, trained with MSE,
    so the loss starts around 1.3e5.  Under fp16 autocast the loss itself is
    always finite (autocast computes ``mse_loss`` in fp32), but GradScaler
    starts at ``init_scale=65536``: the scaled backward pass produces
    gradients far above 65504 in the fp16 matmuls, they overflow to inf, and
    GradScaler skips ``optimizer.step()`` and halves the scale -- again and
    again.  On this demo the first 11 updates (steps 0-10) are all thrown
    away while the scale falls 65536 -> 32.

Why
    fp16's largest finite value is 65504, and the loss scale multiplies
    every gradient.  With a loss of ~1e5 the unscaled gradients are already
    in the hundreds-to-thousands, so a 65536x scale pushes them to ~1e7..1e8.
    The model is fine: once the scale has come down, training proceeds.  A
    large loss simply needs a small starting scale.

Show the failure (steps 0-10 skipped, scale 65536 -> 32)
    amp-tui train demos/loss_scale_overflow.py --dtype fp16 --steps 60
Fix (no update skipped; verified skip-free for 300 steps)
    amp-tui train demos/loss_scale_overflow.py --dtype fp16 --steps 60 --init-scale 8
(``--init-scale 32`` is also skip-free for the first ~120 steps, after which
the growing gradients cost a skip or two.  ``--dtype bf16`` avoids the
problem entirely: bf16 has fp32's range and needs no loss scaling.)

Script options (ctx.argv; pass them after ``--``): ``--target-scale``
(default 350), ``--width`` (default 128), ``--lr`` (default 3e-3).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class RegressionMLP(nn.Module):
    """MLP on normalized features; the head predicts in units of ``output_scale``."""

    def __init__(self, in_dim: int, width: int, out_dim: int, output_scale: float = 10.0):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(in_dim, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.LayerNorm(width),
        )
        self.head = nn.Linear(width, out_dim)
        self.output_scale = output_scale

    def forward(self, x):
        return self.head(self.body(x)) * self.output_scale


def _parse(argv):
    p = argparse.ArgumentParser(prog="loss_scale_overflow.py")
    p.add_argument("--target-scale", type=float, default=350.0)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(list(argv or []))


def setup(ctx=None):
    args = _parse(getattr(ctx, "argv", None))
    torch.manual_seed(0)
    in_dim, out_dim, batch, n_batches = 32, 4, 64, 16

    # Targets: |y| in [target_scale - 50, target_scale + 50] (300..400 by
    # default), sign and size a smooth function of x.
    w_true = torch.randn(in_dim, out_dim) / in_dim ** 0.5
    batches = []
    for _ in range(n_batches):
        x = torch.randn(batch, in_dim)
        z = x @ w_true
        y = torch.sign(z) * (args.target_scale - 50.0 + 100.0 * torch.tanh(z.abs()))
        batches.append((x, y))

    model = RegressionMLP(in_dim, args.width, out_dim)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def loss_fn(model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    return {
        "model": model,
        "optimizer": optimizer,
        "loss_fn": loss_fn,
        "batches": batches,
        "max_grad_norm": 1.0,
    }
