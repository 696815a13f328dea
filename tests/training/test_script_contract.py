"""Loading a user's script: every problem exits 2 with one clear line, before any run dir exists."""

import json
import subprocess
import sys

import pytest

from amp_tui.cli import main
from amp_tui.recording.reader import read_session

BASE = '''
import torch
from torch import nn

def parts():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 4), torch.randn(8, 1))]
    def loss_fn(model, batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])
    return model, opt, loss_fn, batches
'''

CASES = {
    "no setup": ("x = 1\n", "has no setup() function"),
    "missing key": (BASE + "def setup():\n    m, o, l, b = parts()\n    return {'model': m, 'optimizer': o, 'batches': b}\n",
                    "returned no 'loss_fn'"),
    "wrong model type": (BASE + "def setup():\n    m, o, l, b = parts()\n    return {'model': 3, 'optimizer': o, 'loss_fn': l, 'batches': b}\n",
                         "'model' from train_script.py is a int, not a torch.nn.Module"),
    "wrong optimizer": (BASE + "def setup():\n    m, o, l, b = parts()\n    return {'model': m, 'optimizer': 'sgd', 'loss_fn': l, 'batches': b}\n",
                        "not a torch.optim.Optimizer"),
    "foreign params": (BASE + "def setup():\n    m, o, l, b = parts()\n    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)\n"
                       "    return {'model': m, 'optimizer': other, 'loss_fn': l, 'batches': b}\n",
                       "holds a parameter that is not in 'model'"),
    "non-scalar loss": (BASE + "def setup():\n    m, o, l, b = parts()\n"
                        "    return {'model': m, 'optimizer': o, 'loss_fn': lambda model, batch: model(batch[0]), 'batches': b}\n",
                        "not a scalar"),
    "empty batches": (BASE + "def setup():\n    m, o, l, b = parts()\n    return {'model': m, 'optimizer': o, 'loss_fn': l, 'batches': []}\n",
                      "'batches' from train_script.py is empty"),
    "setup raises": (BASE + "def setup():\n    raise RuntimeError('no data here')\n",
                     "setup() in train_script.py raised RuntimeError: no data here (train_script.py line"),
    "loss_fn raises": (BASE + "def setup():\n    m, o, l, b = parts()\n    def bad(model, batch):\n        raise KeyError('labels')\n"
                       "    return {'model': m, 'optimizer': o, 'loss_fn': bad, 'batches': b}\n",
                       "loss_fn in train_script.py failed on the first batch: KeyError: 'labels'"),
    "syntax error": ("def setup(:\n", "syntax error at line 1"),
    "bad accumulate": (BASE + "def setup():\n    m, o, l, b = parts()\n    return {'model': m, 'optimizer': o, 'loss_fn': l, 'batches': b, 'accumulate': 0}\n",
                       "'accumulate' from train_script.py must be a positive integer"),
    "returns a list": ("def setup():\n    return [1, 2]\n", "returned list; it must return a dict"),
    "generator batches": (BASE + "def setup():\n    m, o, l, b = parts()\n"
                          "    return {'model': m, 'optimizer': o, 'loss_fn': l, 'batches': (x for x in b * 3)}\n",
                          "'batches' from train_script.py is a generator, an iterator that can be read only once"),
    "map batches": (BASE + "def setup():\n    m, o, l, b = parts()\n"
                    "    return {'model': m, 'optimizer': o, 'loss_fn': l, 'batches': map(tuple, b * 3)}\n",
                    "'batches' from train_script.py is a map, an iterator that can be read only once"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_script_exits_2_with_one_line(case, write_script, tmp_path, capsys, monkeypatch):
    body, expected = CASES[case]
    script = write_script(body)
    monkeypatch.chdir(tmp_path)
    status = main(["train", str(script), "--headless", "--steps", "2"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("amp-tui: error: ")
    assert expected in err
    assert not (tmp_path / "runs").exists(), "no run directory for a bad script"


def test_missing_file_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "nope.py", "--headless"]) == 2
    assert "script not found: nope.py" in capsys.readouterr().err


def test_python_m_entry_point_without_setup(write_script, tmp_path):
    script = write_script("x = 1\n")
    proc = subprocess.run([sys.executable, "-m", "amp_tui", "train", str(script), "--headless"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "amp-tui: error: train_script.py has no setup() function; the script contract needs one"]
    assert "Traceback" not in proc.stderr


def test_context_and_argv_reach_the_script(write_script, tmp_path, capsys):
    script = write_script(BASE + '''
import sys
seen = {}
def setup(ctx):
    seen["device"], seen["argv"], seen["sys.argv"] = ctx.device, ctx.argv, list(sys.argv)
    (__import__("pathlib").Path(__file__).parent / "seen.txt").write_text(repr(seen))
    m, o, l, b = parts()
    return {"model": m, "optimizer": o, "loss_fn": l, "batches": b}
''')
    status = main(["train", str(script), "--headless", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                   "--", "--lr", "3"])
    assert status == 0
    seen = (tmp_path / "seen.txt").read_text()
    assert "'device': 'cpu'" in seen and "'argv': ['--lr', '3']" in seen
    assert f"'sys.argv': ['{script}', '--lr', '3']" in seen


MODULE_LEVEL_ARGPARSE = BASE + '''
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
ARGS = parser.parse_args()          # at import, as scripts run with `python script.py` often do

def setup():
    (__import__("pathlib").Path(__file__).parent / "lr.txt").write_text(repr(ARGS.lr))
    m, o, l, b = parts()
    return {"model": m, "optimizer": o, "loss_fn": l, "batches": b}
'''


def test_module_level_argparse_sees_the_script_arguments(write_script, tmp_path, monkeypatch):
    script = write_script(MODULE_LEVEL_ARGPARSE)
    command = ["train", str(script), "--headless", "--steps", "1", "--run-dir", str(tmp_path / "run"),
               "--", "--lr", "3"]
    monkeypatch.setattr(sys, "argv", ["amp-tui", *command])  # what the script would see by default
    assert main(command) == 0
    assert (tmp_path / "lr.txt").read_text() == "3.0"
    assert sys.argv == ["amp-tui", *command]  # amp-tui's own command line is put back


def test_module_level_argparse_rejects_in_its_own_name(write_script, tmp_path, monkeypatch, capsys):
    script = write_script(MODULE_LEVEL_ARGPARSE)
    command = ["train", str(script), "--headless", "--run-dir", str(tmp_path / "run"), "--", "--bogus"]
    monkeypatch.setattr(sys, "argv", ["amp-tui", *command])
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"{script.name}: error: unrecognized arguments: --bogus" in err
    assert "amp-tui: error: train_script.py called sys.exit(2) while being imported" in err
    assert "--headless" not in err and not (tmp_path / "run").exists()


def test_setup_may_return_an_object(write_script, tmp_path):
    script = write_script(BASE + '''
from amp_tui import TrainSetup
def setup():
    m, o, l, b = parts()
    return TrainSetup(model=m, optimizer=o, loss_fn=l, batches=b)
''')
    assert main(["train", str(script), "--headless", "--steps", "2", "--run-dir", str(tmp_path / "r")]) == 0


def test_bad_flags_exit_2(mlp_script, tmp_path, capsys):
    assert main(["train", str(mlp_script), "--headless", "--run-dir", str(tmp_path / "r"), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    # what argparse checks (an --at among them) exits as argparse does
    for flags, expected in ((["--at", "ten:save"], "'ten' is not a step number"),
                            (["--at", "3:dtype=int8"], "unknown dtype"),
                            (["--at", "3:explode"], "unknown action"),
                            (["--init-scale", "-4"], "must be a positive finite number")):
        with pytest.raises(SystemExit) as exc:
            main(["train", str(mlp_script), "--headless", "--run-dir", str(tmp_path / "r"), *flags])
        assert exc.value.code == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


ITERATOR_CLASS = BASE + '''
class Batches:
    """An iterator class of the user's own: RESTART decides whether __iter__ starts over."""
    def __init__(self, items):
        self.items, self.i = items, 0
    def __iter__(self):
        if RESTART:
            self.i = 0
        return self
    def __next__(self):
        if self.i == len(self.items):
            raise StopIteration
        self.i += 1
        return self.items[self.i - 1]

def setup():
    m, o, l, b = parts()
    return {"model": m, "optimizer": o, "loss_fn": l, "batches": Batches(b * 3)}
'''


def test_an_iterator_that_runs_out_stops_the_run_with_one_line(write_script, tmp_path, capsys):
    script = write_script(ITERATOR_CLASS.replace("RESTART", "False"))
    run_dir = tmp_path / "run"
    status = main(["train", str(script), "--headless", "--steps", "6", "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert status == 1
    lines = [json.loads(line) for line in (run_dir / "session.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["type"] == "step"] == [0, 1, 2]  # every batch was used
    error = next(r for r in lines if r.get("kind") == "error")
    assert error["step"] == 3 and error["message"] == (
        "step 3: 'batches' ran out after 3 batches and can't start over (its iter() is itself, "
        "like a generator's): return a list or a DataLoader")
    assert error["traceback"] == "" and "Traceback" not in out and "amp_tui" not in out
    assert lines[-1]["type"] == "end" and lines[-1]["status"] == "error"


def test_an_iterator_class_that_starts_over_is_accepted(write_script, tmp_path):
    script = write_script(ITERATOR_CLASS.replace("RESTART", "True"))
    run_dir = tmp_path / "run"
    assert main(["train", str(script), "--headless", "--steps", "7", "--run-dir", str(run_dir)]) == 0
    assert read_session(run_dir).steps[-1]["step"] == 6
