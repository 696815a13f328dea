"""Speed: lean timed training steps for fp32 and each dtype that passed validation, with the
peak memory of each run.

Lean means none of the checks the validation or the guarded loop make (no finite checks, no
probes, no host syncs of our own): what is timed is the AMP recipe itself.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import statistics
import time
from pathlib import Path

import torch

from amp_tui.compare.memory import PeakMemory
from amp_tui.compare.results import Speed, SpeedRun
from amp_tui.core import precision
from amp_tui.training.devices import move_to_device
from amp_tui.training.script import TrainSetup, describe_exception
from amp_tui.training.step.autocast import autocast

# Distinct training batches the speed runs cycle through (moved to the device once).
SPEED_BATCHES = 8


def _training_batches(setup: TrainSetup, device: torch.device, fallback: list) -> list:
    try:
        batches = list(itertools.islice(setup.batches, SPEED_BATCHES))
    except Exception:  # noqa: BLE001 - validation already iterated it; fall back to the eval set
        batches = []
    return [move_to_device(b, device) for b in (batches or fallback)]


def lean_steps(model, optimizer, loss_fn, batches: list, device: torch.device, dtype: str, *,
               steps: int, warmup: int, accumulate: int = 1, max_grad_norm: float | None = None,
               memory: PeakMemory | None = None) -> SpeedRun:
    """Time `steps` training steps after `warmup`: autocast forward, scaled backward, (unscale_ and
    clip when the script clips), scaler.step, update. No finite checks, no probes, no .item():
    on CUDA the per-step times come from CUDA events read once at the end."""
    run = SpeedRun(dtype)
    use_scaler = precision.uses_scaler(dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    cuda = device.type == "cuda"
    model.train()
    feed = 0

    def one_step():
        nonlocal feed
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            batch = batches[feed % len(batches)]
            feed += 1
            with autocast(device.type, dtype):
                loss = loss_fn(model, batch)
            if accumulate > 1:
                loss = loss / accumulate
            scaler.scale(loss).backward()
        if max_grad_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        scaler.step(optimizer)
        scaler.update()

    for _ in range(warmup):
        one_step()
    if memory is not None:
        memory.start_timing()
    elif cuda:
        torch.cuda.synchronize(device)
    host_ms, scales = _timed(one_step, steps, device, scaler if use_scaler else None)
    run.step_ms = host_ms
    run.median_ms = statistics.median(host_ms) if host_ms else None
    if len(scales) > 1:
        values = [float(s) for s in scales]  # the host reads, after the timed steps
        run.skipped_updates = sum(1 for a, b in itertools.pairwise(values) if b < a)
    if memory is not None:
        run.peak_bytes = memory.peak()
    return run


def _timed(one_step, steps: int, device: torch.device, scaler) -> tuple[list[float], list[torch.Tensor]]:
    """Each step's milliseconds (CUDA events read once at the end, on CUDA), and the scale before
    the first and after each step, still on the device (`scaler` None: no scaler)."""
    cuda = device.type == "cuda"
    scales = [_scale_snapshot(scaler)] if scaler is not None else []
    events: list[tuple] = []
    host_ms: list[float] = []
    stream = torch.cuda.current_stream(device) if cuda else None
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            one_step()
            end.record(stream)
            events.append((start, end))
        else:
            t0 = time.perf_counter()
            one_step()
            host_ms.append((time.perf_counter() - t0) * 1000.0)
        if scaler is not None:
            scales.append(_scale_snapshot(scaler))
    if cuda:
        torch.cuda.synchronize(device)
        host_ms = [s.elapsed_time(e) for s, e in events]
    return host_ms, scales


def _scale_snapshot(scaler: torch.amp.GradScaler):
    """The live loss scale without a host sync: a device-side copy (or the initial float before
    the first scale() created it)."""
    live = getattr(scaler, "_scale", None)
    return live.detach().clone() if live is not None else float(scaler.get_scale())


def measure_speed(setup: TrainSetup, device: torch.device, dtypes: list[str], *, steps: int,
                  warmup: int, script: Path, eval_fallback: list | None = None) -> Speed:
    """fp32 first, then each dtype: fresh deep copies of the script's model AND optimizer
    (copied together, so the copy steps the copied parameters with the script's hyperparameters
    and any state it holds), the same training batches, the same step count.

    One unmeasured step per dtype comes first, so one-time process costs (kernel and library
    caches, autograd threads) land on no measured run -- otherwise fp32, measured first, would
    carry them all."""
    batches = _training_batches(setup, device, eval_fallback or [])
    memory = PeakMemory(device)
    speed = Speed(steps, warmup, memory.kind, [])
    if setup.scheduler is not None:
        speed.notes.append("the script's LR scheduler is not stepped while timing")
    order = ["float32", *dtypes]
    for dtype in order:
        with contextlib.suppress(Exception):  # the measured run below reports it
            _speed_run(setup, device, dtype, batches, steps=0, warmup=1, memory=None)
    for dtype in order:
        memory.before_run()
        try:
            run = _speed_run(setup, device, dtype, batches, steps=steps, warmup=warmup,
                             memory=memory if memory.available else None)
        except Exception as exc:  # noqa: BLE001 - the user's loss_fn or a kernel; reported per dtype
            run = SpeedRun(dtype, error=describe_exception(exc, script))
        speed.runs.append(run)
    busy = _busy_note()
    if busy:
        speed.notes.append(busy)
    base = speed.runs[0]
    for run in speed.runs:
        if run.median_ms is not None and base.median_ms:
            run.time_ratio = run.median_ms / base.median_ms
        if run.peak_bytes is not None and base.peak_bytes:
            run.memory_ratio = run.peak_bytes / base.peak_bytes
    return speed


def _busy_note() -> str | None:
    """Timings from a machine with more runnable work than cores are noisy: say so."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"load average {load:.1f} on {cores} CPU cores while timing: other work competed for the "
            f"CPU, so the times are noisy (torch intra-op threads: {torch.get_num_threads()})")


def _speed_run(setup: TrainSetup, device, dtype, batches, *, steps, warmup, memory) -> SpeedRun:
    model, optimizer = copy.deepcopy((setup.model, setup.optimizer))
    model.to(device)
    try:
        return lean_steps(model, optimizer, setup.loss_fn, batches, device, dtype, steps=steps,
                          warmup=warmup, accumulate=setup.accumulate,
                          max_grad_norm=setup.max_grad_norm, memory=memory)
    finally:
        del model, optimizer
