"""What a live W&B or MLflow observer costs a monitored step: one `amp_tui.monitor` loop on each
bench model, its blocks of steps run in turn with no tracker, with an MLflow observer (SQLite
store) and with a W&B observer (offline), the order shuffled each round.

The three arms share one model, one optimizer and one monitor (one per process): both observers
stay in the recorder's observers behind a gate that hands each one the records of its own blocks'
steps only (a monitored loop hands on a step's record later than the step, so observers put in and
taken out around a block would miss their own records and get another's). Reported, per
tracker: the step-time cost against the block without one (the median
over rounds of the paired blocks' difference, with a 90% bootstrap interval), and, as an upper
bound, the CPU time the observer's own thread spent a step over the step's time, as if all of it
held the training thread up (on a machine with a core to spare it runs beside it). Target: <= 0.5%.

    python bench/tracker_overhead.py            # the bench models, 12 rounds of 50-step blocks
    python bench/tracker_overhead.py --quick    # a smaller model, fewer rounds
"""

from __future__ import annotations

import argparse
import os
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

TARGET_PCT = 0.5
ARMS = ("none", "mlflow", "wandb")
FULL = [(MlpSpec(depth=20, width=128, batch=64), "float16"), (GptSpec(layers=4, d_model=64), "float32"),
        (MlpSpec(depth=20, width=64, batch=64), "float16")]
QUICK = [(MlpSpec(depth=12, width=64, batch=32), "float16")]


def measure(spec, dtype: str, *, rounds: int, block: int, warmup: int, folder: Path) -> dict:
    import amp_tui
    from amp_tui.recording.trackers import open_observers

    model, batches, loss_fn, description = build(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=dtype == "float16")
    run_dir = folder / f"run-{len(list(folder.iterdir()))}"
    monitor = amp_tui.monitor(model, optimizer, scaler=scaler, run_dir=run_dir, dtype=dtype, announce=False,
                              control=False)
    observers = {"mlflow": open_observers(mlflow=f"sqlite:///{folder}/mlflow.db", run_dir=run_dir)[0],
                 "wandb": open_observers(wandb="amp-tui-bench", run_dir=run_dir)[0]}
    owner: dict[int, str] = {}           # step: the arm whose block ran it

    def gate(arm: str):
        observer = observers[arm]

        def hand_on(record: dict) -> None:
            step = record.get("step")
            if record.get("type") in ("step", "event") and owner.get(step) != arm:
                return
            observer(record)
        return hand_on

    monitor.controller.recorder.observers.extend(gate(arm) for arm in observers)
    i = 0

    def step() -> float:
        nonlocal i
        owner[i] = arm_now
        batch = batches[i % len(batches)]
        i += 1
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with monitor.step() as s:
            with monitor.autocast():
                loss = loss_fn(model, batch)
            s.loss = loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        return time.perf_counter() - started

    arm_now = "none"
    for _ in range(warmup):
        step()
    rng = random.Random(0)
    times = {arm: [] for arm in ARMS}           # per round: the block's total
    steps = {arm: 0 for arm in ARMS}
    for _ in range(rounds):
        order = list(ARMS)
        rng.shuffle(order)
        for arm in order:
            arm_now = arm
            times[arm].append(sum(step() for _ in range(block)))
            steps[arm] += block
    monitor.close()
    result = {"model": description, "dtype": dtype, "rounds": rounds, "block": block,
              "step_ms": common.rnd(1000 * common.median(times["none"]) / block)}
    for arm in ARMS[1:]:
        diffs = [(w - n) / n for w, n in zip(times[arm], times["none"])]
        low, high = common.bootstrap_interval(lambda idx, d=diffs: common.median([d[k] for k in idx]), len(diffs))
        mean_step = sum(times["none"]) / steps["none"]
        result[arm] = {"cost_pct": common.rnd(100 * common.median(diffs)),
                       "interval_pct": [common.rnd(100 * low), common.rnd(100 * high)],
                       "thread_cpu_pct": common.rnd(100 * observers[arm].busy_s / steps[arm] / mean_step),
                       "error": observers[arm].error}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = QUICK if args.quick else FULL
    rounds = args.rounds or (4 if args.quick else 12)
    results = []
    with tempfile.TemporaryDirectory(prefix="amp-tui-trackers-") as tmp:
        folder = Path(tmp)
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(folder))
        os.environ.setdefault("WANDB_SILENT", "true")
        for spec, dtype in cases:
            results.append(measure(spec, dtype, rounds=rounds, block=args.block, warmup=10, folder=folder))
    rows = []
    for r in results:
        for arm in ARMS[1:]:
            f = r[arm]
            rows.append([r["model"], r["dtype"], f"{r['step_ms']} ms", arm, f"{f['cost_pct']:+.2f}%",
                         f"[{f['interval_pct'][0]:+.2f}, {f['interval_pct'][1]:+.2f}]",
                         f"{f['thread_cpu_pct']:.2f}%", f["error"] or ""])
    print(common.table(rows, ["model", "dtype", "step", "tracker", "cost", "90% interval", "thread CPU", "error"]))
    worst = max(max(r[arm]["cost_pct"], r[arm]["thread_cpu_pct"]) for r in results for arm in ARMS[1:])
    print(f"worst of cost and thread CPU: {worst:.2f}% (target <= {TARGET_PCT}%)")
    path = common.write_results(ROOT, "tracker_overhead", {
        "machine": common.machine("cpu"), "versions": common.versions(), "results": results,
        "target_pct": TARGET_PCT})
    print(f"results: {path}")
    return 0 if worst <= TARGET_PCT else 1


if __name__ == "__main__":
    sys.exit(main())
