"""Does the filter hold? A small model with one Linear layer whose input carries a few massive
channels (planted, as large language models grow them), the fp8 what-if's verdict on it, and three
copies trained from the same init on the same batches, on the CPU:

- `bf16`: bf16 autocast, the baseline;
- `fp8 filtered`: torchao's `convert_to_float8_training` (emulated fp8, the default tensorwise
  recipe) with the `module_filter_fn` of the file the what-if wrote, under bf16 autocast;
- `fp8 all`: the same with every Linear converted (torchao's own shape rule only: both dimensions
  of the weight multiples of 16).

    python bench/fp8_filter.py --plot       # 300 steps; a sweep of 4 magnitudes x 5 seeds; the cost
    python bench/fp8_filter.py --quick      # 120 steps; 2 x 2; the cost at two sizes

Prints, and writes as JSON to bench/results/ (`*-fp8-filter.json`; with --plot the loss curves to
docs/images/fp8-filter-holds.png):
- the verdict: the layers the what-if keeps in bf16, and whether that is exactly the planted one;
- the drift of each fp8 run from the baseline: the mean |loss - bf16 loss| over the last 100 steps
  (the last third of a shorter run), absolute and relative to the bf16 loss there, and how many
  times further the unfiltered run drifts than the filtered one;
- the same over a sweep of the planted magnitude and the seed;
- the what-if's cost: one `fp8_whatif` call over the median bf16 training step of the same model,
  measured interleaved in the same process, at a few batch sizes.

The model is a stack of MLP blocks, LN -> fc1 -> GELU -> (x gain) -> fc2 -> LN, without residuals,
so that each layer is on the one path. `gain` is 1 but on a few channels of the planted block's
fc2 input, where it is `factor`; the LayerNorm after fc2 keeps the rest of the model normal. The
weight columns of fc2 that take those channels are divided by the same factor at init and held
there (their gradient zeroed, in every run alike), so that in exact arithmetic they weigh like any
other channel: what the massive channels change is how the layer's input casts to fp8 (one scale
for the tensor, set by them, and the rest of the input pushed down into e4m3's subnormals).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from amp_tui.recording.fp8_file import filter_source, kept  # noqa: E402
from amp_tui.training.fp8.layers import load_filter, shape_fits  # noqa: E402
from amp_tui.training.fp8.whatif import fp8_whatif  # noqa: E402
from bench import common  # noqa: E402

PLOT = ROOT / "docs" / "images" / "fp8-filter-holds.png"
RUNS = ("bf16", "fp8 filtered", "fp8 all")


@dataclass
class Setup:
    seed: int = 0
    steps: int = 300
    width: int = 64          # between the blocks
    hidden: int = 128        # each block's MLP
    blocks: int = 3
    planted_block: int = 1   # its fc2's input carries the massive channels
    channels: tuple = (7, 61, 100)
    factor: float = 3e4
    inputs: int = 64
    outputs: int = 16
    batch: int = 128
    samples: int = 4096
    lr: float = 1e-3
    tail: int = 100          # the steps the drift is averaged over (the last third if fewer than 3x)
    repeats: int = 7         # rounds of the cost's measurement

    @property
    def planted(self) -> str:
        return f"blocks.{self.planted_block}.fc2"


class Block(nn.Module):
    """LN(fc2(gelu(fc1(LN(x))) * gain)): an MLP between two LayerNorms. `gain` is 1 but on the
    planted channels."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)
        self.out_norm = nn.LayerNorm(width)
        self.register_buffer("gain", torch.ones(hidden))

    def forward(self, x):
        return self.out_norm(self.fc2(self.act(self.fc1(self.norm(x))) * self.gain))


class Net(nn.Module):
    def __init__(self, setup: Setup):
        super().__init__()
        self.embed = nn.Linear(setup.inputs, setup.width)
        self.blocks = nn.ModuleList(Block(setup.width, setup.hidden) for _ in range(setup.blocks))
        self.norm = nn.LayerNorm(setup.width)
        self.head = nn.Linear(setup.width, setup.outputs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(setup: Setup):
    """The model (seeded init, the massive channels planted), the data (a seeded teacher's
    regression targets), and the mask that holds the planted columns."""
    torch.manual_seed(setup.seed)
    model = Net(setup)
    block = model.blocks[setup.planted_block]
    channels = list(setup.channels)
    with torch.no_grad():
        block.gain[channels] = setup.factor
        block.fc2.weight[:, channels] /= setup.factor
    generator = torch.Generator().manual_seed(setup.seed + 1)
    x = torch.randn(setup.samples, setup.inputs, generator=generator)
    teacher = [torch.randn(setup.inputs, setup.hidden, generator=generator) / math.sqrt(setup.inputs),
               torch.randn(setup.hidden, setup.outputs, generator=generator) / math.sqrt(setup.hidden)]
    y = torch.tanh(x @ teacher[0]) @ teacher[1]
    y = y + 0.05 * torch.randn(y.shape, generator=generator)
    order = torch.randperm(setup.samples, generator=generator)
    batches = [(x[order[i:i + setup.batch]], y[order[i:i + setup.batch]])
               for i in range(0, setup.samples - setup.batch + 1, setup.batch)]
    held = torch.ones_like(block.fc2.weight)
    held[:, channels] = 0.0
    return model, batches, held


def loss_of(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def whatif(model, batch) -> dict:
    return fp8_whatif(model, lambda: loss_of(model, batch), dtype="bf16")


def emitted_filter(source: str, folder: Path):
    """The filter file's module_filter_fn, loaded as `--fp8-filter` loads it."""
    path = folder / "fp8_filter.py"
    path.write_text(source, encoding="utf-8")
    return load_filter(path)


def shape_rule(module: nn.Module, fqn: str) -> bool:
    """torchao's own rule and nothing else: every Linear whose weight's dimensions are multiples of 16."""
    return isinstance(module, nn.Linear) and shape_fits(module)


def converted(model, module_filter_fn):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = copy.deepcopy(model)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True), module_filter_fn=module_filter_fn)
    return model


