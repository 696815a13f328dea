"""Lightning, recorded and steered by amp-tui:

    trainer = L.Trainer(callbacks=[AmpTuiCallback()], precision="16-mixed")   # or "bf16-mixed", "32-true"
    trainer.fit(model, train_loader)

It works with both import names, `lightning` and `pytorch_lightning`. The GradScaler is
`trainer.precision_plugin.scaler`. Where Lightning's hooks fall in one optimizer step (automatic
optimization), and what the callback does there:

    on_train_batch_start      the step boundary: queued commands apply, a pause holds (begin_step)
      training_step, backward under the precision plugin's forward_context: the monitor's autocast
      scaler.unscale_         16-mixed: the GradScaler hook reads the gradients here
    on_before_optimizer_step  without a GradScaler the gradients are read here (the optimizer is
                              stepped with a closure that runs the backward inside its step())
      scaler.step             GradScaler's found-inf: the skipped flag (Lightning has none, and steps
                              the scheduler even after a skip)
    on_train_batch_end        the loss (outputs["loss"], times accumulate_grad_batches); the step
                              recorded, then the boundary again; a stop sets trainer.should_stop
    on_train_end              the recording ends (on_exception: with the error and its traceback)

Gradient accumulation: each micro-batch opens and ends a monitored block; the blocks before the
update are folded into its step, and commands apply only between updates.

Several processes are watched only where the model is sharded with FSDP2 (ModelParallelStrategy,
`configure_model` calling `fully_shard`): every rank drives its monitor, which agrees with the
others at the boundaries as amp_tui.monitor does in a loop of one's own; rank 0 records.
"""

from __future__ import annotations

import dataclasses
import sys

from amp_tui.integrations.common import loss_tensor, options, refuse_engine_keys, require, warn, with_dtype
from amp_tui.job.monitor import Monitor
from amp_tui.training.sharding import is_sharded

try:
    _pl = require("lightning.pytorch", package="lightning", extra="lightning",
                  needed_by="amp_tui.integrations.lightning")
except ImportError as missing:
    try:   # the older name of the same package
        _pl = require("pytorch_lightning", package="lightning", extra="lightning",
                      needed_by="amp_tui.integrations.lightning")
    except ImportError:
        raise missing from None

import torch  # noqa: E402

FRAMEWORK = "Lightning"
_DTYPES = {"16-mixed": "float16", "bf16-mixed": "bfloat16", "32-true": "float32", "32": "float32",
           "16-true": "float16", "bf16-true": "bfloat16"}


