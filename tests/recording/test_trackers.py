"""W&B and MLflow, live (`train --mlflow/--wandb`, `monitor(mlflow=, wandb=)`, the callbacks) and from
a recording (`export`): what each tracker's own reader gives back is the session.

MLflow is read through `MlflowClient` from its SQLite store; W&B offline (WANDB_MODE=offline) through
its run file, parsed with wandb's own protocol buffers (tests/wandb_offline.py). One recorded demo
feeds both: fp16 steps whose gradients overflow (non-finite events traced to their op), the scale
coming down, per-layer figures on its probed steps.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import wandb_offline

from amp_tui.cli import main
from amp_tui.core.jsonsafe import read_float

from support import DEMOS, MLP_SCRIPT, strict_lines

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402

STEPS = 14
FIGURES = {"act": "max_abs_act", "grad": "max_abs_grad", "weight": "max_abs_weight"}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One `amp-tui train` run logged live to both trackers."""
    root = tmp_path_factory.mktemp("trackers")
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true")
    try:
        assert main(["train", str(DEMOS / "loss_scale_overflow.py"), "--headless", "--steps", str(STEPS),
                     "--device", "cpu", "--run-dir", str(root / "run"), "--mlflow", f"sqlite:///{root}/mlflow.db",
                     "--wandb", "amp-tui-tests"]) == 0
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    lines = strict_lines(root / "run" / "session.jsonl")
    return {"root": root, "header": lines[0], "steps": [r for r in lines if r["type"] == "step"],
            "events": [r for r in lines if r["type"] == "event"], "session": root / "run" / "session.jsonl"}


def equal(recorded, logged) -> bool:
    value = read_float(recorded)
    return (math.isnan(value) and math.isnan(logged)) or value == logged


def mlflow_equal(recorded, logged) -> bool:
    """MLflow stores an infinity as the largest float of its sign (it takes no inf)."""
    value = read_float(recorded)
    if math.isinf(value):
        return logged == math.copysign(sys.float_info.max, value)
    return equal(value, logged)


def only_run(uri: str):
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("amp-tui")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def history(client, run, key) -> dict[int, float]:
    points = client.get_metric_history(run.info.run_id, key)
    steps = [p.step for p in points]
    assert len(steps) == len(set(steps)), f"{key}: a step logged twice"
    return {p.step: p.value for p in points}


def test_the_demo_has_what_the_checks_need(live):
    assert any(e["kind"] == "nonfinite" and e.get("op") for e in live["events"])
    assert any("layers" in s for s in live["steps"]) and len(live["steps"]) == STEPS
    # An overflowed gradient among the figures: MLflow stores its infinity its own way.
    assert any("Infinity" in (s["layers"].get("grad") or []) for s in live["steps"] if "layers" in s)
    # An overflowed gradient among the figures: MLflow stores its infinity its own way.
    assert any("Infinity" in (s["layers"].get("grad") or []) for s in live["steps"] if "layers" in s)
    assert len({s["scale"] for s in live["steps"]}) > 3


def test_mlflow_holds_the_sessions_scale_step_for_step_and_its_layers(live):
    client, run = only_run(f"sqlite:///{live['root']}/mlflow.db")
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    steps = live["steps"]
    assert history(client, run, "amp/loss_scale") == {s["step"]: s["scale"] for s in steps}
    assert history(client, run, "amp/skipped") == {s["step"]: float(s["skipped"]) for s in steps}
    losses = history(client, run, "amp/loss")
    assert all(mlflow_equal(s["loss"], losses[s["step"]]) for s in steps) and len(losses) == len(steps)
    probed = [s for s in steps if "layers" in s]
    names = live["header"]["layers"]
    for figure, tag in FIGURES.items():
        for i, name in enumerate(names):
            series = history(client, run, f"amp/layers/{name}/{tag}")
            want = {s["step"]: s["layers"][figure][i] for s in probed
                    if s["layers"].get(figure) and s["layers"][figure][i] is not None}
            assert series.keys() == want.keys(), (name, figure)
            assert all(mlflow_equal(want[k], series[k]) for k in want), (name, figure)
    assert history(client, run, f"amp/layers/{names[0]}/headroom_bits").keys() <= {s["step"] for s in probed}


