"""bench/tracker_overhead.py measures what it says: the three arms ran their blocks, each
tracker's observer logged without an error, and its run holds the blocks it was attached for."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from mlflow.tracking import MlflowClient  # noqa: E402

from bench.models import MlpSpec  # noqa: E402
from bench.tracker_overhead import measure  # noqa: E402


def test_each_tracker_is_measured_against_the_same_loop_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    folder = tmp_path / "bench"
    folder.mkdir()
    result = measure(MlpSpec(depth=4, width=16, batch=8), "float16", rounds=2, block=5, warmup=2, folder=folder)
    for tracker in ("mlflow", "wandb"):
        figures = result[tracker]
        assert figures["error"] is None
        assert math.isfinite(figures["cost_pct"]) and figures["thread_cpu_pct"] >= 0
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("amp-tui").experiment_id])[0]
    logged = client.get_metric_history(run.info.run_id, "amp/loss")
    assert len(logged) == 2 * 5     # its two blocks' steps, not the others'
