"""`amp-tui train --nproc N`: the ranks of one run, started by torch.distributed.run; and what
each of them does, however torchrun was started (`torchrun ... -m amp_tui train script.py`).

The launching process runs PyTorch's launcher (`amp_tui.job.ranks.launcher`, torch.distributed.run in a
process of its own, so its signal handlers never replace ours) with every rank headless. Rank 0
records the session and serves the control socket; the dashboard attaches to it from here, as
`amp-tui run` does (q stops every rank at the same step and waits for them). The other ranks
record nothing: once the pre-flight check passed, their output goes to RUN_DIR/rank<N>.log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from amp_tui.cli.argv import split_script_args, without_options
from amp_tui.cli.terminal import EXIT_USAGE, error
from amp_tui.core.signals import STOP_SIGNALS, handling_signals

LAUNCH_OPTIONS = ("--nproc", "--nnodes", "--rdzv-endpoint")   # the launcher's, not the ranks'
MONITOR_INTERVAL_S = "0.5"   # how often torchrun's agent looks at its ranks


def is_rank() -> bool:
    from amp_tui.job.ranks.distributed import launched_by_torchrun
    return launched_by_torchrun()


# ---- launching -----------------------------------------------------------------------------------

def launch(args, *, dashboard: bool) -> int:
    """Start the ranks through torch.distributed.run, then follow rank 0 (headless: its output
    here; otherwise the dashboard attached to it)."""
    from amp_tui.core.run_dirs import default_run_dir

    nodes, endpoint = args.nnodes or 1, args.rdzv_endpoint
    if nodes > 1 and not endpoint:
        return error(f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT, the same on every machine")
    if nodes > 1 and args.run_dir is None and args.resume is None:
        # Each machine would name its own timestamped folder, and only rank 0's is written.
        return error(f"--nnodes {nodes} needs --run-dir DIR, the same on every machine (rank 0's machine "
                     "writes the session there; put it on a shared filesystem to watch it from the others)")
    if not args.script.is_file():
        return error(f"script not found: {args.script}")
    run_dir = args.resume or args.run_dir or default_run_dir(args.script)
    if args.resume is None and (run_dir / "session.jsonl").exists():
        return error(f"{run_dir} already holds a session; choose another --run-dir (or --resume it)")
    argv = args.command_line[1:]
    ours, script_argv = split_script_args(argv)
    worker = [*without_options(ours, LAUNCH_OPTIONS, flags=("--detach", "--headless")), "--headless"]
    if args.resume is None and args.run_dir is None:
        worker += ["--run-dir", str(run_dir)]
    if "--" in argv:
        worker += ["--", *script_argv]
    torchrun = ["--nproc-per-node", str(args.nproc or 1), "--max-restarts", "0",
                "--monitor-interval", MONITOR_INTERVAL_S]
    torchrun += (["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
                 if endpoint else ["--standalone"])
    command = [sys.executable, "-m", "amp_tui.job.ranks.launcher", str(run_dir), *torchrun, "-m", "amp_tui", *worker]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # torchrun sets 1 thread per rank when nobody says (and warns); a CPU job gets its share.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (args.nproc or 1))))
    if dashboard:
        return _launch_with_dashboard(command, env, run_dir, args.refresh_rate)
    try:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        return error(f"cannot start torch.distributed.run: {exc.strerror or exc}", status=1)
    return _wait_passing_signals(process)


def _wait_passing_signals(process: subprocess.Popen) -> int:
    """Wait for the launcher; SIGINT, SIGTERM and SIGHUP go on to it as they came (torchrun
    sends them to every rank, which stops at its next step boundary)."""
    def forward(signum, _frame):
        if process.poll() is None:
            process.send_signal(signum)
    with handling_signals(STOP_SIGNALS, forward):
        status = process.wait()
    return 128 - status if status < 0 else status


def _launch_with_dashboard(command: list[str], env: dict, run_dir: Path, refresh_rate: float) -> int:
    from amp_tui.cli.run import OUTPUT_NAME, _dashboard, _start

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        process = _start(command, env, run_dir / OUTPUT_NAME, tee=False)
    except OSError as exc:
        return error(f"cannot start torch.distributed.run: {exc.strerror or exc}", status=1)
    status = _dashboard(process, command, run_dir, detach=False, refresh_rate=refresh_rate)
    if status is None:
        return 0
    if status != 0:
        tail = (run_dir / OUTPUT_NAME).read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
    return 128 - status if status < 0 else status


# ---- one rank ------------------------------------------------------------------------------------

def train_rank(args) -> int:
    """One rank of a torchrun job: join the process group, agree on the run directory, check
    the script on every rank, then train (rank 0 headless, recording; the others quietly)."""
    from amp_tui.job.ranks.distributed import DEFAULT_TIMEOUT_S, Ranks

    if args.detach or args.nproc is not None:
        return error("--detach and --nproc start a job; inside torchrun every process is already one "
                     "rank of it (drop them)")
    try:
        ranks = Ranks.join(args.device, args.dist_timeout or DEFAULT_TIMEOUT_S)
    except (RuntimeError, ValueError) as exc:
        return error(f"could not join the other ranks: {exc}", status=1)
    try:
        return _train(args, ranks)
    finally:
        # The run is gone by now. Before the interpreter exits, gloo's threads let go of our
        # collectives' tensors, then the group ends, its threads joined: one still there as the
        # interpreter finalizes can abort the process (job/ranks/in_flight.py, job/ranks/group_end.py).
        ranks.close()


def _train(args, ranks) -> int:
    from amp_tui.cli.headless import run_headless
    from amp_tui.cli.train_options import attach_tensorboard, attach_trackers, run_config
    from amp_tui.cli.training_process import keep_imports_out_of_collections
    from amp_tui.core.commands import CommandError
    from amp_tui.job.build import build_run
    from amp_tui.job.ranks.distributed import RanksLost
    from amp_tui.job.ranks.rank_output import output_to, rank_log_path
    from amp_tui.training.devices import DeviceError
    from amp_tui.training.script import ScriptError
    from amp_tui.training.step.engine import PrecisionRefused

    if args.own_process:
        keep_imports_out_of_collections()
    try:
        run, warnings = build_run(run_config(args), ranks=ranks)
    except (ScriptError, DeviceError, CommandError, PrecisionRefused) as exc:
        # Rank 0 says what the first failing rank said; the others needn't repeat it.
        return error(str(exc)) if ranks.is_main else EXIT_USAGE
    except RanksLost as exc:
        return error(str(exc), status=1)
    if ranks.is_main:
        problem = attach_tensorboard(run, args.tensorboard) or attach_trackers(run, args)
        if problem:
            return error(problem)
        print(f"amp-tui: rank 0 of {ranks.world_size} records {run.run_dir}; the other ranks' output "
              f"is in {rank_log_path(run.run_dir, 1).name} and so on; watch and steer with: "
              f"amp-tui attach {run.run_dir}", flush=True)
        return run_headless(run, warnings)
    with output_to(rank_log_path(run.run_dir, ranks.rank)):
        return _follow(run, ranks)


def _follow(run, ranks) -> int:
    """A rank other than 0: the same loop, no recording; a stop signal is a vote for the next
    step boundary, and the last line says where this rank ended (it must be where rank 0 did)."""
    from amp_tui.core.precision import short_name
    from amp_tui.core.text import plural

    print(f"amp-tui {ranks.describe()} (pid {os.getpid()}, {run.device}): rank 0 records "
          f"{run.run_dir / 'session.jsonl'}", flush=True)

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        run.request_stop(checkpoint=signum != signal.SIGINT, reason=name)
    with handling_signals(STOP_SIGNALS, on_signal):
        status = run.run()
    t = run.trainer
    scale = "none" if t.scale is None else f"{t.scale:g}"
    print(f"amp-tui {ranks.describe()}: {run.state} before step {run.step}: {plural(t.updates_applied, 'update')}, "
          f"{t.skipped_total} skipped, {short_name(t.dtype)}, scale {scale}", flush=True)
    return status
