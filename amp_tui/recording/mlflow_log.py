"""A session in MLflow: amp_tui.recording.tracking's metrics as the run's metric histories (steps
as MLflow steps), events as tags, the events' table and the session file as artifacts.

- metrics: the `amp/...` series, in `log_batch` calls of MLflow's largest batch;
- params: the header's settings (`amp/dtype`, `amp/init_scale`...), tags for what can differ
  between two headers of one run (a second `trainer.train()`, a resume: `amp/started`...);
- tags: `amp/dtype`, the dtype in force (and `amp/dtype_history`), every event as
  `amp/events/NNNN` ("step 57 nonfinite: ... op: aten::mm ... fix: ..."), and the last
  non-finite step's `amp/nonfinite/step`, `op`, `layer` and `fix`;
- artifacts, at the end: `amp-tui/session.jsonl` and `amp-tui/events.jsonl`.

`mlflow_backend(uri)` logs into the run active on the calling thread where there is one (the HF
Trainer's MLflowCallback starts one before the callbacks' on_train_begin) and its tracking URI is
the one asked for; else it starts a run of its own in the experiment MLFLOW_EXPERIMENT_NAME
(or "amp-tui") and ends it with the session. The SQLite store works offline:
`sqlite:///mlflow.db` (MLflow 3 deprecates the file store); the "amp-tui" experiment it creates
there keeps its artifacts in `mlruns/` beside the database file.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from amp_tui.recording.extras import require
from amp_tui.recording.tracking import EventRow

EXTRA = "mlflow"
EXPERIMENT = "amp-tui"
MAX_METRICS = 1000          # MLflow's MAX_METRICS_PER_BATCH
MAX_TAGS = 100              # MLflow's MAX_PARAMS_TAGS_PER_BATCH
MAX_TAG_CHARS = 8000        # MLflow's MAX_TAG_VAL_LENGTH
PARAMS = ("script", "way", "dtype", "init_scale", "steps", "accumulate", "max_grad_norm", "probe_every",
          "probe_budget", "on_nonfinite", "optimizer", "scheduler", "parameters", "world_size", "layers")


def _mlflow():
    return require("mlflow", EXTRA, "MLflow logging")


def check_available() -> None:
    """Raise MissingExtra unless mlflow can be imported."""
    _mlflow()


class MlflowBackend:
    name = "MLflow"

    def __init__(self, client, run_id: str, *, owned: bool, tracking_uri: str):
        entities = require("mlflow.entities", EXTRA, "MLflow logging")
        self._metric, self._param, self._tag = entities.Metric, entities.Param, entities.RunTag
        self.client = client
        self.run_id = run_id
        self.owned = owned
        self.tracking_uri = tracking_uri
        self._events = 0
        self._dtypes: list[str] = []
        self._params_logged = False

    # ---- TrackerBackend ------------------------------------------------------------------------
    def log_header(self, params: dict[str, str]) -> None:
        fixed = {f"amp/{k}": v for k, v in params.items() if k in PARAMS}
        tags = {f"amp/{k}": v for k, v in params.items() if k not in PARAMS}
        if not self._params_logged:
            existing = self.client.get_run(self.run_id).data.params
            # A second header of one run (a resume, a second train()) may not change a param.
            fixed = {k: v for k, v in fixed.items() if k not in existing}
            self.client.log_batch(self.run_id, params=[self._param(k, v) for k, v in fixed.items()],
                                  synchronous=True)
            self._params_logged = True
        self._tags(tags)

    def log_steps(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        batch = []
        metric = self._metric
        for step, wall, metrics in rows:
            stamp = int(wall * 1000)
            for key, value in metrics.items():
                batch.append(metric(key, value if not math.isinf(value) else math.copysign(1.7976931348623157e308,
                                                                                          value), stamp, step))
                if len(batch) == MAX_METRICS:
                    self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
                    batch = []
        if batch:
            self.client.log_batch(self.run_id, metrics=batch, synchronous=True)

    def log_dtype(self, dtype: str, step: int, time: float) -> None:
        self._dtypes.append(f"{dtype} from step {step}")
        self._tags({"amp/dtype": dtype, "amp/dtype_history": "; ".join(self._dtypes)})

    def log_events(self, rows: list[EventRow]) -> None:
        tags = {}
        for row in rows:
            tags[f"amp/events/{self._events:04d}"] = f"step {row.step} {row.kind}: {row.text()}"[:MAX_TAG_CHARS]
            self._events += 1
            if row.kind == "nonfinite":
                tags["amp/nonfinite/step"] = str(row.step)
                for key in ("op", "layer", "where", "fix"):
                    tags[f"amp/nonfinite/{key}"] = row.details.get(key, "")
        self._tags(tags)

    def finish(self, events: list[EventRow], session: Path | None, status: str) -> None:
        try:
            self.client.log_text(self.run_id, "".join(json.dumps(row.as_dict()) + "\n" for row in events),
                                 "amp-tui/events.jsonl")
            if session is not None and session.exists():
                self.client.log_artifact(self.run_id, str(session), "amp-tui")
        finally:
            if self.owned:
                self.client.set_terminated(self.run_id, status)

    def _tags(self, tags: dict[str, str]) -> None:
        items = [self._tag(k, v[:MAX_TAG_CHARS]) for k, v in tags.items()]
        for i in range(0, len(items), MAX_TAGS):
            self.client.log_batch(self.run_id, tags=items[i:i + MAX_TAGS], synchronous=True)


def mlflow_backend(uri: str | None = None, *, run_name: str | None = None, run_id: str | None = None,
                   reuse_active: bool = True) -> MlflowBackend:
    """The MLflow run to log into at tracking `uri` (None: MLflow's own, MLFLOW_TRACKING_URI or its
    default): `run_id` where given (Lightning's MLFlowLogger's), else the active run where
    `reuse_active` and it is at that URI, else a new run named `run_name`. Raises MissingExtra
    without mlflow, and MLflow's own errors for a URI it can't open."""
    mlflow = _mlflow()
    tracking = require("mlflow.tracking", EXTRA, "MLflow logging")
    current = mlflow.get_tracking_uri()
    uri = str(uri) if uri is not None else current
    client = tracking.MlflowClient(tracking_uri=uri)
    if run_id is not None:
        return MlflowBackend(client, run_id, owned=False, tracking_uri=uri)
    active = mlflow.active_run() if reuse_active else None
    if active is not None and _same_uri(uri, current):
        return MlflowBackend(client, active.info.run_id, owned=False, tracking_uri=uri)
    experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
    if not experiment_id:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(name, artifact_location=_artifacts_beside(uri)))
    run = client.create_run(experiment_id, start_time=int(time.time() * 1000), run_name=run_name,
                            tags={"amp-tui": "session"})
    return MlflowBackend(client, run.info.run_id, owned=True, tracking_uri=uri)


def _artifacts_beside(uri: str) -> str | None:
    """A SQLite store's artifacts in `mlruns/` beside its file (MLflow's default is ./mlruns in
    whatever directory the run started from); None, MLflow's own choice, for other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(os.path.abspath(uri[len("sqlite:///"):])).parent.joinpath("mlruns").as_uri()


def _same_uri(a: str, b: str) -> bool:
    if a == b:
        return True
    for prefix in ("sqlite:///", "file://"):
        if a.startswith(prefix) and b.startswith(prefix):
            return os.path.realpath(a[len(prefix):]) == os.path.realpath(b[len(prefix):])
    return False
