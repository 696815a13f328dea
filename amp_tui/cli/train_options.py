"""`amp-tui train`'s parsed options, for one process or for each rank of several: the `RunConfig`
they ask for, and `--tensorboard`'s, `--wandb`'s and `--mlflow`'s observers.

Nothing heavy is imported until a function runs (building the parser imports this module's
neighbours, not torch).
"""

from __future__ import annotations

from pathlib import Path


def run_config(args, *, on_nonfinite_default: str = "skip"):
    """The RunConfig that `args` (train's parsed options, with `script_argv` and `command_line`)
    asks for. Raises CommandError for an `--at` that can't be read."""
    from amp_tui.core.commands import parse_at
    from amp_tui.job.config import RunConfig
    from amp_tui.training.step.guards import GuardConfig

    guard = GuardConfig(
        min_scale=args.min_scale, alert_scale_drops=args.alert_scale_drops,
        alert_skip_share=args.alert_skip_share, alert_window=args.alert_window,
        fallback_after=args.fallback_after, storm_share=args.storm_share, storm_window=args.storm_window,
        rollback=args.rollback, isolate_widen=args.isolate_widen, forecast_horizon=args.forecast_horizon)
    return RunConfig(
        script=args.script, script_argv=list(args.script_argv), dtype=args.dtype, init_scale=args.init_scale,
        steps=args.steps, run_dir=args.run_dir, checkpoint_every=args.checkpoint_every,
        probe_every=args.probe_every, probe_budget=args.probe_budget, probe_alert_bits=args.probe_alert_bits,
        underflow_every=args.underflow_every, fp8_every=args.fp8_every, fp8_filter=args.fp8_filter,
        on_nonfinite=args.on_nonfinite or on_nonfinite_default, at=[parse_at(text) for text in args.at],
        command_line=list(args.command_line), guard=guard, fp32_modules=list(args.fp32_modules),
        control=True, device=args.device, fsdp=args.fsdp, fsdp_checkpoint=args.fsdp_checkpoint, resume=args.resume,
        repeat_interventions=args.repeat_interventions)


def attach_tensorboard(run, logdir: Path | None) -> str | None:
    """Write the run's recording live to `--tensorboard DIR` too; what went wrong, if anything."""
    if logdir is None:
        return None
    from amp_tui.recording.tensorboard import TensorBoardObserver
    try:
        run.observers.append(TensorBoardObserver(logdir))
    except OSError as exc:
        return f"--tensorboard {logdir}: {exc.strerror or exc}"
    return None


def attach_trackers(run, args) -> str | None:
    """Log the run live to `--wandb [PROJECT]` and `--mlflow URI` too; what went wrong, if anything."""
    if args.wandb is None and args.mlflow is None:
        return None
    from amp_tui.recording.extras import MissingExtra
    from amp_tui.recording.trackers import TrackerError, open_observers
    try:
        run.observers.extend(open_observers(wandb=args.wandb, mlflow=args.mlflow, run_dir=run.run_dir))
    except (MissingExtra, TrackerError) as exc:
        return str(exc)
    return None


def tensorboard_problem(logdir: Path) -> str | None:
    """Why `--tensorboard DIR` can't work (its package is missing, DIR can't be written), before
    anything starts; None when it can."""
    import os

    from amp_tui.recording.extras import MissingExtra
    from amp_tui.recording.tensorboard import check_available
    try:
        check_available()
    except MissingExtra as exc:
        return str(exc)
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--tensorboard {logdir}: {exc.strerror or exc}"
    if not os.access(logdir, os.W_OK | os.X_OK):
        return f"--tensorboard {logdir}: the directory is not writable"
    return None
