"""Per-step cost of the probes, against the bare guarded loop and the tools people use today.

Contenders, each with its own trainer (and GradScaler), the same batches in the same order, the
same dtype and init_scale, all training **one copy of the model with one AdamW, in turns**, each
at its share of the learning rate. Where each trained a copy of its own, where the copies lay in
memory made identical contenders differ by up to 2% on the small models, more than the 1% being
measured; and where some shared a copy and others didn't, the sharers found the weights warm in
the caches and the others cold (`run/1` read several points dearer). ``DebugUnderflowOverflow``, whose
hooks stay on its model, trains a copy of its own. The probes' hooks that a contender leaves on
the model between its steps (probing every step) are taken off after its step and put back before
its next one, both out of the timed part, so that no contender runs another's hooks:

- ``bare``: ``GuardedTrainer(probe=False)``: the guarded step with no probe and no session;
- ``probes/1``, ``probes/10``: ``GuardedTrainer(probe=True, probes=ProbeOptions(every=1 | 10))``;
- ``run/1``, ``run/10``, ``run/auto``: the full ``Run`` step (probes + the session file + guards),
  as ``amp-tui train`` runs it (``run/auto``: the adaptive schedule, 1% budget, its default);
- ``DebugUnderflowOverflow``: the bare loop with ``transformers.debug_utils.DebugUnderflowOverflow``
  attached (forward hooks on every module; forward only);
- ``detect_anomaly``: the bare loop inside ``torch.autograd.detect_anomaly()`` (backward only).

A block of consecutive steps of each contender per round (`block`, 10 by default), in a new
random order every round, many rounds, after a warm-up: the machine's noise falls on all of them
alike, and step j of a contender's block is paired with step j of the bare loop's block in the
same round. Blocks, not single steps in turn: a run runs its own code on every step, so its
caches hold it, where one step of each of eight contenders in turn left each one's own code cold
for its next step (amp-tui's step, with no probing, read +1.6% in turn against +0.6% beside the
bare loop alone); and a contender's work that outlives its step (a thread of its own) lands on
its own next steps, not on another contender's. A contender that probes every 10 steps
has two kinds of step; its per-step figure is the median of each kind weighted 1:9
(`common.stratified_median`), not the plain median (which would hide the probed step).
"""

from __future__ import annotations

import copy
import gc
import math
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from amp_tui.job.config import RunConfig
from amp_tui.job.drivers.feed import BatchFeed
from amp_tui.job.run import Run
from amp_tui.training.probes.probe_options import ProbeOptions
from amp_tui.training.script import TrainSetup
from amp_tui.training.step.engine import GuardedTrainer
from bench import common

ALL = ("bare", "probes/1", "probes/10", "run/1", "run/10", "run/auto", "DebugUnderflowOverflow", "detect_anomaly")
OURS = ("probes/1", "probes/10", "run/1", "run/10", "run/auto")
THEIRS = ("DebugUnderflowOverflow", "detect_anomaly")

# What each contender tells the user about a step (for the table in docs/performance.md).
REPORTS = {
    "bare": "loss, skip/scale (the guarded step itself)",
    "probes/1": "+ per-layer max |activation|, |gradient|, |weight|, fp16 underflow shares, first "
                "non-finite layer (forward and backward), every step",
    "probes/10": "the same, every 10th step",
    "run/1": "probes/1 + the session file and guards",
    "run/10": "probes/10 + the session file and guards",
    "run/auto": "the probes on the steps the adaptive schedule picks (1% budget) + the session file and guards",
    "DebugUnderflowOverflow": "abs min/max of every module's weights, inputs and outputs in the last "
                              "21 forward frames, printed when the forward produces inf/nan (then "
                              "raises); nothing about the backward",
    "detect_anomaly": "raises naming the backward op that returned NaN (with the forward traceback); "
                      "no magnitudes, nothing about the forward",
}


def transformers_debug():
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except Exception:  # noqa: BLE001 - not installed, or broken: the contender is left out
        return None
    return DebugUnderflowOverflow


class Contender:
    def __init__(self, name: str, step, *, trainer: GuardedTrainer, every: int | str = 1, close=None):
        self.name = name
        self.step = step
        self.trainer = trainer
        self.every = every
        self.close = close or (lambda: None)
        self.times: list[float] = []
        self.probed: list[bool] = []
        self._detached = False   # tidy() took its hooks off the shared model

    def probing(self) -> bool:
        return self.trainer.probe is not None and self.trainer.probing_next()

    def tidy(self) -> None:
        """After its step, out of the timed part: no hook of its own left on the shared model for
        the next contender's step."""
        probe = self.trainer.probe
        if probe is not None and probe._handles:
            probe.detach()
            self._detached = True

    def prepare(self) -> None:
        """Before its step, out of the timed part: the hooks `tidy` took off back on, where the
        step is probed, as they would have stayed in a run of its own."""
        if self._detached and self.probing():
            self.trainer._begin_probe()
        self._detached = False


