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
    (["export", "{run}", "--mlflow", "sqlite:///{tmp}/mlflow.db"], "exported 4 steps"),
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


FREEZE_PROBE = '''
import gc
import sys
from pathlib import Path

import torch

FROZEN_AT_IMPORT = gc.get_freeze_count()


def setup(ctx=None):
    # Frozen before the script was imported, and nothing since: what the script makes is not.
    Path(sys.argv[1]).write_text(f"{FROZEN_AT_IMPORT} {gc.get_freeze_count()}")
    model = torch.nn.Linear(2, 1)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "loss_fn": lambda m, x: m(x).pow(2).mean(), "batches": [torch.ones(4, 2)] * 2}
'''


def test_train_freezes_what_its_imports_made_before_the_script_alone(tmp_path):
    """As the program, `amp-tui train` moves the objects its imports made out of the collector's
    walks before it loads the script (nothing the script makes is frozen); called in someone's
    process (`main(argv)`), it leaves that process's objects as they were."""
    import gc

    script, seen = tmp_path / "freeze_probe.py", tmp_path / "seen.txt"
    script.write_text(FREEZE_PROBE, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "amp_tui", "train", str(script), "--headless", "--steps", "1",
                           "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--", str(seen)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    at_import, at_setup = map(int, seen.read_text().split())
    assert at_import > 10_000 and at_setup == at_import   # torch's and amp-tui's objects, frozen
    before = gc.get_freeze_count()
    assert main(["train", str(script), "--headless", "--steps", "1", "--device", "cpu",
                 "--run-dir", str(tmp_path / "in-process"), "--", str(seen)]) == 0
    assert gc.get_freeze_count() == before
