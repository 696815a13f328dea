"""The dashboard attached against headless, and key-to-effect latency.

One `Run` on its training thread (`LiveSource`, as `amp-tui train` runs it) trains without stopping;
the measurement alternates windows of `window_s` seconds:

- headless: nothing but the training thread (the main thread sleeps);
- attached: the real app (`create_app(LiveSource(run))`) under Textual's headless driver at 120x40
  (`app.run_test`): every widget is laid out and rendered by the compositor at the app's refresh
  rate; only the final write of escape codes to a terminal is skipped.

Throughput is counted from the step records the run emits (an observer stamps each one), so the
app's start-up and shut-down are outside the windows. Windows go ABBA (headless, attached,
attached, headless, ...) so a drift of the machine's load doesn't favour one side.

Key-to-effect: with the app attached, an `s` key event goes into the app's queue as the terminal
driver would put it there; the time runs from the key to the moment the engine applies the scale
change (the `intervention` event reaches an observer on the training thread), and to the moment the
app runs the key's action (`key handled`). The change lands at the next step boundary, so about half a
step on average is expected.
"""

from __future__ import annotations

import asyncio
import copy
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from amp_tui.job.config import RunConfig
from amp_tui.job.drivers.feed import BatchFeed
from amp_tui.job.run import Run
from amp_tui.sources.live import LiveSource
from amp_tui.training.script import TrainSetup
from bench import common
from bench.models import build

SIZE = (120, 40)


class _Marks:
    """Stamps step records and scale interventions on the training thread."""

    def __init__(self):
        self.steps: list[float] = []
        self.effects: list[float] = []

    def __call__(self, record: dict) -> None:
        kind = record.get("type")
        if kind == "step":
            self.steps.append(time.perf_counter())
        elif kind == "event" and record.get("kind") == "intervention" and record.get("action") == "scale":
            self.effects.append(time.perf_counter())

    def rate(self, t0: float, t1: float) -> tuple[float, int]:
        inside = [t for t in self.steps if t0 <= t <= t1]
        if len(inside) < 2:
            return float("nan"), len(inside)
        return (len(inside) - 1) / (inside[-1] - inside[0]), len(inside)


def _wait_steps(marks: _Marks, n: int, timeout: float = 120.0) -> None:
    target = len(marks.steps) + n
    deadline = time.perf_counter() + timeout
    while len(marks.steps) < target and time.perf_counter() < deadline:
        time.sleep(0.01)


def _counting(app) -> dict:
    """Count the app's redraws and the UI thread's time spent in them."""
    stats = {"refreshes": 0, "refresh_s": 0.0}
    original = app.refresh_view

    def refresh_view():
        t = time.perf_counter()
        try:
            original()
        finally:
            stats["refreshes"] += 1
            stats["refresh_s"] += time.perf_counter() - t

    app.refresh_view = refresh_view
    return stats


async def _attached_window(source, marks: _Marks, window_s: float, presses: int = 0, seed: int = 0) -> dict:
    """One attached window: throughput over `window_s`, then (if asked) `presses` presses of `s`."""
    from amp_tui.ui.app import create_app

    app = create_app(source)
    stats = _counting(app)
    out: dict = {}
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await asyncio.sleep(0.5)  # the first frame and the first heavy redraw are behind us
        before = dict(stats)
        c0, t0 = time.thread_time(), time.perf_counter()
        await asyncio.sleep(window_s)
        c1, t1 = time.thread_time(), time.perf_counter()
        after = dict(stats)
        if presses:
            out.update(await _presses(app, marks, presses, seed))
    rate, n = marks.rate(t0, t1)
    out.update({"rate": rate, "steps": n, "seconds": t1 - t0,
                "refreshes_per_s": (after["refreshes"] - before["refreshes"]) / (t1 - t0),
                "ui_busy_share": (after["refresh_s"] - before["refresh_s"]) / (t1 - t0),
                # CPU time of the app's thread (event loop, layout, rendering) per second
                "ui_cpu_share": (c1 - c0) / (t1 - t0)})
    return out


async def _presses(app, marks: _Marks, presses: int, seed: int) -> dict:
    """Send `s` as the terminal driver would (a Key event into the app's queue) and stamp when the
    app runs the action and when the engine applies it. (Pilot.press also waits for the whole
    process to go idle, which a training process never does: it would only add its own wait.)"""
    from textual import events

    rng = random.Random(seed)
    handled_at: list[float] = []
    original = app.action_halve_scale

    def action_halve_scale():
        handled_at.append(time.perf_counter())
        return original()

    app.action_halve_scale = action_halve_scale
    latencies, handled = [], []
    for _ in range(presses):
        # A random moment within a step, so the presses sample the whole step.
        await asyncio.sleep(rng.uniform(0.02, 0.12))
        seen, seen_handled = len(marks.effects), len(handled_at)
        key = events.Key("s", "s")
        key.set_sender(app)
        t0 = time.perf_counter()
        app._driver.send_message(key)
        deadline = t0 + 30.0
        while len(marks.effects) <= seen and time.perf_counter() < deadline:
            await asyncio.sleep(0.001)
        if len(handled_at) > seen_handled:
            handled.append(handled_at[seen_handled] - t0)
        if len(marks.effects) > seen:
            latencies.append(marks.effects[seen] - t0)
    return {"latencies": latencies, "handled": handled}