def make_contenders(names, model, batches, loss_fn, *, dtype: str, device: str, init_scale: float,
                    tmp: Path) -> dict[str, Contender]:
    dev = torch.device(device)
    out: dict[str, Contender] = {}
    shared_model = copy.deepcopy(model).to(dev)
    # Each sharer's step moves the shared copy by its share of the learning rate, so that it trains
    # no farther in the bench's rounds than a copy of one's own would (fp16 overflows come later).
    sharers = sum(1 for n in names if n != "DebugUnderflowOverflow")
    shared = (shared_model, torch.optim.AdamW(shared_model.parameters(), lr=1e-4 / max(1, sharers)))

    def fresh(own: bool = False):
        if not own:
            return shared
        m = copy.deepcopy(model).to(dev)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)

    def trainer(probe: bool, every: int = 1, own: bool = False):
        m, opt = fresh(own)
        return GuardedTrainer(m, opt, loss_fn, device=dev, dtype=dtype, init_scale=init_scale,
                              probe=probe, probes=ProbeOptions(every=every))

    for name in names:
        feed = BatchFeed(batches, dev)
        if name == "bare":
            t = trainer(False)
            out[name] = Contender(name, lambda t=t, f=feed: t.step(f.take(1)), trainer=t)
        elif name.startswith("probes/"):
            every = int(name.split("/")[1])
            t = trainer(True, every)
            out[name] = Contender(name, lambda t=t, f=feed: t.step(f.take(1)), trainer=t, every=every)
        elif name.startswith("run/"):
            every = name.split("/")[1]
            every = every if every == "auto" else int(every)
            m, opt = fresh()
            cfg = RunConfig(script=Path("bench.py"), dtype=dtype, init_scale=init_scale, probe_every=every,
                            run_dir=tmp / name.replace("/", "-"))
            run = Run(cfg, TrainSetup(model=m, optimizer=opt, loss_fn=loss_fn, batches=batches), dev, feed)
            run.open()
            out[name] = Contender(name, run.driver.step, trainer=run.trainer, every=every, close=run.close)
        elif name == "DebugUnderflowOverflow":
            duo = transformers_debug()
            if duo is None:
                continue
            t = trainer(False, own=True)
            hooks = duo(t.model)  # registers a forward hook on every module
            out[name] = Contender(name, lambda t=t, f=feed, h=hooks: t.step(f.take(1)), trainer=t)
        elif name == "detect_anomaly":
            t = trainer(False)

            def step(t=t, f=feed):
                with torch.autograd.detect_anomaly(check_nan=True):
                    return t.step(f.take(1))

            out[name] = Contender(name, step, trainer=t)
        else:
            raise ValueError(f"unknown contender {name!r}")
    return out


