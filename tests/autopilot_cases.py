"""Models of our own for the autopilot (`--on-nonfinite isolate`): attention scores that overflow
fp16 (bf16 and fp32 hold them), trained with `amp-tui train` (`setup()`) or in a loop of the user's
own under `amp_tui.monitor` (`loop()`); the benchmark in bench/ trains the same case."""

# q and k are scaled up at init: their products, the attention scores, reach a few 1e5 from the
# first step on (fp16's max is 65504), and stay there while the rest of the model learns.
_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

D, T, C = 16, 8, 4
STEPS = 40
LR = 0.05

{attention}
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.attn = Attention()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.norm(h + self.attn(h)))

def data():
    torch.manual_seed(1)
    teacher = torch.randn(D, C)
    shards = []
    for _ in range(8):
        x = torch.randn(8, T, D)
        shards.append((x, (x @ teacher).argmax(-1)))
    return [shards[i % len(shards)] for i in range(STEPS)]

def build():
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        model.attn.q.weight.mul_(300.0)
        model.attn.k.weight.mul_(300.0)
    return model, torch.optim.SGD(model.parameters(), lr=LR)

def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

def setup(ctx=None):
    model, optimizer = build()
    return {"model": model, "optimizer": optimizer, "loss_fn": loss_fn, "batches": data()}

def loop(run_dir, replay=True, **monitor_kw):
    """The same training in a loop of one's own, under the monitor: the losses, in order. Without
    `replay`, no failing step is replayed to its op (as with several ranks): the probes' first
    non-finite layer is all the event names."""
    import amp_tui
    model, optimizer = build()
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, optimizer, scaler=scaler, run_dir=run_dir, announce=False,
                              control=False, **monitor_kw)
    monitor.driver.replay_failing = replay
    losses = []
    for batch in data():
        optimizer.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = loss_fn(model, batch)
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        losses.append(float(loss.detach()))
    monitor.close()
    return monitor, losses
'''

ATTENTION = _MODEL.replace("{attention}", '''
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        # The temperature comes after the product, which fp16 can't hold: the softmax sees
        # scores of a few units, in fp32 and bf16 alike.
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / 1e5
        return self.o(scores.softmax(-1) @ self.v(x))
''')

# The scores come from a module of their own: in fp32 they are finite, but the product with v, in
# fp16 in the attention, can't take them: only the attention as a whole in fp32 makes the step finite.
WIDENING = _MODEL.replace("{attention}", '''
class Scores(nn.Module):
    def forward(self, q, k):
        return q @ k.transpose(-2, -1)

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        self.scores = Scores()

    def forward(self, x):
        return (self.scores(self.q(x), self.k(x)) @ self.v(x) / 1e5).softmax(-1)
''')

# The loss (~1e5) is finite in fp16; times the scale (65536) its gradient is not.
LARGE_LOSS = '''
import torch
import torch.nn.functional as F
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    batches = [(torch.randn(4, 16), torch.full((4, 16), 316.0)) for _ in range(4)]
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": lambda model, batch: F.mse_loss(model(batch[0]), batch[1]), "batches": batches}
'''

# Step 4's inputs (OVERFLOW_AT) are 400 times larger: the attention's scores overflow fp16 there only.
# From step 6 on the targets are thirty times larger, so the loss after the isolation grows far past
# its level before it (lr 0: the weights never move, the data alone decides).
DIVERGING = '''
import torch
import torch.nn.functional as F
from torch import nn

D = 16
OVERFLOW_AT = 4

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / 1e5
        return self.o(scores.softmax(-1) @ self.v(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.attn = Attention()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.attn(self.embed(x))).mean(1)

def setup(ctx=None):
    torch.manual_seed(0)
    model = Model()
    batches = []
    for i in range(12):
        x, y = torch.randn(4, 8, D), torch.randn(4, 1)
        batches.append((x * 400.0 if i == OVERFLOW_AT else x, y * 30.0 if i >= 6 else y))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": lambda model, batch: F.mse_loss(model(batch[0]), batch[1]), "batches": batches}
'''
