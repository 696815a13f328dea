"""Probe overhead: the engine with per-layer probes (and the session file) against a bare guarded loop.

Both sides run the same model, data and dtype in one process, alternating in blocks so that the
machine's noise hits both alike. Prints medians and the ratio of steps per second.

    python bench/probe_overhead.py [--dtype bf16] [--layers 24] [--width 512] [--batch 256]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from amp_tui.engine import GuardedTrainer
from amp_tui.run import BatchFeed, Run, RunConfig
from amp_tui.script import TrainSetup


def build(layers: int, width: int, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    data = [(torch.randn(batch, width), torch.randint(0, 10, (batch,))) for _ in range(8)]
    return model, data


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def measure(args) -> dict:
    model, data = build(args.layers, args.width, args.batch)
    bare_model = copy.deepcopy(model)
    bare = GuardedTrainer(bare_model, torch.optim.AdamW(bare_model.parameters(), lr=1e-4), loss_fn,
                          dtype=args.dtype, init_scale=1024.0, probe=False)
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-"))
    setups = {}
    for every in (1, 10):
        m = copy.deepcopy(model)
        setup = TrainSetup(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4), loss_fn=loss_fn,
                           batches=data)
        cfg = RunConfig(script=Path("bench.py"), dtype=args.dtype, init_scale=1024.0, probe_every=every,
                        run_dir=tmp / f"every{every}")
        run = Run(cfg, setup, torch.device("cpu"), BatchFeed(data, torch.device("cpu")))
        run.open()
        setups[every] = run
    times = {"bare": [], "probes every step": [], "probes every 10": []}
    feed_bare = BatchFeed(data, torch.device("cpu"))

    def block(name, fn):
        for _ in range(args.block):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)

    for _ in range(args.warmup):
        bare.step(feed_bare.take(1))
        setups[1]._one_step()
        setups[10]._one_step()
    for _ in range(args.rounds):
        block("bare", lambda: bare.step(feed_bare.take(1)))
        block("probes every step", setups[1]._one_step)
        block("probes every 10", setups[10]._one_step)
    for run in setups.values():
        run.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": f"{args.layers + 1} Linear layers, width {args.width}, batch {args.batch}",
        "dtype": args.dtype,
        "steps_each": len(times["bare"]),
        "median_step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        "ratio_every_step": round(med["bare"] / med["probes every step"], 4),
        "ratio_every_10": round(med["bare"] / med["probes every 10"], 4),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']}, {result['dtype']}, {result['steps_each']} steps each, alternating")
        for k, v in result["median_step_ms"].items():
            print(f"  {k:<20} {v:9.2f} ms/step")
        print(f"  steps/s ratio, probes every step / bare: {result['ratio_every_step']:.3f}")
        print(f"  steps/s ratio, probes every 10   / bare: {result['ratio_every_10']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