def test_mlflow_holds_the_nonfinite_event_with_its_op_every_event_and_the_session(live, tmp_path):
    client, run = only_run(f"sqlite:///{live['root']}/mlflow.db")
    tags = run.data.tags
    last = [e for e in live["events"] if e["kind"] == "nonfinite"][-1]
    assert tags["amp/nonfinite/op"] == last["op"] and tags["amp/nonfinite/step"] == str(last["step"])
    assert tags["amp/nonfinite/fix"] == last["fix"] and tags["amp/dtype"] == "float16"
    events = sorted(k for k in tags if k.startswith("amp/events/"))
    assert len(events) == len(live["events"])
    assert tags[events[0]].startswith(f"step {live['events'][0]['step']} {live['events'][0]['kind']}: ")
    params = run.data.params
    assert params["amp/dtype"] == "float16" and params["amp/layers"] == str(len(live["header"]["layers"]))
    assert (live["root"] / "mlruns").is_dir()      # beside the store, not where the run started
    session = client.download_artifacts(run.info.run_id, "amp-tui/session.jsonl", str(tmp_path))
    assert open(session, "rb").read() == live["session"].read_bytes()
    table = client.download_artifacts(run.info.run_id, "amp-tui/events.jsonl", str(tmp_path))
    assert [line for line in open(table)] and len(open(table).readlines()) == len(live["events"])


def test_wandb_offline_holds_the_sessions_series_alerts_and_the_session(live):
    path = wandb_offline.run_file(live["root"])
    rows = [r for r in wandb_offline.history(path) if "amp/loss_scale" in r]
    assert [(r["amp/step"], r["amp/loss_scale"]) for r in rows] == [(s["step"], s["scale"]) for s in live["steps"]]
    probed = [s for s in live["steps"] if "layers" in s]
    by_step = {r["amp/step"]: r for r in rows}
    name = live["header"]["layers"][-1]
    for s in (s for s in probed if s["layers"].get("weight")):
        want = s["layers"]["weight"][-1]
        assert equal(want, float(by_step[s["step"]][f"amp/layers/{name}/max_abs_weight"]))
    alerts = wandb_offline.alerts(path)
    first = next(e for e in live["events"] if e["kind"] == "nonfinite")
    nonfinite = [a for a in alerts if a.title == "amp-tui: nonfinite"]
    # One alert a minute of a kind: the run is shorter, so the first one is the one sent.
    assert len(nonfinite) == 1 and nonfinite[0].level == "ERROR"
    assert f"step {first['step']}:" in nonfinite[0].text and f"op: {first['op']}" in nonfinite[0].text
    kinds = {a.type for a in wandb_offline.artifacts(path)}
    assert {"amp-tui-session", "run_table"} <= kinds


def test_export_logs_what_the_live_run_logged(live, tmp_path):
    uri = f"sqlite:///{tmp_path}/exported.db"
    assert main(["export", str(live["root"] / "run"), "--mlflow", uri]) == 0
    client, run = only_run(uri)
    live_client, live_run = only_run(f"sqlite:///{live['root']}/mlflow.db")
    assert sorted(run.data.metrics) == sorted(live_run.data.metrics)
    for key in ("amp/loss_scale", "amp/updates_applied", f"amp/layers/{live['header']['layers'][0]}/max_abs_grad"):
        exported, logged = history(client, run, key), history(live_client, live_run, key)
        assert exported.keys() == logged.keys() and all(equal(exported[k], logged[k]) for k in logged), key
    assert run.data.tags["amp/nonfinite/op"] == live_run.data.tags["amp/nonfinite/op"]


