"""The op trace next to `torch.autograd.detect_anomaly` and transformers' `DebugUnderflowOverflow`,
on planted faults in fp16 (CPU autocast), and what each costs.

For each planted case: whether the tool named the op and the module where the fault was made.
`detect_anomaly` raises at the first backward Function that returns NaN (it checks no forward
value, and no inf); `DebugUnderflowOverflow` raises at the first module whose forward output
holds inf or NaN (no backward). Then, side by side in one process, alternating each round:

- the cost on a healthy step (forward, scaled backward, optimizer step): the op trace runs only
  on a failing step, so its healthy-step cost is the RNG snapshot kept for the replay;
  detect_anomaly is on around the whole step; DebugUnderflowOverflow's hooks are on the model;
- the time to the answer on the failing step: the trace (and the fix tried on the same step),
  the step under anomaly mode until it raises, the forward until the hooks raise.

    python bench/op_trace.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from amp_tui.training.trace.op_fix import try_fixes  # noqa: E402
from amp_tui.training.trace.op_trace import rng_snapshot, trace_step  # noqa: E402
from bench import common  # noqa: E402

try:
    from transformers.debug_utils import DebugUnderflowOverflow
except ImportError:   # optional: the column says so
    DebugUnderflowOverflow = None

SCALE = 65536.0


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.d = d

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(self.d)
        return self.o(scores.softmax(-1) @ self.v(x))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = Attention(d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = self.norm(x + self.attn(x))
        return x + self.mlp(x)


class Transformer(nn.Module):
    def __init__(self, d=32, depth=2, classes=8):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MseHead(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, h, target):
        return F.mse_loss(self.proj(h), target)


class Regressor(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.body = nn.Linear(d, d)
        self.head = MseHead(d)

    def forward(self, x, target):
        return self.head(torch.relu(self.body(x)), target)


class ZeroOverZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        zero = x - x
        return grad * zero / zero


class Gate(nn.Module):
    def forward(self, x):
        return ZeroOverZero.apply(x)


class LogFeatures(nn.Module):
    def forward(self, x):
        return torch.log(x - 10.0)


def sequential(**modules) -> nn.Sequential:
    model = nn.Sequential()
    for name, module in modules.items():
        model.add_module(name, module)
    return model


# Each case: (name, phase, expected op, expected module, the Function detect_anomaly should name,
# build() -> (model, forward, scale)). forward() returns the loss.
def attention_case():
    model = Transformer()
    with torch.no_grad():
        model.blocks[1].attn.q.weight.mul_(200.0)
        model.blocks[1].attn.k.weight.mul_(200.0)
    x, y = torch.randn(2, 8, 32), torch.randint(0, 8, (2, 8))
    return model, lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()), SCALE


def loss_scale_case():
    model = Regressor()
    x, target = torch.randn(4, 16), torch.full((4, 16), 316.0)
    return model, lambda: model(x, target), SCALE


def zero_over_zero_case():
    model = sequential(lin=nn.Linear(16, 16), gate=Gate(), out=nn.Linear(16, 1))
    x = torch.randn(4, 16)
    return model, lambda: model(x).float().mean(), 1024.0


def log_case():
    model = sequential(lin=nn.Linear(16, 16), features=LogFeatures(), out=nn.Linear(16, 1))
    x = torch.randn(4, 16)
    return model, lambda: model(x).float().mean(), 1024.0


def tanh_case():
    model = sequential(wide=nn.Linear(16, 16), squash=nn.Tanh(), out=nn.Linear(16, 1))
    with torch.no_grad():
        model.wide.weight.fill_(2000.0)
    x = torch.rand(4, 16) + 2.0
    return model, lambda: model(x).float().mean(), 1024.0


CASES = [
    ("q·kᵀ overflow", "forward", "aten.bmm", "blocks.1.attn", "BmmBackward", attention_case),
    ("loss × scale", "backward", "aten._to_copy", "head", "ToCopyBackward", loss_scale_case),
    ("0/0 in backward", "backward", "aten.div", "gate", "ZeroOverZeroBackward", zero_over_zero_case),
    ("log(negative)", "forward", "aten.log", "features", "LogBackward", log_case),
    ("inf behind tanh", "forward", "aten.addmm", "wide", "AddmmBackward", tanh_case),
]


def fp16(forward):
    def run():
        with torch.autocast("cpu", dtype=torch.float16):
            return forward()
    return run


# ---- the three tools on a failing step: what they said, and how long it took ---------------------
def ours(model, forward, scale):
    start = time.perf_counter()
    trace = trace_step(model, forward, scale=scale, dtype="fp16")
    traced = time.perf_counter() - start
    fixed = try_fixes(model, forward, trace, scale=scale, dtype="fp16")
    return trace, fixed, traced, time.perf_counter() - start - traced


def anomaly(model, forward, scale):
    """(the Function named, seconds) — None when the step ran through."""
    start = time.perf_counter()
    named = None
    with contextlib.redirect_stderr(io.StringIO()), torch.autograd.detect_anomaly():
        try:
            (fp16(forward)() * scale).backward()
        except RuntimeError as error:
            found = re.search(r"Function '(\w+)'", str(error))
            named = found.group(1) if found else str(error)[:40]
    model.zero_grad(set_to_none=True)
    return named, time.perf_counter() - start


def underflow_overflow(model, forward):
    """(the module whose output it flagged, seconds) — None when the forward ran through. Its
    hooks stay on `model`: a fresh one for this tool alone."""
    if DebugUnderflowOverflow is None:
        return "n/a", math.nan
    DebugUnderflowOverflow(model)
    printed = io.StringIO()
    start = time.perf_counter()
    named = None
    try:
        with contextlib.redirect_stdout(printed):
            fp16(forward)()
    except ValueError:
        headers = re.findall(r"^ {18}(\S*) \w+$", printed.getvalue(), flags=re.MULTILINE)
        named = headers[-1] if headers else "?"
    return named, time.perf_counter() - start


# ---- the cost on a healthy step ------------------------------------------------------------------
def healthy_costs(rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    base = Transformer(d=64, depth=4, classes=16)
    x, y = torch.randn(8, 32, 64), torch.randint(0, 16, (8, 32))
    contenders = ["off", "op trace (RNG snapshot)", "detect_anomaly"] + \
        (["DebugUnderflowOverflow"] if DebugUnderflowOverflow is not None else [])
    setups = {}
    for name in contenders:
        model = copy.deepcopy(base)
        if name == "DebugUnderflowOverflow":
            DebugUnderflowOverflow(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        setups[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-4), scaler)

    def step(name):
        model, opt, scaler = setups[name]
        start = time.perf_counter()
        if name.startswith("op trace"):
            rng_snapshot()
        guard = torch.autograd.detect_anomaly() if name == "detect_anomaly" else contextlib.nullcontext()
        with guard, contextlib.redirect_stdout(io.StringIO()):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return time.perf_counter() - start

    times = {name: [] for name in contenders}
    for r in range(rounds + 3):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for name in order:
            elapsed = step(name)
            if r >= 3:   # warm-up rounds
                times[name].append(elapsed)
    costs = {name: common.median(ts) for name, ts in times.items()}
    model, _, scaler = setups["off"]
    replays = []
    for _ in range(5):   # the whole step traced: what a trace costs when no op is at fault
        start = time.perf_counter()
        trace_step(model, lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()), scale=1024.0, dtype="fp16")
        replays.append(time.perf_counter() - start)
    costs["the op trace itself (once, on a failing step)"] = common.median(replays)
    return costs


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    began = time.perf_counter()
    for build in (attention_case, loss_scale_case):   # first calls pay one-off costs: not timed
        model, forward, scale = build()
        ours(model, forward, scale)
        anomaly(model, forward, scale)

    rows = []
    for name, phase, op, module, function, build in CASES:
        torch.manual_seed(0)
        model, forward, scale = build()
        trace, fixed, traced, fixing = ours(model, forward, scale)
        torch.manual_seed(0)
        model_a, forward_a, _ = build()
        named_fn, anomaly_s = anomaly(model_a, forward_a, scale)
        torch.manual_seed(0)
        model_d, forward_d, _ = build()
        named_module, duo_s = underflow_overflow(model_d, forward_d)
        rows.append([
            name, phase,
            f"{trace.op} in {trace.op_module!r}" + (" ✓" if (trace.op, trace.op_module) == (op, module) else " ✗"),
            f"{ms(traced)} (+{ms(fixing)} fix: {fixed.fix}{' ✓' if fixed.fix_verified else ''})",
            f"{named_fn}" + (" ✓" if named_fn and named_fn.startswith(function) else " ✗"),
            ms(anomaly_s),
            f"{named_module!r}" + (" ✓" if named_module == module else " ✗") if named_module != "n/a" else "n/a",
            ms(duo_s),
        ])
    print("Planted faults, fp16 autocast on the CPU (✓: named the op / module where the fault was made)")
    print(common.table(rows, ["case", "phase", "op trace: op in module", "ms to answer",
                              "detect_anomaly names", "ms", "DebugUnderflowOverflow names", "ms"]))

    costs = healthy_costs(args.rounds)
    off = costs["off"]
    print(f"\nA healthy step (transformer d=64, 4 blocks, batch 8×32, one thread), median of {args.rounds}:")
    print(common.table([[name, ms(t), f"{t / off:.2f}×"] for name, t in costs.items()], ["tool on", "ms", "vs off"]))
    print(f"\n({time.perf_counter() - began:.1f} s in all; torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
