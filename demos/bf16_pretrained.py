"""Demo: fine-tuning a bf16-pretrained model in fp16 (gradients overflow, loss scale collapses).

What it reproduces
    A model "as if pretrained in bf16": LayerNorm-free, with a wide dynamic
    range in its weights -- ``backbone.features`` has weights of std 500
    (entries ~1e2..1e3), so its activations sit around 1e3 (max ~6e3).  bf16
    never cared: it has fp32's range.  We fine-tune it with a fresh regression
    ``head`` on a new task.  The forward pass fits in fp16 (every activation
    is below 65504) and the LOSS is finite on every step, but the gradients
    are activations (~1e3) x output errors (~1e3) summed over the batch: the
    ``head`` weight gradient is ~6e5 and the ``backbone.stem`` gradient ~1e5
    even with NO loss scaling.

Why it fails in fp16
    fp16's largest finite value is 65504.  GradScaler sees inf gradients, skips
    the step and halves the scale -- and keeps doing so past 1.0: on this demo
    the first 20 updates are skipped and the scale ends at 0.0625 (65536 * 2^-20).
    A loss scale below 1 means the gradients themselves don't fit in fp16:
    small gradients now underflow to zero while the big ones still overflow.
    No ``--init-scale`` fixes this (``--init-scale 1`` still skips 4 updates
    and ends at 0.0625).  A model pretrained in bf16 should be fine-tuned in
    bf16: same 8-bit exponent, the same numbers are representable, and no
    loss scaling is needed.

Show the failure (20 skipped updates, scale 65536 -> 0.0625)
    amp-tui train demos/bf16_pretrained.py --dtype fp16 --steps 60
Fix (no skipped update, finite loss falling from ~4e5 to ~2e4)
    amp-tui train demos/bf16_pretrained.py --dtype bf16 --steps 60

Script options (ctx.argv; pass them after ``--``): ``--feature-std`` (std of
the pretrained ``backbone.features`` weights, default 500; at 100 the scale
only falls to 2), ``--width`` (default 64), ``--lr`` (default 1e-3).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Backbone(nn.Module):
    """Stand-in for a bf16-pretrained, LayerNorm-free feature extractor."""

    def __init__(self, in_dim: int, width: int, feature_std: float):
        super().__init__()
        self.stem = nn.Linear(in_dim, width)
        self.features = nn.Linear(width, width)
        with torch.no_grad():
            nn.init.normal_(self.features.weight, std=feature_std)

    def forward(self, x):
        return F.relu(self.features(F.relu(self.stem(x))))


class FineTuneModel(nn.Module):
    def __init__(self, in_dim: int, width: int, out_dim: int, feature_std: float):
        super().__init__()
        self.backbone = Backbone(in_dim, width, feature_std)
        self.head = nn.Linear(width, out_dim)  # new head, default init

    def forward(self, x):
        return self.head(self.backbone(x))


def _parse(argv):
    p = argparse.ArgumentParser(prog="bf16_pretrained.py")
    p.add_argument("--feature-std", type=float, default=500.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(list(argv or []))


def setup(ctx=None):
    args = _parse(getattr(ctx, "argv", None))
    torch.manual_seed(0)
    in_dim, out_dim, batch, n_batches = 32, 4, 64, 16

    # New fine-tuning task: smooth regression targets in [-1, 1].
    w_true = torch.randn(in_dim, out_dim) / in_dim ** 0.5
    batches = []
    for _ in range(n_batches):
        x = torch.randn(batch, in_dim)
        y = torch.tanh(x @ w_true)
        batches.append((x, y))

    model = FineTuneModel(in_dim, args.width, out_dim, args.feature_std)
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
