"""Building a run from a `RunConfig`: what `amp-tui train` does between its command line and the
first step, for any caller (the CLI, a test, a program of one's own).

The requests in the config are settled (the device, the run directory and the checkpoint a
resume goes on from, the dtype, the interventions to repeat), the script is loaded and checked,
the `Run` is built and its pre-flight check runs. No file is written yet. With several ranks,
a check that fails on any rank fails on every rank, before the next collective would wait for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator, NamedTuple

from amp_tui.core.run_dirs import default_run_dir
from amp_tui.job.checkpoints.resume import newest_valid_checkpoint
from amp_tui.job.config import RunConfig
from amp_tui.job.drivers.feed import BatchFeed
from amp_tui.job.ranks.distributed import Ranks
from amp_tui.job.run import Run
from amp_tui.job.steering.control import job_alive
from amp_tui.recording.format import SessionFormatError
from amp_tui.recording.timeline import interventions_as_commands
from amp_tui.training.checkpoint import list_checkpoints
from amp_tui.training.devices import resolve_device
from amp_tui.training.fp8.layers import Fp8FilterError, load_filter
from amp_tui.training.local_fp32 import match_modules, named_modules
from amp_tui.training.script import ScriptError, TrainSetup, load_script
from amp_tui.training.sharding import ShardingError, is_sharded, shard_model
from amp_tui.training.step.autocast import unsupported_reason
from amp_tui.training.step.engine import PrecisionRefused
from amp_tui.training.step.fp8_training import FP8_RANKS_UNCHOSEN


class BuiltRun(NamedTuple):
    run: Run
    warnings: list[str]    # the script's, and the newer checkpoints a resume skipped


def build_run(config: RunConfig, *, ranks: Ranks | None = None) -> BuiltRun:
    """The run `config` asks for, checked and ready to `run()`; `ranks` when this process is one
    rank of several (each rank builds its own, on its own device).

    Raises ScriptError / DeviceError / PrecisionRefused with a message for the user, RanksLost when
    another rank is gone.
    """
    if ranks:
        # One folder for every rank, rank 0's (each would name its own timestamped one).
        run_dir = Path(ranks.share(str(config.resume or config.run_dir or default_run_dir(config.script))))
        ranks.run_dir = run_dir
        if config.resume is None:
            config = dataclasses.replace(config, run_dir=run_dir)
    with agreed(ranks):
        config, setup, device = _settle(config, ranks)
    if config.fsdp:
        # After every rank's setup() passed: fully_shard meets the other ranks.
        with agreed(ranks):
            _shard(setup, device)
    run = Run(config, setup, device, BatchFeed(setup.batches, device), ranks=ranks)
    # After every precision policy is in place (--dtype, --fp32-modules, --at 0:...): the check
    # is the first step's own forward. Its batch is agreed on first: a rank with none must not
    # leave the others inside the forward's collectives.
    with agreed(ranks):
        batch = run.preflight_batch()
    with agreed(ranks):
        run.preflight_forward(batch)
    return BuiltRun(run, setup.warnings)


@contextlib.contextmanager
def agreed(ranks: Ranks | None) -> Iterator[None]:
    """Checks that every rank passes or none does: a failure on one rank (its script raised, a
    file it can't read) is raised on every rank, worded with the first failing rank, before the
    next collective would wait for it until the timeout."""
    if ranks is None:
        yield
        return
    try:
        yield
    except Exception as exc:
        ranks.first_problem(str(exc) or type(exc).__name__)
        raise
    problem = ranks.first_problem(None)
    if problem is not None:
        raise ScriptError(problem)


def _settle(config: RunConfig, ranks: Ranks | None):
    """`config` with its requests settled, the script's setup, and the device."""
    at = list(config.at)
    if config.repeat_interventions is not None:
        try:
            at += interventions_as_commands(config.repeat_interventions)
        except (SessionFormatError, OSError) as exc:
            raise ScriptError(f"--repeat-interventions: {exc}") from None
    device = ranks.device if ranks else resolve_device(config.device)
    run_dir = _run_dir(config)
    candidates = list_checkpoints(run_dir / "checkpoints") if config.resume is not None else []
    dtype = config.dtype or next((c.dtype for c in candidates if c.dtype), None) or "float16"
    reason = unsupported_reason(device, dtype)
    if reason:
        raise PrecisionRefused(reason)
    where = {"rank": ranks.rank, "local_rank": ranks.local_rank, "world_size": ranks.world_size} if ranks else {}
    setup = load_script(config.script, device=str(device), argv=config.script_argv, dtype=dtype, **where)
    resume_from, resume_skipped = None, []
    if config.resume is not None:
        resume_from, resume_skipped = newest_valid_checkpoint(candidates, setup, run_dir)
        setup.warnings.extend(f"--resume: skipped {path.relative_to(run_dir)}: {reason}"
                              for path, reason in resume_skipped)
    if dtype == "float8" and ranks and ranks.world_size > 1 and config.fp8_filter is None:
        raise PrecisionRefused(FP8_RANKS_UNCHOSEN)
    if config.fp8_filter is not None:
        try:
            load_filter(config.fp8_filter)
        except Fp8FilterError as exc:
            raise ScriptError(str(exc)) from None
    for pattern in config.fp32_modules:
        if not match_modules(setup.model, pattern):
            raise ScriptError(f"--fp32-modules {pattern!r} matches no module of the model "
                              f"(module names look like {_example_names(setup)})")
    settled = dataclasses.replace(
        config, dtype=dtype, run_dir=run_dir, at=at,
        # the guard moves down the precision ladder when the policy says fallback (or isolate, whose
        # autopilot makes the move its own: job/steering/autopilot.py)
        guard=dataclasses.replace(config.guard, fallback=config.on_nonfinite in ("fallback", "isolate")),
        resume_from=resume_from,
        resume_skipped=[(str(path.relative_to(run_dir)), reason) for path, reason in resume_skipped],
        control=config.control and (not ranks or ranks.is_main))
    return settled, setup, device


def _shard(setup: TrainSetup, device) -> None:
    """--fsdp: rank 0's weights on every rank (as DDP does when it wraps a model), then the
    model sharded with FSDP2's fully_shard, block by block and the root."""
    if is_sharded(setup.model):
        setup.warnings.append("--fsdp: the script's model is sharded already; amp-tui leaves it as it is")
        return
    setup.model.to(device)
    try:
        shard_model(setup.model, setup.optimizer, setup.fsdp_blocks, broadcast_from=0)
    except ShardingError as exc:
        raise ScriptError(str(exc)) from None


def _run_dir(config: RunConfig) -> Path | None:
    """Where the session goes (None: a new folder of the run's own), checked: a resume continues
    a session that is there and that no job is writing; a new run never writes over one."""
    run_dir = config.run_dir
    if config.resume is not None:
        if run_dir is not None and run_dir.resolve() != config.resume.resolve():
            raise ScriptError("--resume RUN_DIR continues that run in place; drop --run-dir")
        run_dir = config.resume
        if not (run_dir / "session.jsonl").is_file():
            raise ScriptError(f"--resume {run_dir}: no session.jsonl there")
        if job_alive(run_dir):
            raise ScriptError(f"--resume {run_dir}: a job is still running there (amp-tui ctl {run_dir} stop)")
    elif run_dir is not None and (run_dir / "session.jsonl").exists():
        raise ScriptError(f"{run_dir} already holds a session; choose another --run-dir (or --resume it)")
    return run_dir


def _example_names(setup: TrainSetup, count: int = 3) -> str:
    names = [n for n in named_modules(setup.model) if n][:count]
    return ", ".join(repr(n) for n in names) or "(the model has no submodules)"
