"""What a healthy step of the user's own loop pays for being replayable: the monitor keeping each
forward's inputs (references), RNG state and autocast dtype, and the gradient that reaches the
model's outputs (training/trace/forward_keeper.py). Target: <= 0.2% of the step.

Two figures per model, side by side in one process:
- paired: one monitored loop (the user guide's snippet, probes at the default schedule), one step
  with the keeping on and one with it off in each round, the order shuffled; the steps/s ratio
  from the paired times, with a 90% bootstrap interval (its width is the machine's noise);
- the hooks' own time: the keeper's pre- and post-forward hooks called on the model's real inputs
  and a fresh small output with a graph, minus making that output, median of many calls; as a share
  of the bare step (a precise figure where the paired one is noise-bound).

    python bench/kept_forwards.py            # the bench models, 200 rounds each
    python bench/kept_forwards.py --quick    # smaller models, fewer rounds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.models import GptSpec, MlpSpec, build  # noqa: E402
from bench.monitor_overhead import Loop  # noqa: E402

TARGET = 0.998   # <= 0.2% of the step
FULL = [(MlpSpec(depth=20, width=128, batch=64), "float32"), (GptSpec(layers=4, d_model=64), "float32"),
        (MlpSpec(depth=20, width=64, batch=64), "float16")]
QUICK = [(MlpSpec(depth=12, width=64, batch=32), "float16")]


def hooks_time(keeper, model, batch, *, calls: int = 2000) -> float:
    """Seconds per forward the keeper's two hooks take, on the model's real inputs."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    # The hooks' work doesn't depend on the output's size (a pre-hook on its node): a small one
    # keeps making it, which is subtracted, from drowning their time in its noise.
    base = torch.zeros(2, requires_grad=True)
    args = (x,)

    def timed(with_hooks: bool) -> float:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            out = base * 1.0   # a fresh output with a graph, as a forward returns
            if with_hooks:
                keeper._before(model, args, {})
                keeper._after(model, args, {}, out)
            times.append(time.perf_counter() - t0)
            keeper.drop()
        return common.median(times)
    keeping, keeper.keeping = keeper.keeping, (lambda: True)
    try:
        timed(True)   # warm up
        return max(0.0, timed(True) - timed(False))
    finally:
        keeper.keeping = keeping


def measure(spec, dtype: str, *, rounds: int, warmup: int = 5, seed: int = 0) -> dict:
    model, batches, loss_fn, description = build(spec, "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-kept-"))
    loop = Loop(copy.deepcopy(model), batches, loss_fn, dtype, monitor_every="auto", run_dir=tmp / "run")
    keeper = loop.monitor.driver.keeper
    keeping = keeper.keeping
    clock = common.Clock("cpu")
    rng = random.Random(seed)
    times = {True: [], False: []}
    try:
        for _ in range(warmup):
            loop.step()
        gc.collect()
        for _ in range(rounds):
            order = [True, False]
            rng.shuffle(order)
            for on in order:
                keeper.keeping = keeping if on else (lambda: False)
                t0 = clock()
                loop.step()
                times[on].append(clock() - t0)
        keeper.keeping = keeping
        per_forward = hooks_time(keeper, loop.model, batches[0])
    finally:
        keeper.keeping = keeping
        loop.close()

    def ratio(idx) -> float:
        off = common.median([times[False][i] for i in idx])
        over = common.median([times[True][i] - times[False][i] for i in idx])
        return off / (off + over)

    lo, hi = common.bootstrap_interval(ratio, rounds)
    step = common.median(times[False])
    return {"model": spec.name, "description": description, "dtype": dtype, "rounds": rounds,
            "monitored_step_ms": common.rnd(step * 1e3), "steps_per_s_ratio": common.rnd(ratio(list(range(rounds))), 4),
            "ratio_90ci": [common.rnd(lo, 4), common.rnd(hi, 4)],
            "hooks_us_per_forward": common.rnd(per_forward * 1e6, 2),
            # three significant digits, not decimals: on a loaded machine the share can be under 0.0005%
            "hooks_share_pct": float(f"{100 * per_forward / step:.3g}"), "target_share_pct": 0.2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = QUICK if args.quick else FULL
    rounds = args.rounds or (60 if args.quick else 200)
    load_at_start = common.load_average()
    results, rows = [], []
    for spec, dtype in cases:
        r = measure(spec, dtype, rounds=rounds)
        results.append(r)
        lo, hi = r["ratio_90ci"]
        verdict = "PASS" if r["hooks_share_pct"] <= r["target_share_pct"] else "MISS"
        rows.append([verdict, f"{r['model']} {dtype}", f"{r['monitored_step_ms']} ms",
                     f"{r['hooks_us_per_forward']} µs ({r['hooks_share_pct']:.3g}%)",
                     f"{r['steps_per_s_ratio']:.4f} (90% CI {lo:.4f}..{hi:.4f})"])
    print("The monitor keeping each forward for a replay: its hooks' own time, and kept vs not (paired steps)")
    print(common.table(rows, ["", "model", "monitored step", "hooks per forward", "paired ratio"]))
    print(f"target: the hooks at most 0.2% of the step; load average at start {load_at_start}, "
          f"at end {common.load_average()}")
    if args.json:
        args.json.write_text(json.dumps({"machine": common.machine("cpu"), "versions": common.versions(),
                                         "date": common.now_iso(), "load_average_at_start": load_at_start,
                                         "load_average_at_end": common.load_average(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