class AmpTuiCallback(_pl.Callback):
    """Record every optimizer step of the Lightning Trainer it is given to, and serve the control
    socket while it fits.

    Options as amp_tui.monitor's: `run_dir` (default $AMP_TUI_RUN_DIR, set by `amp-tui run`, or
    runs/<time>-<script>), `probe_every`, `probe_budget`, `probe_alert_bits`, `underflow_every`,
    `checkpoint_every`, `control`, `announce`, `tensorboard_dir`, `forecast_horizon`, `min_scale`,
    `fp32_modules`, `fp8_every`, `wandb`, `mlflow` (into the framework's own W&B or MLflow run
    where it has one).
    The dtype is the Trainer's (`precision=`)."""

    def __init__(self, *unexpected, run_dir=None, probe_every="auto", probe_budget=1.0, probe_alert_bits=3.0,
                 underflow_every=10, checkpoint_every=None, control=True, announce=True, tensorboard_dir=None,
                 dtype=None, on_nonfinite="skip", forecast_horizon=500, min_scale=None,
                 fp32_modules=(), fp8_every=None, wandb=None, mlflow=None):
        if unexpected:
            raise TypeError(f"AmpTuiCallback() takes no {type(unexpected[0]).__name__}: Lightning hands the "
                            "callback its Trainer, so give it to the Trainer: L.Trainer(callbacks=[AmpTuiCallback()])")
        self.options = options(dtype, FRAMEWORK, 'L.Trainer(precision="bf16-mixed") or ("16-mixed")', {
            "run_dir": run_dir, "probe_every": probe_every, "probe_budget": probe_budget,
            "probe_alert_bits": probe_alert_bits, "underflow_every": underflow_every,
            "checkpoint_every": checkpoint_every, "control": control, "announce": announce,
            "tensorboard_dir": tensorboard_dir, "on_nonfinite": on_nonfinite,
            "forecast_horizon": forecast_horizon, "min_scale": min_scale,
            "fp32_modules": fp32_modules, "fp8_every": fp8_every, "wandb": wandb, "mlflow": mlflow})
        self.monitor: Monitor | None = None
        self._plugin = None      # the precision plugin whose forward_context is ours while watching
        self._in_step = False

    # ---- Lightning's hooks -----------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module):
        self._close()
        plugin = trainer.precision_plugin
        dtype = _DTYPES.get(str(plugin.precision))
        reason = _not_watched(trainer, pl_module, dtype)
        if reason:
            if trainer.is_global_zero:
                print(f"amp-tui: not watching this run: {reason}", file=sys.stderr, flush=True)
            return
        scaler = getattr(plugin, "scaler", None)
        scaler = scaler if isinstance(scaler, torch.amp.GradScaler) else None
        configs = trainer.lr_scheduler_configs
        self.monitor = Monitor(pl_module, trainer.optimizers[0],
                               _with_loggers_runs(with_dtype(self.options, dtype), trainer), scaler=scaler,
                               scheduler=configs[0].scheduler if len(configs) == 1 else None, framework=FRAMEWORK)
        kinds = {c.__name__ for c in type(plugin).__mro__}
        engine = "DeepSpeed" if "DeepSpeedPrecision" in kinds or "DeepSpeedStrategy" in {
            c.__name__ for c in type(trainer.strategy).__mro__} else None
        if engine is not None:
            refuse_engine_keys(self.monitor, engine)
            return
        if "MixedPrecision" in kinds or type(plugin).__name__ == "Precision":
            # Every forward of the run (training, validation) enters the plugin's forward_context:
            # the monitor's autocast there is what `d` switches. Lightning turns autocast's weight
            # cache off (a weight cast under no_grad must not be reused with grad): so do we.
            plugin.forward_context = lambda: self.monitor.autocast(cache_enabled=False)
            self._plugin = plugin
        else:
            self.monitor.controller.refuse("dtype", f"dtype change refused: Lightning's {type(plugin).__name__} "
                                f"(precision={plugin.precision!r}) fixes the dtype; d switches the autocast of "
                                'precision="16-mixed", "bf16-mixed" and "32-true" runs')
        if dtype == "float16" and scaler is None:
            warn(self.monitor, "fp16_without_scaler", f"precision={plugin.precision!r} with no GradScaler: "
                 "nothing scales the loss", cause="fp16 gradients below 6e-8 flush to zero and an overflow is "
                 "applied as it is", fix='precision="16-mixed" with its GradScaler, or "bf16-mixed"')

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.monitor is None:
            return
        if self._in_step:    # the batch before ended without on_train_batch_end (skipped)
            self._end(None)
        self.monitor.begin_step()
        self._in_step = True
        if self.monitor.should_stop:
            trainer.should_stop = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.monitor is not None:
            self.monitor.gradients_ready()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is None:
            return
        loss = loss_tensor(outputs)
        if isinstance(loss, torch.Tensor) and trainer.accumulate_grad_batches != 1:
            loss = loss * trainer.accumulate_grad_batches   # Lightning divided it for the backward
        self._end(loss)
        if self.monitor.should_stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        if self.monitor is not None and not isinstance(exception, KeyboardInterrupt):
            self._in_step = False
            self.monitor.fail_step(exception)
        self._close()

    # ---- helpers ---------------------------------------------------------------------------------
    def _end(self, loss) -> None:
        if self._in_step:
            self._in_step = False
            self.monitor.end_step(loss if isinstance(loss, torch.Tensor) else None)

    def _close(self) -> None:
        monitor, self.monitor = self.monitor, None
        if self._plugin is not None:
            vars(self._plugin).pop("forward_context", None)
            self._plugin = None
        if monitor is None:
            return
        if self._in_step:
            self._in_step = False
            monitor.end_step(None)   # a batch Lightning left unfinished is not recorded
        monitor.close()


def _not_watched(trainer, pl_module, dtype: str | None) -> str | None:
    """Why the callback leaves this run alone (None: it watches it)."""
    if not getattr(pl_module, "automatic_optimization", True):
        # training_step steps the optimizer itself: no batch hook sees its loss or its update.
        return ("automatic_optimization is False (training_step steps the optimizer itself); "
                "use amp_tui.monitor around the optimizer step there instead")
    if trainer.world_size > 1 and not is_sharded(pl_module):
        return (f"it trains in {trainer.world_size} processes, and AmpTuiCallback watches one, or a model "
                "sharded with FSDP2 (ModelParallelStrategy) on every rank")
    if dtype is None:
        return f"precision={trainer.precision_plugin.precision!r} is none of fp16, bf16, fp32"
    if len(trainer.optimizers) != 1:
        return f"it has {len(trainer.optimizers)} optimizers, and AmpTuiCallback watches one"
    return None


def _with_loggers_runs(options, trainer):
    """The options, logging into the Trainer's own W&B or MLflow run where a logger of it has one:
    MLFlowLogger's run is not MLflow's active run, so its id is handed on; WandbLogger starts
    `wandb.run` when its experiment is first asked for."""
    for logger in getattr(trainer, "loggers", ()):
        kind = type(logger).__name__
        if kind == "MLFlowLogger" and options.mlflow and options.mlflow_run_id is None:
            uri = getattr(logger, "_tracking_uri", None)
            options = dataclasses.replace(options, mlflow=uri or options.mlflow, mlflow_run_id=logger.run_id)
        elif kind == "WandbLogger" and options.wandb:
            logger.experiment   # noqa: B018 - starts the logger's run, which amp-tui then logs into
    return options