def fp8_layers(model) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def train(model, batches, held, setup: Setup, times: list | None = None, autocast: bool = True) -> list[float]:
    """`setup.steps` steps of Adam under bf16 autocast (or none); the loss of each (and the time of
    each in `times`)."""
    planted = dict(model.named_modules())[setup.planted].weight
    optimizer = torch.optim.Adam(model.parameters(), lr=setup.lr)
    losses = []
    for i in range(setup.steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model, batches[i % len(batches)])
        loss.backward()
        planted.grad.mul_(held)
        optimizer.step()
        if times is not None:
            times.append(time.perf_counter() - started)
        losses.append(loss.detach().item())
    return losses


def drift(losses: list[float], baseline: list[float], tail: int) -> dict:
    a, b = losses[-tail:], baseline[-tail:]
    absolute = statistics.fmean(abs(x - y) for x, y in zip(a, b))
    level = statistics.fmean(b)
    finite = all(math.isfinite(x) for x in a)
    return {"mean_abs": absolute if finite else None, "relative": absolute / level if finite else None,
            "final_mean": statistics.fmean(a) if finite else None}


def cost(setup: Setup) -> dict:
    """One what-if call against one bf16 training step of the same model, interleaved in the same
    process: `repeats` rounds of 10 training steps and one what-if call; the median of each."""
    model, batches, held = build(setup)
    whatif(model, batches[0])                                        # warm both up
    train(model, batches, held, replace(setup, steps=5))
    step_times, whatif_times = [], []
    for r in range(setup.repeats):
        train(model, batches, held, replace(setup, steps=10), step_times)
        started = time.perf_counter()
        whatif(model, batches[r % len(batches)])
        whatif_times.append(time.perf_counter() - started)
    step, call = statistics.median(step_times), statistics.median(whatif_times)
    return {"batch": setup.batch, "width": setup.width, "hidden": setup.hidden, "step_median_s": step,
            "whatif_median_s": call, "ratio_steps": call / step, "whatif_s": whatif_times,
            "steps_timed": len(step_times)}


