"""A seeded family of runs in which one value grows a steady factor a step until fp16 overflows
(bench/forecast_family.py measures the forecasts on them; tests/benchmarks asserts on a few).

Each scenario is a small model, an MLP of residual blocks or a transformer of attention blocks,
in which one block's value grows: at a module's output (a Linear of the block, `blocks.N.proj` or
the query's `blocks.N.q`) or inside the block's forward (the product `z * factor`, as attention
scores are computed), followed by a LayerNorm, a tanh or a softmax, so that nothing after it grows. The factor is
exp(theta), theta a parameter the optimizer raises by its learning rate each update (Adam on a
constant gradient moves by its lr; a skipped update doesn't move it), so the growth is a real
training's: it runs under any driver (`amp-tui train`, a monitored loop, the Lightning callback)
as the optimizer steps, and stops where an update is skipped.

The value starts at 2**start_bits and grows `rate` a step: fp16's max comes about
(16 - start_bits) / log2(1 + rate) updates later, give or take what the training does to the
value beneath the factor. The forecast is judged against the overflow the run recorded.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass

import torch
from torch import nn

MODELS = ("mlp", "transformer")
WHERE = ("output", "inside")
POSITIONS = ("early", "middle", "last")
AFTER = ("layernorm", "tanh", "softmax")
DRIVERS = ("monitor", "train", "lightning")
WIDTH, BLOCKS, SEQ, VOCAB, BATCH = 32, 4, 16, 64, 8
FP16_MAX_BITS = math.log2(65504.0)


@dataclass(frozen=True)
class Scenario:
    seed: int
    model: str = "mlp"
    where: str = "inside"
    position: str = "middle"
    after: str = "layernorm"
    rate: float = 0.02         # growth a step (0 for a healthy run)
    start_bits: float = 2.0    # log2 of the growing value's max |x| at the start
    dtype: str = "float16"
    driver: str = "monitor"

    @property
    def block(self) -> int:
        return {"early": 0, "middle": BLOCKS // 2, "last": BLOCKS - 1}[self.position]

    @property
    def module(self) -> str:
        """The module the forecast should name: the block (inside its forward, or one of its own)."""
        return f"blocks.{self.block}"

    def expected_overflow(self) -> int | None:
        """The update at which the value reaches fp16's max, as planted (None: never)."""
        if self.rate <= 0:
            return None
        return math.ceil((FP16_MAX_BITS - self.start_bits) / math.log2(1 + self.rate))

    def steps(self) -> int:
        """How long the scenario runs: past its planted overflow by a margin (the value beneath the
        factor moves with training), or 2,000 steps for a healthy run."""
        expected = self.expected_overflow()
        return 2000 if expected is None else int(expected * 1.25) + 60

    def argv(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(self).items() if k not in ("dtype", "driver")]

    @classmethod
    def from_argv(cls, argv) -> Scenario:
        p = argparse.ArgumentParser(prog="forecast_scenario.py")
        for name, default in asdict(cls(seed=0)).items():
            if name not in ("dtype", "driver"):
                p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
        return cls(**vars(p.parse_args(list(argv or []))))


def family(count: int, seed: int = 0, *, dtypes=("float16",), drivers=DRIVERS) -> list[Scenario]:
    """`count` scenarios, seeded: every model, place, position and what follows in turn, the rate
    log-uniform over 0.5%..5% a step, the start 1..4 bits, the driver in turn."""
    rng = random.Random(seed)
    combos = [(m, w, p, a) for m in MODELS for w in WHERE for p in POSITIONS for a in AFTER]
    rng.shuffle(combos)
    out = []
    for i in range(count):
        model, where, position, after = combos[i % len(combos)]
        rate = math.exp(rng.uniform(math.log(0.005), math.log(0.05)))
        out.append(Scenario(seed=seed * 1000 + i, model=model, where=where, position=position, after=after,
                            rate=round(rate, 4), start_bits=round(rng.uniform(1.0, 4.0), 2),
                            dtype=dtypes[i % len(dtypes)], driver=drivers[i % len(drivers)]))
    return out


