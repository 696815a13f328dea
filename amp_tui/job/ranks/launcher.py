"""`python -m amp_tui.job.ranks.launcher RUN_DIR TORCHRUN_ARGS...`: torch.distributed.run, in a process
of its own, with its outcome in amp-tui's terms.

`amp-tui train --nproc N` starts this process: torch.distributed.run's `main()` replaces the
calling process's SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers and never puts them back, so it gets a
process of its own (whose signals torchrun sends on to every rank). Its exit status is rank 0's:
the `exit_status` of the session's end record when rank 0 wrote one, else rank 0's own exit
status (unless torchrun's SIGTERM ended it after another rank failed), else that of the first
rank that failed; a rank that died is named, with where its output went.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from amp_tui.job.ranks.rank_output import rank_log_path


def _end_status(run_dir: Path, since: float) -> int | None:
    """The exit status rank 0 wrote in the end record of this launch (a resumed session holds
    the end records of the launches before it too)."""
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.reader import read_session
    try:
        end = read_session(run_dir / "session.jsonl").end
    except (OSError, SessionFormatError):
        return None
    if not isinstance(end, dict) or not isinstance(end.get("time"), (int, float)) or end["time"] < since:
        return None
    status = end.get("exit_status")
    return status if isinstance(status, int) else None


def _cause(failures: dict) -> int:
    """The rank whose failure set off the others': killed by a signal other than the SIGTERM
    torchrun sends the rest, first, and a rank other than 0 before rank 0 (whose own failure
    is in its recording)."""
    def key(rank):
        f = failures[rank]
        return (not (f.exitcode < 0 and -f.exitcode != signal.SIGTERM), f.timestamp, rank == 0, rank)
    return min(failures, key=key)


def _describe(rank: int, failure, run_dir: Path) -> str:
    code = failure.exitcode
    how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with status {code}"
    where = "" if rank == 0 else f"; its output: {rank_log_path(run_dir, rank)}"
    return f"rank {rank} (pid {failure.pid}) {how}{where}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dir, torchrun_args = Path(argv[0]), argv[1:]
    started = time.time()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(torchrun_args)
    except ChildFailedError as exc:
        failures = exc.failures
        first = _cause(failures)
        print(f"amp-tui: {_describe(first, failures[first], run_dir)}", file=sys.stderr, flush=True)
        ended = _end_status(run_dir, started)
        if ended is not None:
            return ended or 1
        zero = failures.get(0)
        # Rank 0 ended by the SIGTERM torchrun sent it because another rank failed first: that
        # rank's status is the job's (an agreed check fails on every rank; one may end sooner).
        stopped_by_torchrun = zero is not None and zero.exitcode == -signal.SIGTERM and first != 0
        code = zero.exitcode if zero is not None and not stopped_by_torchrun else failures[first].exitcode
        return 128 - code if code < 0 else code
    except SignalException as exc:
        ended = _end_status(run_dir, started)
        return ended if ended is not None else 128 + int(exc.sigval)
    ended = _end_status(run_dir, started)
    return ended if ended is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
