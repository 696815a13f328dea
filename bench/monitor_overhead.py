"""What `amp_tui.monitor` costs a loop of the user's own: the same loop, with and without the
monitor, alternating in one process (the order shuffled each round), on the benchmark models.

Each loop runs a block of 10 consecutive steps in turn (`block`): a loop alone runs its own code,
and the monitor's, on every step, where one step of each in turn left it cold for the next. Both
loops train **one copy of the model with one AdamW** (each with its GradScaler): with a copy of
its own each, two loops without any monitor differed by 1.8% on the GPT, where the copies lay in
memory, more than the 1% being measured. The monitor's hooks on the shared model and optimizer
are taken off before the bare loop's block and put back before the monitored one's, both out of
the timed part, so that the bare loop runs none of them.

The loop is the snippet of the user guide (autocast forward, scaled backward, unscale_, clip,
scaler.step, update). Only one loop has a
monitor (one per process), with probes every step, then (a second pass) every 10 steps, then (a
third) with the default, the adaptive schedule (probe_every="auto", 1% budget). Reported: the
steps/s ratio monitored / bare from the paired step times, with a 90% bootstrap interval, and the
share of the steps probed. Targets: >= 0.95 with probes every step, >= 0.99 every 10 and with the
default.

    python bench/monitor_overhead.py            # the bench models, 12 rounds of 10-step blocks each
    python bench/monitor_overhead.py --quick    # smaller models, fewer rounds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.models import GptSpec, MlpSpec, build  # noqa: E402

TARGETS = {1: 0.95, 10: 0.99, "auto": 0.99}
EVERY = (1, 10, "auto")   # "auto": the default, the adaptive schedule at its 1% budget
FULL = [(MlpSpec(depth=20, width=128, batch=64), "float32"), (GptSpec(layers=4, d_model=64), "float32"),
        (MlpSpec(depth=20, width=64, batch=64), "float16")]
QUICK = [(MlpSpec(depth=12, width=64, batch=32), "float32"), (MlpSpec(depth=12, width=64, batch=32), "float16")]


class Loop:
    """The model trained by the user-guide snippet, with or without a monitor (`optimizer`: one
    shared with another loop; None: an AdamW of its own)."""

    def __init__(self, model, batches, loss_fn, dtype: str, *, monitor_every: int | None, run_dir: Path,
                 optimizer=None):
        import amp_tui

        self.model, self.batches, self.loss_fn = model, batches, loss_fn
        self.optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=dtype == "float16")
        self.dtype = getattr(torch, dtype)
        self.autocast_on = dtype != "float32"
        self.monitor = (amp_tui.monitor(model, self.optimizer, scaler=self.scaler, run_dir=run_dir,
                                        probe_every=monitor_every, dtype=dtype, announce=False)
                        if monitor_every else None)
        self.i = 0
        self.aside = False   # the monitor's hooks are off (set_aside)
        self.times: list[float] = []
        self.probed: list[bool] = []

    def probing(self) -> bool:
        """Whether the coming step is probed (the monitor's own schedule, fixed or adaptive)."""
        return self.monitor is not None and self.monitor.driver.probing()

    def set_aside(self) -> None:
        """The monitor's hooks off the shared model and optimizer (the probes' too, where the
        next step is probed: its block puts them back on), for the other loop's steps."""
        if self.monitor is not None and not self.aside:
            self.monitor.driver.detach()
            self.monitor.driver.probe.end()
            self.aside = True

    def put_back(self) -> None:
        if self.aside:
            self.monitor.driver.attach()
            self.aside = False

    def step(self) -> None:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.monitor is None:
            with torch.autocast("cpu", dtype=self.dtype, enabled=self.autocast_on):
                loss = self.loss_fn(self.model, batch)
            self._update(loss)
            loss.item()   # the bare loop reads its loss too, as a logging loop does
            return
        with self.monitor.step() as step:
            with self.monitor.autocast():
                loss = self.loss_fn(self.model, batch)
            step.loss = loss
            self._update(loss)

    def _update(self, loss) -> None:
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def measure(spec, dtype: str, every: int, *, rounds: int, warmup: int = 5, block: int = 10,
            seed: int = 0) -> dict:
    model, batches, loss_fn, description = build(spec, "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-monitor-"))
    shared = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(shared.parameters(), lr=1e-4)
    bare = Loop(shared, batches, loss_fn, dtype, monitor_every=None, run_dir=tmp / "bare", optimizer=optimizer)
    watched = Loop(shared, batches, loss_fn, dtype, monitor_every=every, run_dir=tmp / "run", optimizer=optimizer)
    clock = common.Clock("cpu")
    rng = random.Random(seed)
    order = [bare, watched]
    try:
        def turn(loop: Loop) -> None:
            (watched.put_back if loop is watched else watched.set_aside)()

        for _ in range(warmup):
            for loop in order:
                turn(loop)
                loop.step()
        gc.collect()
        for _ in range(rounds):
            rng.shuffle(order)
            for loop in order:
                turn(loop)
                for _ in range(block):
                    probed = loop.probing()
                    t0 = clock()
                    loop.step()
                    loop.times.append(clock() - t0)
                    loop.probed.append(probed)
    finally:
        watched.close()

    def own(loop: Loop, idx) -> float:
        return common.stratified_median([loop.times[i] for i in idx], [watched.probed[i] for i in idx], every)

    def ratio(idx) -> float:
        diffs = [watched.times[i] - bare.times[i] for i in idx]
        over = common.stratified_median(diffs, [watched.probed[i] for i in idx], every)
        base = own(bare, idx)
        return base / (base + over)

    steps = rounds * block
    everything = list(range(steps))
    lo, hi = common.bootstrap_interval(ratio, steps)
    return {"model": spec.name, "description": description, "dtype": dtype, "probe_every": every,
            "rounds": rounds, "block": block, "bare_step_ms": common.rnd(own(bare, everything) * 1e3),
            "monitored_step_ms": common.rnd(own(watched, everything) * 1e3),
            "steps_per_s_ratio": common.rnd(ratio(everything), 4),
            "ratio_90ci": [common.rnd(lo, 4), common.rnd(hi, 4)], "target": TARGETS[every],
            **schedule_figures(watched.monitor.driver.probe_schedule, watched.probed)}


