"""The integrations when things go wrong: a framework that is not installed (amp-tui itself never
needs one, an integration says what to pip install), and a framework's step that raises (the
session keeps it with its traceback, and the process can watch another run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from lightning.pytorch import Callback

from amp_tui.integrations.lightning import AmpTuiCallback as LightningCallback
from amp_tui.integrations.transformers import AmpTuiCallback
from amp_tui.recording.reader import read_session

from frameworks import hf_trainer, lightning_module_class, pl_trainer, regression_loader

# Run in a fresh interpreter in which the named packages can't be imported, as if not installed.
WITHOUT = '''
import sys
BLOCKED = {blocked!r}

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
'''


def run_without(blocked: set[str], code: str) -> subprocess.CompletedProcess:
    program = WITHOUT.format(blocked=sorted(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)


def test_amp_tui_needs_no_framework():
    done = run_without({"transformers", "accelerate", "lightning", "pytorch_lightning"}, """
        import amp_tui, amp_tui.cli, amp_tui.integrations
        from amp_tui.cli import build_parser
        build_parser()
        print("monitor" if callable(amp_tui.monitor) else "no monitor")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "monitor"


@pytest.mark.parametrize("module, blocked, line", [
    ("transformers", {"transformers"},
     "amp_tui.integrations.transformers needs transformers, which is not installed: "
     "pip install 'amp-tui[transformers]' (or pip install transformers)"),
    ("transformers", {"accelerate"},
     "the Hugging Face Trainer needs accelerate, which is not installed: "
     "pip install 'amp-tui[transformers]' (or pip install accelerate)"),
    ("lightning", {"lightning", "pytorch_lightning"},
     "amp_tui.integrations.lightning needs lightning, which is not installed: "
     "pip install 'amp-tui[lightning]' (or pip install lightning)"),
])
def test_an_integration_without_its_framework_says_what_to_install(module, blocked, line):
    done = run_without(blocked, f"""
        try:
            import amp_tui.integrations.{module}
        except ImportError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == line


def test_lightning_under_its_older_name_alone_is_enough():
    done = run_without({"lightning"}, """
        import pytorch_lightning as pl
        from amp_tui.integrations.lightning import AmpTuiCallback
        print(issubclass(AmpTuiCallback, pl.Callback))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_a_trainer_step_that_raises_is_recorded_with_its_traceback_and_the_process_can_watch_again(tmp_path):
    trainer = hf_trainer(tmp_path, steps=8)
    trainer.add_callback(AmpTuiCallback(trainer, run_dir=tmp_path / "run", announce=False))
    calls = []

    def broken(module, inputs, output):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("bad batch 4")
    trainer.model.transformer.h[0].register_forward_hook(broken)
    with pytest.raises(RuntimeError, match="bad batch 4"):
        trainer.train()
    session = read_session(tmp_path / "run")
    assert [s["step"] for s in session.steps] == [0, 1, 2]
    error = [e for e in session.events if e["kind"] == "error"][0]
    assert "bad batch 4" in error["message"] and "Traceback" in error["traceback"]
    assert session.end["status"] == "error"
    again = hf_trainer(tmp_path, steps=2)
    again.add_callback(AmpTuiCallback(again, run_dir=tmp_path / "again", announce=False))
    again.train()
    assert len(read_session(tmp_path / "again").steps) == 2


def test_a_lightning_step_that_raises_is_recorded_with_its_traceback(tmp_path):
    class Broken(Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step == 3:
                raise RuntimeError("bad batch 3")
    trainer = pl_trainer([LightningCallback(run_dir=tmp_path / "run", announce=False), Broken()], steps=8)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="bad batch 3"):
        trainer.fit(lightning_module_class()(), regression_loader())
    session = read_session(tmp_path / "run")
    assert [s["step"] for s in session.steps] == [0, 1, 2]
    error = [e for e in session.events if e["kind"] == "error"][0]
    assert "bad batch 3" in error["message"] and "Traceback" in error["traceback"]
    assert session.end["status"] == "error"