def measure(spec, dtype: str, *, device: str = "cpu", rounds: int = 20, min_rounds: int = 4,
            budget_s: float = 60.0, warmup: int = 3, block: int = 10, names=ALL,
            init_scale: float = 1024.0, seed: int = 0, log=print) -> dict:
    """Alternate the contenders `block` steps at a time; return every figure as a dict."""
    from bench.models import build

    model, batches, loss_fn, description = build(spec, device)
    clock = common.Clock(device)
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-overhead-"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")
        contenders = make_contenders(names, model, batches, loss_fn, dtype=dtype, device=device,
                                     init_scale=init_scale, tmp=tmp)
        order = list(contenders.values())
        rng = random.Random(seed)
        failed: dict[str, str] = {}

        def drop(c: Contender, exc: BaseException) -> None:
            # e.g. DebugUnderflowOverflow raises on the first inf/nan it sees: leave that
            # contender out, keep the others' figures.
            failed[c.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if c.name == "bare":
                raise exc
            order.remove(c)
            del contenders[c.name]
            c.close()

        try:
            for _ in range(warmup):
                for c in list(order):
                    c.prepare()
                    try:
                        c.step()
                    except Exception as exc:  # noqa: BLE001
                        drop(c, exc)
                    c.tidy()
            gc.collect()
            started = time.perf_counter()
            done = 0
            while done < rounds:
                rng.shuffle(order)
                for c in list(order):
                    c.prepare()
                    for _ in range(block):
                        probed = c.probing()
                        t0 = clock()
                        try:
                            c.step()
                        except Exception as exc:  # noqa: BLE001
                            drop(c, exc)
                            break
                        c.times.append(clock() - t0)
                        c.probed.append(probed)
                    c.tidy()
                done += 1
                if time.perf_counter() - started > budget_s and done >= min_rounds:
                    break
        finally:
            for c in contenders.values():
                c.close()
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    result = summarize(contenders, done * block)
    result.update({
        "model": spec.name, "description": description, "dtype": dtype, "device": device,
        "init_scale": init_scale, "rounds": done, "block": block, "warmup_rounds": warmup,
        "seconds": round(elapsed, 1),
        "missing": [n for n in names if n not in contenders and n not in failed],
        "failed": failed,
    })
    return result


def summarize(contenders: dict[str, Contender], n: int) -> dict:
    """Figures of every contender against `bare`.

    Step time: the (stratified) median of the contender's own steps. Overhead: the (stratified)
    median of its paired differences with the bare step of the same round, so that the machine's
    slow drifts (other jobs starting and stopping) cancel out; in % of the bare median. A 90%
    bootstrap interval over the paired steps comes with it, and with the ratio of two overheads.
    """
    bare = contenders["bare"]

    def own(c: Contender, idx) -> float:
        return common.stratified_median([c.times[i] for i in idx], [c.probed[i] for i in idx], c.every)

    def paired(c: Contender, idx) -> float:
        diffs = [c.times[i] - bare.times[i] for i in idx]
        return common.stratified_median(diffs, [c.probed[i] for i in idx], c.every)

    everything = list(range(n))
    base = own(bare, everything)
    rows = {}
    for name, c in contenders.items():
        t = own(c, everything)
        over = paired(c, everything) if name != "bare" else 0.0
        row = {
            "step_ms": common.rnd(t * 1e3),
            "iqr_ms": common.rnd(common.iqr(c.times) * 1e3),
            "plain_median_ms": common.rnd(common.median(c.times) * 1e3),
            "time_ratio": common.rnd(t / base, 4),        # contender step time / bare step time
            "steps_per_s_ratio": common.rnd(base / t, 4),  # contender steps/s / bare steps/s
            "overhead_ms": common.rnd(over * 1e3),
            "overhead_pct": common.rnd(100 * over / base, 2),
            "skipped_updates": c.trainer.skipped_total,
            "probe_every": c.every if c.trainer.probe is not None else None,
        }
        if c.every == "auto":
            # What amp-tui took of the steps (probing and the step records): as the schedule
            # measured it for itself, and as the benchmark does (run/auto's paired cost over the
            # bare step); and probing's part as the benchmark sees it (the probed share of steps
            # times probes/1's paired cost per step).
            row["probed_share"] = common.rnd(sum(c.probed) / max(1, len(c.probed)), 4)
            row["schedule_share_pct"] = common.rnd(100 * c.trainer.probe_schedule.share(), 2)
            row["schedule_interval"] = c.trainer.probe_schedule.interval()
            row["bench_share_pct"] = common.rnd(100 * over / t, 2)
            if "probes/1" in contenders:
                cost = paired(contenders["probes/1"], everything)
                row["bench_probe_share_pct"] = common.rnd(100 * row["probed_share"] * cost / t, 2)
        if name != "bare":
            lo, hi = common.bootstrap_interval(lambda idx, c=c: 100 * paired(c, idx) / own(bare, idx), n)
            row["overhead_pct_90ci"] = [common.rnd(lo, 2), common.rnd(hi, 2)]
        rows[name] = row
    cheaper = {}
    for theirs in THEIRS:
        if theirs not in contenders:
            continue
        for ours in ("probes/1", "run/1"):
            if ours not in contenders:
                continue
            o, th = contenders[ours], contenders[theirs]

            def ratio(idx, o=o, th=th) -> float:
                mine = paired(o, idx)
                return paired(th, idx) / mine if mine > 0 else math.inf

            lo, hi = common.bootstrap_interval(ratio, n, seed=1)
            ours_lo = rows[ours]["overhead_pct_90ci"][0]
            cheaper[f"{theirs} vs {ours}"] = {
                "overhead_ratio": common.rnd(ratio(everything), 2),
                "overhead_ratio_90ci": [common.rnd(lo, 2), common.rnd(hi, 2)],
                "time_ratio": common.rnd(rows[theirs]["step_ms"] / rows[ours]["step_ms"], 3),
                "ours_within_noise": ours_lo is not None and ours_lo <= 0,
            }
    return {"contenders": rows, "cheaper": cheaper}