def _headless_window(marks: _Marks, window_s: float) -> dict:
    t0 = time.perf_counter()
    time.sleep(window_s)
    t1 = time.perf_counter()
    rate, n = marks.rate(t0, t1)
    return {"rate": rate, "steps": n, "seconds": t1 - t0}


def measure(spec, dtype: str, *, windows: int = 4, window_s: float = 3.0, presses: int = 20,
            probe_every: int = 1, init_scale: float = 65536.0, device: str = "cpu", log=print) -> dict:
    model, batches, loss_fn, description = build(spec, device)
    dev = torch.device(device)
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-dashboard-"))
    m = copy.deepcopy(model)
    cfg = RunConfig(script=Path("bench.py"), dtype=dtype, init_scale=init_scale, probe_every=probe_every,
                    run_dir=tmp / "run")
    run = Run(cfg, TrainSetup(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4),
                              loss_fn=loss_fn, batches=batches), dev, BatchFeed(batches, dev))
    marks = _Marks()
    run.observers.append(marks)
    source = LiveSource(run)
    source.start()
    results = {"headless": [], "attached": []}
    try:
        _wait_steps(marks, 3)
        lat = {"latencies": [], "handled": []}
        for w in range(windows):
            for mode in (("headless", "attached") if w % 2 == 0 else ("attached", "headless")):
                if mode == "headless":
                    results[mode].append(_headless_window(marks, window_s))
                    continue
                # The key presses ride on the last attached window (one app start-up less).
                last = w == windows - 1 and presses
                n_before = len(marks.steps)
                r = asyncio.run(_attached_window(source, marks, window_s, presses if last else 0))
                if last:
                    lat = {"latencies": r.pop("latencies"), "handled": r.pop("handled")}
                    step_s = [b - a for a, b in zip(marks.steps[n_before:], marks.steps[n_before + 1:])]
                results[mode].append(r)
        if not presses:
            step_s = [b - a for a, b in zip(marks.steps[-40:], marks.steps[-39:])]
    finally:
        stopped = source.stop(30.0)
        shutil.rmtree(tmp, ignore_errors=True)
    head = [r["rate"] for r in results["headless"]]
    att = [r["rate"] for r in results["attached"]]
    ratios = [a / h for a, h in zip(att, head)]
    lats = lat["latencies"]
    step_ms = common.median(step_s) * 1e3 if step_s else float("nan")
    return {
        "model": spec.name, "description": description, "dtype": dtype, "probe_every": probe_every,
        "terminal_size": list(SIZE), "windows_each": windows, "window_s": window_s,
        "headless_steps_per_s": [common.rnd(x) for x in head],
        "attached_steps_per_s": [common.rnd(x) for x in att],
        "headless_median_steps_per_s": common.rnd(common.median(head)),
        "attached_median_steps_per_s": common.rnd(common.median(att)),
        "ratio_of_medians": common.rnd(common.median(att) / common.median(head), 4),
        "window_ratios": [common.rnd(x, 4) for x in ratios],
        "median_window_ratio": common.rnd(common.median(ratios), 4),
        # The machine's own noise moves single windows by +-20%: judge the median by its interval.
        "median_window_ratio_90ci": [common.rnd(x, 4) for x in common.bootstrap_interval(
            lambda idx: common.median([ratios[i] for i in idx]), len(ratios))],
        "ui_refreshes_per_s": common.rnd(common.median([r["refreshes_per_s"] for r in results["attached"]]), 1),
        "ui_busy_share": common.rnd(common.median([r["ui_busy_share"] for r in results["attached"]]), 4),
        "ui_cpu_share": common.rnd(common.median([r["ui_cpu_share"] for r in results["attached"]]), 4),
        "key_presses": presses,
        "key_effects_seen": len(lats),
        "key_to_effect_median_ms": common.rnd(common.median(lats) * 1e3, 1) if lats else None,
        "key_to_effect_max_ms": common.rnd(max(lats) * 1e3, 1) if lats else None,
        "key_handled_median_ms": common.rnd(common.median(lat["handled"]) * 1e3, 1) if lat["handled"] else None,
        "step_ms": common.rnd(step_ms, 1),
        "stopped_cleanly": stopped,
    }