# ---- the models ---------------------------------------------------------------------------------
class Drift(nn.Module):
    """A factor exp(theta) that the optimizer raises by its learning rate each update: `pull()` adds
    nothing to the loss and -1 to theta's gradient."""

    def __init__(self, theta: float):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(float(theta)))

    def factor(self) -> torch.Tensor:
        return self.theta.detach().exp()

    def pull(self) -> torch.Tensor:
        return self.theta.detach() - self.theta


class GrowingLinear(nn.Linear):
    """A Linear whose output grows by the drift's factor: the value at a module's output."""

    def __init__(self, d_in: int, d_out: int, factor):
        super().__init__(d_in, d_out)
        self.factor = factor   # the drift's, not the drift (a child here would name it twice)

    def forward(self, x):
        return super().forward(x) * self.factor()


def _linear(d_in: int, d_out: int, drift: Drift | None, where: str) -> nn.Linear:
    """The block's Linear whose output is the growing value where it grows at a module's output."""
    return GrowingLinear(d_in, d_out, drift.factor) if drift is not None and where == "output" \
        else nn.Linear(d_in, d_out)


def _after(kind: str, z: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
    if kind == "layernorm":
        return norm(z)
    if kind == "tanh":
        return torch.tanh(z)
    return torch.softmax(z, dim=-1)


class MlpBlock(nn.Module):
    """h + out(after(proj(h))): the projection's output grows (`output`: proj is a GrowingLinear,
    `blocks.N.proj`), or the product of it and the factor inside the forward (`inside`)."""

    def __init__(self, scenario: Scenario, drift: Drift | None):
        super().__init__()
        self.proj = _linear(WIDTH, WIDTH, drift, scenario.where)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH) if scenario.after == "layernorm" else None
        self.after = scenario.after
        self.factor = drift.factor if drift is not None and scenario.where == "inside" else None
        self.seen = None   # the model's record of the growing value (set on the growing block)

    def forward(self, h):
        z = self.proj(h)
        if self.factor is not None:
            z = z * self.factor()
        if self.seen is not None:
            self.seen(z)
        return h + self.out(_after(self.after, z, self.norm))


