"""The command line's imports: the read side (report, replay --headless, ls, export, plot) runs
in a fresh interpreter without ever importing torch, and compare, whose module does import it,
is registered with a parser that imports no torch either."""

import subprocess
import sys

import pytest

from amp_tui.cli import main

from support import OVERFLOW_SCRIPT

# Runs the command line as `amp-tui ARGS...` would, then says whether torch was imported.
PROBE = ("import sys; sys.argv = ['amp-tui', *sys.argv[1:]]; from amp_tui.cli import main; "
         "status = main(); print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'); "
         "sys.exit(status)")
HANG_S = 120   # an upper bound for a hung interpreter, not a speed expectation


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A finished run whose recording holds steps, skipped (non-finite) steps and events."""
    where = tmp_path_factory.mktemp("read_side")
    script = where / "overflow.py"
    script.write_text(OVERFLOW_SCRIPT.replace("ACC", "1"), encoding="utf-8")
    run_dir = where / "runs" / "overflowing"
    assert main(["train", str(script), "--headless", "--steps", "4", "--device", "cpu",
                 "--run-dir", str(run_dir)]) == 0
    return run_dir


def run_probe(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=HANG_S)


@pytest.mark.parametrize("command, shows", [
    (["report", "{run}"], "non-finite events"),
    (["report", "{run}", "--json"], '"steps"'),
    (["replay", "{run}", "--headless"], "skipped updates"),
    (["ls", "{runs}"], "overflowing"),
    (["export", "{run}", "--tensorboard", "{tmp}/tb", "--csv", "{tmp}/steps.csv", "--layers-csv",
      "{tmp}/layers.csv"], "exported 4 steps"),
    (["plot", "{run}", "-o", "{tmp}/run.png"], "4 steps"),
])
def test_a_read_side_command_runs_without_importing_torch(recorded_run, tmp_path, command, shows):
    argv = [a.format(run=recorded_run, runs=recorded_run.parent, tmp=tmp_path) for a in command]
    done = run_probe(*argv, cwd=recorded_run.parent)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert shows in done.stdout, done.stdout            # the command did its work
    assert out[-1] == "NO-TORCH", f"amp-tui {' '.join(argv)} imported torch"


def test_train_still_imports_torch_in_the_same_probe(recorded_run, tmp_path):
    """The probe can see torch: a run does import it."""
    script = tmp_path / "overflow.py"
    script.write_text(OVERFLOW_SCRIPT.replace("ACC", "1"), encoding="utf-8")
    done = run_probe("train", str(script), "--headless", "--steps", "1", "--device", "cpu",
                     "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "TORCH"
