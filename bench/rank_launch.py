"""What the several-rank benchmarks (ddp_overhead.py, fsdp_overhead.py) share: their options, the
launch of their own file as the workers under torch.distributed.run (rank 0 writes the results as
JSON), the timing of their copies in turns on every rank, and their costs over the loop without
amp-tui, recorded and printed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def arguments(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="60 rounds")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.rounds = 60
    return args


def launch(script: str, args: argparse.Namespace, result: Path) -> dict | None:
    """Run `script --worker` on args.nproc ranks; rank 0's results, or None when the ranks failed."""
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               str(Path(script).resolve()), "--worker", "--result", str(result), "--backend", args.backend,
               "--dtype", args.dtype, "--rounds", str(args.rounds), "--warmup", str(args.warmup),
               "--depth", str(args.depth), "--width", str(args.width), "--batch", str(args.batch)]
    done = subprocess.run(command, env=env)
    if done.returncode != 0 or not result.exists():
        print(f"the ranks failed (exit {done.returncode})", file=sys.stderr)
        return None
    return json.loads(result.read_text())


def time_copies(copies: dict, coordinated: dict, *, every: int, rounds: int, warmup: int, clock, barrier) -> dict:
    """Each copy's step time, its median stratified by probed and unprobed steps (common.py): the
    copies run in turns, in an order shuffled the same on every rank, each step started together
    (`barrier`). `copies`: name -> (trainer, batches); `coordinated`: name -> the Ranks a copy
    steps with, as a Run does (the boundary's words, the figures gathered a step later)."""
    import random

    from bench import common

    due = dict.fromkeys(coordinated)   # each coordinated copy's last probed figures, on their way
    times = {name: [] for name in copies}
    probed = {name: [] for name in copies}
    order = random.Random(every)   # the same sequence on every rank: they run the same copy
    for i in range(warmup + rounds):
        names = list(copies)
        order.shuffle(names)
        for name in names:
            trainer, batches = copies[name]
            ranks = coordinated.get(name)
            barrier()
            t0 = clock()
            if ranks is not None:
                ranks.agree_commands(list)
            result = trainer.step([batches[i % len(batches)]])
            if ranks is not None:
                if due[name] is not None:
                    due[name]()   # as a Run: after the next step, when every rank has sent them
                if result.nonfinite is None:
                    due[name] = ranks.gather_later(result, trainer.layer_names)
                else:
                    due[name] = None
                    ranks.gather_step(result, trainer.layer_names, details=True)
            t1 = clock()
            if i >= warmup:
                times[name].append(t1 - t0)
                probed[name].append(result.figures is not None)
    for pending in due.values():
        if pending is not None:
            pending()
    return {name: common.stratified_median(times[name], probed[name], every) for name in copies}


def costs(median: dict, copies: tuple[str, ...], *, target: float, rounds: int) -> dict:
    """Each copy's step time over the first of `copies` (the loop without amp-tui), as the results
    record them: `<first>_ms`, and per copy its ms, cost in ms and share."""
    base = median[copies[0]]
    out = {f"{copies[0]}_ms": base * 1e3, "target_share": target, "rounds": rounds}
    for name in copies[1:]:
        out[name] = {"ms": median[name] * 1e3, "cost_ms": (median[name] - base) * 1e3,
                     "share": (median[name] - base) / base}
    return out


def print_costs(results: dict, copies: tuple[str, ...], *, judged: str, noise: str, header: list[str]) -> bool:
    """The results as a table, a row per schedule and copy; whether the `judged` copy met every
    target (`noise`: the bare loop run again, whose share is the run's own noise)."""
    from bench import common

    rows, met = [], True
    for every, r in results.items():
        for name in copies[1:]:
            c = r[name]
            ok = c["share"] <= r["target_share"]
            met = met and (ok or name != judged)
            verdict = "(noise)" if name == noise else "met" if ok else "NOT met"
            rows.append([f"every {every}", name, f"{r[copies[0] + '_ms']:.3f}", f"{c['ms']:.3f}",
                         f"{c['cost_ms']:+.3f}", f"{100 * c['share']:+.2f}%", f"<= {100 * r['target_share']:g}%",
                         verdict])
    print(common.table(rows, header=header))
    return met
