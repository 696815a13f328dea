"""`amp-tui train SCRIPT`: a run under the dashboard, headless, or as a background job (--detach).

Building the parser imports nothing heavy: torch, the engine and the dashboard are imported by
the functions that run a training, so that the read-side commands start without them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from amp_tui.cli import argtypes
from amp_tui.cli.terminal import error, interactive
from amp_tui.core.policies import NONFINITE_POLICIES

DETACH_WAIT_S = 60.0   # how long --detach waits for the background job to open its control socket
MIN_DIST_TIMEOUT_S = 2.0  # a paused job's ranks meet about once a second (the heartbeat)


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="run a training script under the guarded AMP loop",
                           description="Run SCRIPT's setup() under the guarded autocast + GradScaler "
                                       "loop. Arguments after -- go to the script.")
    train.add_argument("script", type=Path, help="a Python file with a setup() function")
    _run_options(train)
    _probe_options(train)
    _steering_options(train)
    _rank_options(train)
    _guard_options(train)
    train.set_defaults(func=cmd_train)


def _run_options(train) -> None:
    """What is run, where it is recorded, and how it is watched."""
    train.add_argument("--dtype", type=argtypes.dtype, default=None,
                       help="fp16 (default), bf16, fp32, or fp8 (torchao's fp8 layers: amp-tui[fp8]; "
                            "resuming: the checkpoint's dtype)")
    train.add_argument("--init-scale", type=argtypes.positive, default=65536.0, metavar="X",
                       help="GradScaler's initial loss scale in fp16 (default 65536)")
    train.add_argument("--steps", type=argtypes.positive_int, default=None, metavar="N",
                       help="iterations to run (default: until stopped); with --resume, that many "
                            "more from where the recording goes on")
    train.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    train.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                       help="where session.jsonl and checkpoints/ go (default runs/<time>-<script>)")
    train.add_argument("--headless", action="store_true", help="no dashboard: a status line and events")
    train.add_argument("--detach", action="store_true",
                       help="run the job in the background (headless, output in RUN_DIR/job.log) and "
                            "attach the dashboard to it: q leaves it running, amp-tui attach RUN_DIR "
                            "comes back")
    train.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                       help="continue RUN_DIR from its newest valid checkpoint, appending to its session")
    train.add_argument("--checkpoint-every", type=argtypes.positive_int, default=None, metavar="N",
                       help="save a checkpoint every N steps")


def _probe_options(train) -> None:
    """The per-layer figures: how often, at what cost, and what they forecast."""
    train.add_argument("--probe-every", type=argtypes.probe_every, default="auto", metavar="auto|N",
                       help="per-layer figures: auto (default) spaces them to --probe-budget and probes "
                            "every step from the first sign of trouble; N: every N steps")
    train.add_argument("--probe-budget", type=argtypes.budget, default=1.0, metavar="PERCENT",
                       help="with --probe-every auto: the most amp-tui may cost, probes and step records "
                            "together, in percent of the training time (default 1)")
    train.add_argument("--probe-alert-bits", type=argtypes.nonnegative, default=3.0, metavar="BITS",
                       help="with --probe-every auto: every step is probed once a layer has less "
                            "headroom than this (default 3): its activations, or its unscaled gradients")
    train.add_argument("--forecast-horizon", type=argtypes.positive_int, default=500, metavar="STEPS",
                       help="alert when a layer's headroom forecast says it reaches the dtype's max within "
                            "this many steps (default 500)")
    train.add_argument("--fp8-filter", type=Path, default=None, metavar="FILE",
                       help="with fp8 (--dtype fp8, ctl RUN dtype=fp8): a Python file defining "
                            "module_filter_fn(module, fqn), such as an fp8 what-if's fp8-filter-step-N.py; "
                            "default: the what-if of the first fp8 step chooses")
    train.add_argument("--fp8-every", type=argtypes.fp8_every, default=None, metavar="auto|N",
                       help="the fp8 what-if (8, ctl RUN fp8) recurring: every N steps, or auto (spaced to "
                            "at most a quarter of --probe-budget); default: only when asked")
    train.add_argument("--underflow-every", type=argtypes.positive_int, default=10, metavar="N",
                       help="underflow shares on every Nth probed step (default 10; 1 = every probe)")


def _steering_options(train) -> None:
    """What a non-finite step does, and what steers the run besides the keys."""
    train.add_argument("--on-nonfinite", choices=NONFINITE_POLICIES, default=None,
                       help="what a non-finite loss does (default: skip headless, pause in the "
                            "dashboard); fallback moves fp16 -> bf16 -> fp32 when it keeps failing; "
                            "isolate puts the overflowing op's module in fp32 (u undoes it)")
    train.add_argument("--repeat-interventions", type=Path, default=None, metavar="RUN",
                       help="apply a recording's interventions again at the same steps")
    train.add_argument("--at", type=argtypes.at, action="append", default=[], metavar="STEP:ACTION",
                       help="schedule an intervention before STEP: dtype=bf16|fp16|fp32|fp8, scale=4096, "
                            "scale=half, save, restore=latest|PATH, pause (repeatable)")
    train.add_argument("--refresh-rate", type=argtypes.positive, default=20.0, metavar="HZ",
                       help="dashboard refreshes per second at most (default 20)")
    train.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                       help="also write TensorBoard event files into DIR as the run goes "
                            "(pip install 'amp-tui[tensorboard]')")
    train.add_argument("--wandb", nargs="?", const=True, default=None, metavar="PROJECT",
                       help="also log the run to W&B as it goes, in PROJECT (default $WANDB_PROJECT or "
                            "amp-tui; WANDB_MODE=offline works; pip install 'amp-tui[wandb]')")
    train.add_argument("--mlflow", default=None, metavar="URI",
                       help="also log the run to MLflow as it goes, at tracking URI, e.g. "
                            "sqlite:///mlflow.db (pip install 'amp-tui[mlflow]')")
    train.add_argument("--fp32-modules", action="append", default=[], metavar="PATTERN",
                       help="run modules whose name matches PATTERN (fnmatch, e.g. 'blocks.*.attn') "
                            "with autocast off and float32 inputs (repeatable)")


def _rank_options(train) -> None:
    """Several processes: torch.distributed, DDP and FSDP2."""
    ranks = train.add_argument_group("several processes (torch.distributed, DistributedDataParallel)")
    ranks.add_argument("--nproc", type=argtypes.positive_int, default=None, metavar="N",
                       help="run N ranks on this machine through torch.distributed.run (gloo on the "
                            "CPU, nccl on cuda:LOCAL_RANK); rank 0 records, the dashboard attaches to it")
    ranks.add_argument("--nnodes", type=argtypes.positive_int, default=None, metavar="N",
                       help="machines in the job (with --rdzv-endpoint; run the same command on each)")
    ranks.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="where the machines of a --nnodes job meet (torchrun's c10d rendezvous)")
    ranks.add_argument("--fsdp", action="store_true",
                       help="shard the model across the ranks with FSDP2's fully_shard: each block "
                            "('fsdp_blocks' from setup(), else each module owning parameters), then the root")
    ranks.add_argument("--fsdp-checkpoint", choices=("auto", "full", "sharded"), default="auto",
                       help="how a model sharded with FSDP2 is checkpointed: full (gathered on rank 0 into "
                            "one safetensors file), sharded (each rank writes its own shards with "
                            "torch.distributed.checkpoint, into a folder step-N.shards) or auto (default: "
                            "full while the whole state fits easily in the host's available memory)")
    ranks.add_argument("--dist-timeout", type=argtypes.positive, default=None, metavar="S",
                       help="how long a rank waits for the others in a collective before the job stops "
                            "with an error (default 300)")


def _guard_options(train) -> None:
    """The scale guards, their alerts and the fallback ladder."""
    guards = train.add_argument_group("scale guards and the fallback ladder")
    guards.add_argument("--min-scale", type=argtypes.positive, default=None, metavar="X",
                        help="never let the loss scale fall below X")
    guards.add_argument("--alert-scale-drops", type=argtypes.positive_int, default=5, metavar="N",
                        help="alert when the scale falls N times in a row (default 5)")
    guards.add_argument("--alert-skip-share", type=argtypes.share, default=0.25, metavar="X",
                        help="alert when more than X (0-1) of a window's updates are skipped (default 0.25)")
    guards.add_argument("--alert-window", type=argtypes.positive_int, default=100, metavar="N",
                        help="steps in the skip-share window (default 100)")
    guards.add_argument("--fallback-after", type=argtypes.positive_int, default=3, metavar="K",
                        help="with --on-nonfinite fallback: move down the ladder after K non-finite "
                             "steps in a row (default 3)")
    guards.add_argument("--storm-share", type=argtypes.share, default=0.5, metavar="X",
                        help="... or when X (0-1) of the last --storm-window updates were skipped (default 0.5)")
    guards.add_argument("--storm-window", type=argtypes.positive_int, default=20, metavar="N",
                        help="steps in the skip-storm window (default 20)")
    guards.add_argument("--isolate-widen", type=argtypes.nonnegative_int, default=2, metavar="N",
                        help="with --on-nonfinite isolate: enclosing modules tried when the op's module in "
                             "fp32 leaves the step non-finite, before the ladder (default 2)")
    guards.add_argument("--rollback", action="store_true",
                        help="with --on-nonfinite fallback: restore the newest good checkpoint before moving")




def cmd_train(args) -> int:
    from amp_tui.cli import distributed
    from amp_tui.cli.train_options import attach_tensorboard, attach_trackers, run_config, tensorboard_problem
    from amp_tui.cli.training_process import keep_imports_out_of_collections
    from amp_tui.core.commands import CommandError
    from amp_tui.job.build import build_run
    from amp_tui.training.devices import DeviceError
    from amp_tui.training.script import ScriptError
    from amp_tui.training.step.engine import PrecisionRefused

    if args.tensorboard is not None:
        problem = tensorboard_problem(args.tensorboard)
        if problem:
            return error(problem)
    if args.wandb is not None or args.mlflow is not None:
        from amp_tui.recording.trackers import check_trackers
        problem = check_trackers(wandb=args.wandb, mlflow=args.mlflow)
        if problem:
            return error(problem)
    if args.dist_timeout is not None and args.dist_timeout <= MIN_DIST_TIMEOUT_S:
        return error(f"--dist-timeout {args.dist_timeout:g}: give more than {MIN_DIST_TIMEOUT_S:g} s "
                     "(a paused job's ranks meet about once a second)")
    if distributed.is_rank():          # one process of a torchrun job (amp-tui train --nproc or torchrun)
        return distributed.train_rank(args)
    if args.fsdp and args.nproc is None and args.nnodes is None:
        return error("--fsdp shards the model across several ranks: give --nproc N (or run under torchrun)")
    if args.detach:
        return cmd_detach(args)
    if args.nproc is not None or args.nnodes is not None or args.rdzv_endpoint is not None:
        return distributed.launch(args, dashboard=use_dashboard(args))
    dashboard = use_dashboard(args)
    if args.own_process:
        keep_imports_out_of_collections()
    try:
        run, warnings = build_run(run_config(args, on_nonfinite_default="pause" if dashboard else "skip"))
    except (ScriptError, DeviceError, CommandError, PrecisionRefused) as exc:
        return error(str(exc))
    problem = attach_tensorboard(run, args.tensorboard) or attach_trackers(run, args)
    if problem:
        return error(problem)
    if dashboard:
        return run_dashboard(run, warnings, refresh_rate=args.refresh_rate)
    # Imported once the run is built: Rich and the summary's modules are not needed before the
    # first step (whose forward build_run's pre-flight has run), so they don't delay it.
    from amp_tui.cli.headless import run_headless
    return run_headless(run, warnings)


def use_dashboard(args) -> bool:
    """--headless, pipes and CI keep the headless mode."""
    return not args.headless and interactive()


# ---- the dashboard ------------------------------------------------------------------------------

def run_dashboard(run, warnings: list[str], refresh_rate: float = 20.0) -> int:
    """Run `run` under the dashboard; after the app exits make sure the run stopped and the session
    is flushed, print the run summary, and return the exit status."""
    from amp_tui.sources.live import LiveSource
    from amp_tui.ui.app import STOP_TIMEOUT_S, create_app
    from amp_tui.ui.hangup import HangupGuard, terminal_input

    source = LiveSource(run)
    app = create_app(source, refresh_rate=refresh_rate, warnings=warnings)
    with HangupGuard(app, source, run, STOP_TIMEOUT_S, input_fd=terminal_input()):
        crashed = False
        try:
            app.run()
            crashed = app.return_code not in (None, 0)
        finally:
            # The app may have exited without the quit sequence (a crash, SIGHUP): stop here.
            # Nobody can free space or answer any more: what the disk refuses is given up.
            run.unattended()
            stopped = source.stop(0.0 if app.forced_exit else STOP_TIMEOUT_S)
            if not stopped:
                run.close()   # flush the session; the training thread is stuck inside a step
        return _finish(run, warnings, stopped, crashed)


def _finish(run, warnings: list[str], stopped: bool, crashed: bool) -> int:
    """After the app: the summary on the terminal, and the exit status."""
    from rich.console import Console
    from rich.text import Text

    from amp_tui.cli.summary import print_after_run
    from amp_tui.ui.text import visible

    console = Console(highlight=False)
    try:
        for warning in warnings:
            console.print(Text(f"warning: {visible(warning)}", style="yellow"))
        if not stopped:
            console.print(Text("amp-tui: the training step did not finish in time; exited without "
                               "waiting for it", style="bold red"))
        print_after_run(run, console)
    except OSError:
        pass  # the terminal is gone (SSH drop): the session on disk is what matters
    if crashed or not stopped or run.state == "error" or run.error is not None:
        return max(run.exit_status, 1)
    return run.exit_status


# ---- --detach -----------------------------------------------------------------------------------

def cmd_detach(args) -> int:
    """`train --detach`: the same command line as a headless background job, then attach to it."""
    import subprocess
    import time

    from amp_tui.cli.argv import split_script_args
    from amp_tui.cli.attach import attach_dashboard
    from amp_tui.core.run_dirs import default_run_dir
    from amp_tui.job.steering.control import job_alive

    argv = args.command_line[1:]
    ours, script_argv = split_script_args(argv)
    run_dir = args.resume or args.run_dir or default_run_dir(args.script)
    job = [a for a in ours if a != "--detach"]
    if not args.headless:
        job.append("--headless")
    if args.resume is None and args.run_dir is None:
        job += ["--run-dir", str(run_dir)]
    job = [sys.executable, "-m", "amp_tui", *job] + (["--", *script_argv] if "--" in argv else [])
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "job.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(job, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + DETACH_WAIT_S
    while not (job_alive(run_dir) and (run_dir / "session.jsonl").is_file()):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                why = f"the job did not open its control socket within {DETACH_WAIT_S:.0f} s"
            else:
                why = f"the job exited with status {proc.returncode} before it started"
            print(f"amp-tui: error: {why}; the end of {log_path}:", file=sys.stderr)
            print(_tail(log_path), file=sys.stderr)
            return 1
        time.sleep(0.1)
    if args.headless or not interactive():
        print(f"amp-tui: the job runs in the background (pid {proc.pid}) in {run_dir}; "
              f"attach with: amp-tui attach {run_dir}")
        return 0
    return attach_dashboard(run_dir, args.refresh_rate)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read it: {exc})"