class AttentionBlock(nn.Module):
    """One head of attention whose scores q @ k^T / sqrt(d) grow: through the query projection's
    output (`output`: q is a GrowingLinear, `blocks.N.q`) or as the product inside the forward
    (`inside`, the shape of nanoGPT's and GPT-2's attention); then LayerNorm, tanh (a soft cap) or
    nothing before the softmax."""

    def __init__(self, scenario: Scenario, drift: Drift | None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q = _linear(WIDTH, WIDTH, drift, scenario.where)
        self.kv, self.out = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.norm = nn.LayerNorm(SEQ) if scenario.after == "layernorm" else None
        self.after = scenario.after
        self.factor = drift.factor if drift is not None and scenario.where == "inside" else None
        self.seen = None   # the model's record of the growing value (set on the growing block)

    def forward(self, x):
        h = self.ln1(x)
        q, (k, v) = self.q(h), self.kv(h).chunk(2, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(WIDTH)
        if self.factor is not None:
            scores = scores * self.factor()
        if self.seen is not None:
            self.seen(q, scores)
        if self.after != "softmax":
            scores = _after(self.after, scores, self.norm)
        x = x + self.out(torch.softmax(scores, dim=-1) @ v)
        return x + self.mlp(self.ln2(x))


class ScenarioModel(nn.Module):
    def __init__(self, scenario: Scenario):
        super().__init__()
        self.scenario = scenario
        self.drift = Drift(0.0)
        self.theta0 = 0.0
        block = MlpBlock if scenario.model == "mlp" else AttentionBlock
        self.inp = nn.Linear(WIDTH, WIDTH) if scenario.model == "mlp" else nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block(scenario, self.drift if i == scenario.block and scenario.rate > 0
                                          else None) for i in range(BLOCKS))
        self.head = nn.Linear(WIDTH, WIDTH if scenario.model == "mlp" else VOCAB)
        # The growing value's largest |x| by update (the updates theta has had): the truth the
        # forecasts are judged by, whatever the run recorded (a tanh after an overflow hides it).
        self.peaks: dict[int, float] = {}
        self._seen: list[torch.Tensor] = []
        if scenario.rate > 0:
            self.blocks[scenario.block].seen = self._see

    def _see(self, *values: torch.Tensor) -> None:
        """Kept as they are (a detach is a view, no op): measured after the forward (`loss`), where
        no probe of amp-tui's sees the measuring as an op of the block's."""
        if self.training and torch.is_grad_enabled():
            self._seen = [v.detach() for v in values]

    def _measure_seen(self) -> None:
        values, self._seen = self._seen, []
        if not values:
            return
        update = round((self.drift.theta.item() - self.theta0) / math.log1p(self.scenario.rate))
        peak = max(float(v.abs().max()) for v in values)
        self.peaks[update] = peak if math.isnan(peak) else max(self.peaks.get(update, 0.0), peak)

    def overflow_update(self) -> int | None:
        """The first update at which the growing value was past fp16's max (None: never; in bf16
        that is no overflow)."""
        over = [n for n, peak in self.peaks.items() if not peak < 65504.0]
        return min(over) if over else None

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        out = self(x).float()
        self._measure_seen()
        loss = (nn.functional.mse_loss(out, y) if self.scenario.model == "mlp"
                else nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)))
        return loss + self.drift.pull()


def _growing_value(model: ScenarioModel, x: torch.Tensor) -> float:
    """The growing value's max |x| at factor 1 (the start is set from it)."""
    block, seen = model.blocks[model.scenario.block], []
    with torch.no_grad():
        theta, model.drift.theta.data = model.drift.theta.data.clone(), torch.tensor(0.0)
        grows = block.proj if model.scenario.model == "mlp" else block.q
        hook = grows.register_forward_hook(lambda _m, args, out: seen.append((args[0], out)))
        model(x)
        hook.remove()
        model.drift.theta.data = theta
        h, z = seen[0]
        if model.scenario.model == "transformer":
            k = block.kv(h).chunk(2, dim=-1)[0]
            scores = z @ k.transpose(-2, -1) / math.sqrt(WIDTH)
            z = scores if model.scenario.where == "inside" else torch.maximum(z.abs().max(), scores.abs().max())
    return float(z.abs().max())


def build(scenario: Scenario):
    """The model, its batches, and an AdamW whose group for theta moves it ln(1 + rate) an update."""
    torch.manual_seed(scenario.seed)
    model = ScenarioModel(scenario)
    g = torch.Generator().manual_seed(scenario.seed)
    if scenario.model == "mlp":
        teacher = nn.Linear(WIDTH, WIDTH)
        batches = []
        for _ in range(16):
            x = torch.randn(BATCH, WIDTH, generator=g)
            with torch.no_grad():
                batches.append((x, torch.tanh(teacher(x))))
    else:
        batches = []
        for _ in range(16):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
            batches.append((tokens[:, :-1], tokens[:, 1:]))
    if scenario.rate > 0:
        start = _growing_value(model, batches[0][0])
        model.drift.theta.data.fill_(math.log(2.0 ** scenario.start_bits / max(start, 1e-6)))
    model.theta0 = model.drift.theta.item()
    theta = [model.drift.theta]
    rest = [p for p in model.parameters() if p is not model.drift.theta]
    optimizer = torch.optim.AdamW([{"params": rest, "lr": 1e-3},
                                   {"params": theta, "lr": math.log1p(scenario.rate), "weight_decay": 0.0}])
    return model, batches, optimizer