def test_the_monitor_logs_into_the_active_wandb_run_not_a_second_one(tmp_path, monkeypatch):
    import torch
    import wandb

    import amp_tui
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    own = wandb.init(project="mine", dir=tmp_path)   # wandb's settings of the process may hold another dir
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False, control=False,
                             wandb=True) as monitor:
            for _ in range(5):
                with monitor.step() as step:
                    loss = model(torch.randn(8, 4)).pow(2).mean()
                    step.loss = loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                own.log({"mine/loss": loss.item()})
        assert wandb.run is own    # the user's run goes on: amp-tui did not finish it
    finally:
        own.finish()
    path = wandb_offline.run_file(tmp_path)
    rows = wandb_offline.history(path)
    assert [r["amp/step"] for r in rows if "amp/loss" in r] == [0, 1, 2, 3, 4]
    assert sum("mine/loss" in r for r in rows) == 5


def test_the_trainers_mlflow_run_gets_the_figures_not_a_second_run(tmp_path, monkeypatch):
    from amp_tui.integrations import transformers as transformers_integration

    from frameworks import hf_trainer

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.chdir(tmp_path)   # the experiment the Trainer makes keeps its artifacts in ./mlruns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "amp-tui")
    before = mlflow.get_tracking_uri()
    try:
        trainer = hf_trainer(tmp_path, steps=4, report_to=["mlflow"])
        trainer.add_callback(transformers_integration.AmpTuiCallback(trainer, announce=False, control=False,
                                                                     run_dir=tmp_path / "run", mlflow=True))
        trainer.train()
    finally:
        mlflow.set_tracking_uri(before)
    client, run = only_run(uri)
    assert "loss" in run.data.metrics or "train_loss" in run.data.metrics   # the Trainer's own
    losses = history(client, run, "amp/loss")
    steps = [r for r in strict_lines(tmp_path / "run" / "session.jsonl") if r["type"] == "step"]
    assert sorted(losses) == [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(mlflow_equal(s["loss"], losses[s["step"]]) for s in steps)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "amp-tui")] == [
        "amp-tui/events.jsonl", "amp-tui/session.jsonl"]


def test_a_missing_tracker_package_is_named_before_the_run(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    script = tmp_path / "mlp.py"
    script.write_text(MLP_SCRIPT, encoding="utf-8")
    assert main(["train", str(script), "--headless", "--steps", "2", "--run-dir", str(tmp_path / "run"),
                 "--mlflow", f"sqlite:///{tmp_path}/m.db"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pip install 'amp-tui[mlflow]'" in err
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_open_its_run_is_one_line(tmp_path, capsys):
    run_dir = tmp_path / "rec"
    script = tmp_path / "mlp.py"
    script.write_text(MLP_SCRIPT, encoding="utf-8")
    assert main(["train", str(script), "--headless", "--steps", "2", "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["export", str(run_dir), "--mlflow", "nosuchscheme://somewhere"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("amp-tui: error: export: MLflow: ") and "nosuchscheme" in err


def test_lightnings_mlflow_logger_run_gets_the_figures_not_a_second_run(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import MLFlowLogger

    from amp_tui.integrations import lightning as lightning_integration

    from frameworks import lightning_module_class, pl_trainer, regression_loader

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.chdir(tmp_path)   # the experiment the logger makes keeps its artifacts in ./mlruns
    logger = MLFlowLogger(experiment_name="amp-tui", tracking_uri=uri)
    callback = lightning_integration.AmpTuiCallback(announce=False, control=False, run_dir=tmp_path / "run",
                                                    mlflow=True)
    trainer = pl_trainer([callback], steps=4, precision="bf16-mixed", logger=logger, log_every_n_steps=1)
    trainer.fit(lightning_module_class()(), regression_loader())
    client, run = only_run(uri)
    assert run.info.run_id == logger.run_id
    assert sorted(history(client, run, "amp/loss")) == [0, 1, 2, 3]