def schedule_figures(schedule, probed: list[bool]) -> dict:
    """How often the steps were probed, and the schedule's own view of its cost."""
    return {"probed_share": common.rnd(sum(probed) / max(1, len(probed)), 4),
            "schedule_interval": schedule.interval(),
            "schedule_share_pct": common.rnd(100 * schedule.share(), 2)}


def probes_label(every) -> str:
    return "auto (default)" if every == "auto" else f"probes every {every}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None, help="rounds of 10-step blocks per case")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = QUICK if args.quick else FULL
    rounds = args.rounds or (6 if args.quick else 12)
    results = []
    rows = []
    load_at_start = common.load_average()
    for spec, dtype in cases:
        for every in EVERY:
            r = measure(spec, dtype, every, rounds=rounds)
            results.append(r)
            lo, hi = r["ratio_90ci"]
            verdict = "PASS" if lo >= r["target"] else ("MISS" if hi < r["target"] else "UNSURE")
            rows.append([verdict, f"{r['model']} {dtype}", probes_label(every),
                         f"{r['bare_step_ms']} ms", f"{r['monitored_step_ms']} ms",
                         f"{r['steps_per_s_ratio']:.3f} (90% CI {lo:.3f}..{hi:.3f})", f">= {r['target']}",
                         f"{100 * r['probed_share']:.0f}%"])
    print("amp_tui.monitor against the same loop without it (steps/s ratio, alternating in one process)")
    print(common.table(rows, ["", "model", "probes", "bare", "monitored", "ratio", "target", "probed"]))
    print(f"load average at start {load_at_start}, at end {common.load_average()}; probed: the share of the "
          "measured steps that were probed")
    if args.json:
        args.json.write_text(json.dumps({"machine": common.machine("cpu"), "versions": common.versions(),
                                         "date": common.now_iso(), "load_average_at_start": load_at_start,
                                         "load_average_at_end": common.load_average(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
