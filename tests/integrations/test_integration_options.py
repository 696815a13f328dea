"""The framework callbacks take amp_tui.monitor's options and honour AMP_TUI_RUN_DIR as it does:
a session where `amp-tui run` says, TensorBoard event files with every step the framework ran."""

from __future__ import annotations

import inspect

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import amp_tui
from amp_tui.integrations import lightning as lightning_integration
from amp_tui.integrations import transformers as transformers_integration
from amp_tui.recording.reader import read_session

from frameworks import hf_trainer, lightning_module_class, pl_trainer, regression_loader

# The framework's own objects, which the callback takes from it.
FRAMEWORKS = {"model", "optimizer", "scaler", "scheduler"}


def keywords(function) -> set[str]:
    return {p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("callback", [transformers_integration.AmpTuiCallback, lightning_integration.AmpTuiCallback])
def test_a_callback_takes_every_option_of_the_monitor(callback):
    wanted = set(inspect.signature(amp_tui.monitor).parameters) - FRAMEWORKS
    assert wanted <= keywords(callback.__init__), wanted - keywords(callback.__init__)


def test_the_trainer_callback_records_where_amp_tui_run_says_and_writes_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TUI_RUN_DIR", str(tmp_path / "said"))
    trainer = hf_trainer(tmp_path, steps=4)
    trainer.add_callback(transformers_integration.AmpTuiCallback(trainer, announce=False,
                                                                 tensorboard_dir=tmp_path / "tb"))
    trainer.train()
    session = read_session(tmp_path / "said")
    assert len(session.steps) == trainer.state.global_step == 4
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(e.step for e in acc.Scalars("train/loss")) == [s["step"] for s in session.steps]


def test_the_lightning_callback_records_where_amp_tui_run_says_and_writes_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TUI_RUN_DIR", str(tmp_path / "said"))
    callback = lightning_integration.AmpTuiCallback(announce=False, tensorboard_dir=tmp_path / "tb")
    trainer = pl_trainer([callback], steps=4, precision="bf16-mixed")
    trainer.fit(lightning_module_class()(), regression_loader())
    session = read_session(tmp_path / "said")
    assert len(session.steps) == trainer.global_step == 4
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(e.step for e in acc.Scalars("train/loss")) == [s["step"] for s in session.steps]
