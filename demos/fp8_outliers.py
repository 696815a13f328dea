"""Demo: which layers can train in fp8? A model with one layer behind massive channels.

What it shows
    Four MLP blocks (LayerNorm -> Linear -> GELU -> Linear -> LayerNorm) on a
    regression task. In block 2, three channels of the second Linear's input
    are 10^4 times larger than the rest, as large language models grow them
    ("massive activations"). Cast to e4m3 with one scale for the tensor, those
    channels set the scale and push the rest of that input into e4m3's
    subnormals: the tensor's SQNR still reads ~31 dB, but its typical value
    sits ~16 bits under its largest. The fp8 what-if keeps exactly that layer
    (blocks.2.fc2) in bf16 and passes the other nine.

Run it
    amp-tui fp8 demos/fp8_outliers.py --step 10     # the verdict and the torchao filter
    amp-tui train demos/fp8_outliers.py --dtype bf16 # then press 8 for the what-if of the next step

    amp-tui train demos/fp8_outliers.py --dtype bf16 --headless --steps 1000 \
        --fp8-every 100 -- --factor 30 --grow 1.005
        # outliers that grow as it trains: the report says when the layer turned

Script options (ctx.argv; pass them after ``--``): ``--factor`` (the planted
channels' gain, default 1e4), ``--grow`` (their gain multiplied by this at every
training forward, default 1: fixed).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.out_norm = nn.LayerNorm(width)
        self.register_buffer("gain", torch.ones(hidden))
        self.grow = 1.0

    def forward(self, x):
        if self.training and self.grow != 1.0:
            with torch.no_grad():
                self.gain[self.gain != 1] *= self.grow
        return self.out_norm(self.fc2(F.gelu(self.fc1(self.norm(x))) * self.gain))


class Net(nn.Module):
    def __init__(self, width=64, hidden=128, blocks=4, inputs=32, outputs=16):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def setup(ctx=None):
    parser = argparse.ArgumentParser(prog="fp8_outliers.py")
    parser.add_argument("--factor", type=float, default=1e4)
    parser.add_argument("--grow", type=float, default=1.0)
    args = parser.parse_args(list(getattr(ctx, "argv", None) or []))
    torch.manual_seed(0)
    model = Net()
    planted = model.blocks[2]
    with torch.no_grad():
        planted.gain[[5, 40, 99]] = args.factor
        # The columns that read them weigh like the others in exact arithmetic.
        planted.fc2.weight[:, [5, 40, 99]] /= args.factor
    planted.grow = args.grow
    teacher = torch.randn(32, 16) / 32 ** 0.5
    batches = []
    for _ in range(16):
        x = torch.randn(128, 32)
        batches.append((x, torch.tanh(x @ teacher)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    return {"model": model, "optimizer": optimizer, "loss_fn": loss_fn, "batches": batches}