def run(setup: Setup, *, reference: bool = False) -> dict:
    """The verdict on the model as built, the filter it implies, and the three runs' losses; with
    `reference`, also the drift of a float32 run (no autocast) from the bf16 one, for scale."""
    model, batches, held = build(setup)
    found = whatif(model, batches[0])
    held_bf16 = kept(found)
    with tempfile.TemporaryDirectory() as tmp:
        module_filter_fn = emitted_filter(filter_source(found, step=0, run="bench/fp8_filter.py"), Path(tmp))
    copies = {"bf16": copy.deepcopy(model), "fp8 filtered": converted(model, module_filter_fn),
              "fp8 all": converted(model, shape_rule)}
    losses = {name: train(m, batches, held, setup) for name, m in copies.items()}
    tail = min(setup.tail, max(1, setup.steps // 3))
    drifts = {name: drift(losses[name], losses["bf16"], tail) for name in RUNS[1:]}
    if reference:
        drifts["fp32 (for scale)"] = drift(train(copy.deepcopy(model), batches, held, setup, autocast=False),
                                           losses["bf16"], tail)
    f, a = drifts["fp8 filtered"]["mean_abs"], drifts["fp8 all"]["mean_abs"]
    crest = next((r["crest_bits"] for r in found["rows"] if r["module"] == setup.planted
                  and r["tensor"] == "input" and r["format"] == "e4m3" and r["scaling"] == "tensorwise"), None)
    return {
        "setup": asdict(setup) | {"planted": setup.planted},
        "planted_input_crest_bits": crest,
        "verdict": found["verdict"], "kept_bf16": held_bf16,
        "exactly_planted": sorted(held_bf16) == [setup.planted],
        "converted": {name: fp8_layers(m) for name, m in copies.items() if name != "bf16"},
        "tail": tail, "drift": drifts,
        # how many times further the unfiltered run drifts (None where a run went non-finite)
        "all_over_filtered": a / f if a is not None and f else None,
        "losses": losses,
    }


def sweep(setup: Setup, factors, seeds) -> list[dict]:
    rows = []
    for factor in factors:
        for seed in seeds:
            r = run(replace(setup, factor=factor, seed=seed))
            rows.append({"factor": factor, "seed": seed, "crest_bits": r["planted_input_crest_bits"],
                         "exactly_planted": r["exactly_planted"], "kept_bf16": sorted(r["kept_bf16"]),
                         "filtered_relative": r["drift"]["fp8 filtered"]["relative"],
                         "all_relative": r["drift"]["fp8 all"]["relative"],
                         "all_over_filtered": r["all_over_filtered"]})
            print(f"  factor {factor:>8g} seed {seed}: crest {rows[-1]['crest_bits']} b, kept {rows[-1]['kept_bf16']}, "
                  f"drift filtered {_pct(rows[-1]['filtered_relative'])}, all {_pct(rows[-1]['all_relative'])}, "
                  f"ratio {_num(rows[-1]['all_over_filtered'])}", flush=True)
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(result: dict, path: Path) -> None:
    """The three loss curves, and under them each fp8 run's loss against the bf16 one's (a running
    mean over 10 steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = result["losses"]
    steps = len(losses["bf16"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 5.6), dpi=120, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    colors = {"bf16": "black", "fp8 filtered": "tab:blue", "fp8 all": "tab:red"}
    words = {"bf16": "bf16 autocast", "fp8 filtered": "fp8, the what-if's filter", "fp8 all": "fp8, every Linear"}
    for ax in (top, bottom):
        ax.axvspan(steps - result["tail"], steps, color="0.93", zorder=0)
    for name in RUNS:
        d = result["drift"].get(name) if name != "bf16" else None
        label = words[name] + ("" if d is None else f" (drift {_pct(d['relative'])})")
        top.plot(range(1, steps + 1), losses[name], color=colors[name], linewidth=1.0, label=label)
        if name != "bf16":
            ratio = [x / y - 1 for x, y in zip(losses[name], losses["bf16"])]
            smooth = [statistics.fmean(ratio[max(0, i - 9):i + 1]) for i in range(steps)]
            bottom.plot(range(1, steps + 1), [100 * v for v in smooth], color=colors[name], linewidth=1.2)
    bottom.axhline(0, color="black", linewidth=0.8)
    top.set_yscale("log")
    top.set_ylabel("training loss (MSE)")
    bottom.set_ylabel("vs bf16 (%)")
    bottom.set_xlabel("step")
    s = result["setup"]
    top.set_title(f"{len(s['channels'])} input channels of {s['planted']} x{s['factor']:g}. Drift: mean "
                  f"|loss - bf16 loss| / bf16 loss, shaded steps", fontsize=9)
    top.legend(frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="120 steps, a smaller sweep, 3 repeats of the cost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--factor", type=float, default=Setup.factor)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", action="store_true", help=f"write {PLOT.relative_to(ROOT)}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps, repeats = (120, 3) if args.quick else (300, 7)
    setup = Setup(seed=args.seed, factor=args.factor, steps=steps, repeats=repeats)
    result = run(setup, reference=True)
    print(f"kept in bf16: {result['kept_bf16']}")
    print(f"exactly the planted {setup.planted}: {result['exactly_planted']}  "
          f"(its input's crest {result['planted_input_crest_bits']} bits)")
    for name, d in result["drift"].items():
        print(f"  {name:<16} drift over the last {result['tail']} steps: {d['mean_abs']:.3g} "
              f"({_pct(d['relative'])} of the bf16 loss there), its loss there {d['final_mean']:.4g}")
    print(f"  bf16             loss there {statistics.fmean(result['losses']['bf16'][-result['tail']:]):.4g}")
    print(f"  fp8 all drifts {_num(result['all_over_filtered'])}x as far as fp8 filtered")
    print("sweep:")
    factors = (1e4, 3e4) if args.quick else (1e3, 1e4, 3e4, 1e5)
    seeds = (0, 1) if args.quick else (0, 1, 2, 3, 4)
    result["sweep"] = sweep(setup, factors, seeds)
    print("cost:")
    result["cost"] = []
    for batch in ((128, 512) if args.quick else (128, 512, 2048)):
        c = cost(replace(setup, batch=batch, samples=max(setup.samples, 4 * batch)))
        result["cost"].append(c)
        print(f"  batch {batch:>5}: what-if {c['whatif_median_s'] * 1e3:.1f} ms, bf16 step "
              f"{c['step_median_s'] * 1e3:.2f} ms: {c['ratio_steps']:.1f} steps", flush=True)
    out = {"when": common.now_iso(), "machine": common.machine("cpu"), "versions": common.versions(),
           "checkout": common.checkout(ROOT)} | result
    try:
        out["versions"]["torchao"] = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        out["versions"]["torchao"] = None
    path = common.write_results(ROOT, f"fp8-filter{'-quick' if args.quick else ''}", out)
    print(f"written: {path.relative_to(ROOT)}")
    if args.plot:
        plot(result, PLOT)
        print(f"written: {PLOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
