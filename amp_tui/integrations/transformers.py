"""The Hugging Face Trainer, recorded and steered by amp-tui:

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(AmpTuiCallback(trainer))
    trainer.train()

A TrainerCallback is handed the model, the optimizer and the scheduler, not the Trainer, and
the GradScaler lives at `trainer.accelerator.scaler`: hence the argument.

Where the Trainer's hooks fall in one optimizer step, and what the callback does there:

    on_step_begin           the step boundary: queued commands apply, a pause holds (begin_step)
      training_step         wrapped: its loss, as computed (before the logs' NaN filter)
    on_substep_end          between micro-batches of gradient accumulation: folded into the step
      clip_grad_norm_       the gradients are read as it starts, before the clipping (with a
                            GradScaler at Accelerate's unscale_ inside it, where they are unscaled)
    on_pre_optimizer_step   a Trainer that clips nowhere: the gradients are read here
                            (transformers >= 4.45; before, the optimizer's step pre-hook reads
                            them at the same point)
      optimizer.step()      GradScaler's found-inf: the skipped flag (right for fused AdamW)
    on_step_end             the step recorded, then the boundary again; a stop sets
                            control.should_training_stop, so the Trainer ends its loop itself
    on_train_end            the recording ends

`d` puts the model's forward under the monitor's autocast in place of the one Accelerate fixed
at start-up (see amp_tui/training/step/forward_autocast.py).
"""

from __future__ import annotations

import sys

from amp_tui.core.precision import SHORT
from amp_tui.integrations.common import options, refuse_engine_keys, require, warn, with_dtype
from amp_tui.job.monitor import Monitor

# accelerate first: transformers imports it, and the line must name what is missing.
require("accelerate", package="accelerate", extra="transformers", needed_by="the Hugging Face Trainer")
require("transformers", package="transformers", extra="transformers", needed_by="amp_tui.integrations.transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

FRAMEWORK = "the Trainer"


class AmpTuiCallback(TrainerCallback):
    """Record every optimizer step of `trainer` and serve the control socket while it trains.

    Options as amp_tui.monitor's: `run_dir` (default $AMP_TUI_RUN_DIR, set by `amp-tui run`, or
    runs/<time>-<script>), `probe_every`, `probe_budget`, `probe_alert_bits`, `underflow_every`,
    `checkpoint_every`, `control`, `announce`, `tensorboard_dir`, `forecast_horizon`, `min_scale`,
    `fp32_modules`, `fp8_every`, `wandb`, `mlflow` (into the framework's own W&B or MLflow run
    where it has one).
    The dtype is the Trainer's (fp16=/bf16= in
    TrainingArguments)."""

    def __init__(self, trainer: Trainer | None = None, *, run_dir=None, probe_every="auto", probe_budget=1.0,
                 probe_alert_bits=3.0, underflow_every=10, checkpoint_every=None, control=True, announce=True,
                 tensorboard_dir=None, dtype=None, on_nonfinite="skip", forecast_horizon=500, min_scale=None,
                 fp32_modules=(), fp8_every=None, wandb=None, mlflow=None):
        if trainer is None:
            raise TypeError("AmpTuiCallback(trainer): pass the Trainer it watches, "
                            "trainer.add_callback(AmpTuiCallback(trainer)); a TrainerCallback is not handed "
                            "the Trainer, and its GradScaler is trainer.accelerator.scaler")
        if not isinstance(trainer, Trainer):
            raise TypeError(f"AmpTuiCallback(trainer): got a {type(trainer).__name__}, not a transformers.Trainer "
                            "(build the Trainer first, then trainer.add_callback(AmpTuiCallback(trainer)))")
        self.trainer = trainer
        self.options = options(dtype, FRAMEWORK, "TrainingArguments(bf16=True) or (fp16=True)", {
            "run_dir": run_dir, "probe_every": probe_every, "probe_budget": probe_budget,
            "probe_alert_bits": probe_alert_bits, "underflow_every": underflow_every,
            "checkpoint_every": checkpoint_every, "control": control, "announce": announce,
            "tensorboard_dir": tensorboard_dir, "on_nonfinite": on_nonfinite,
            "forecast_horizon": forecast_horizon, "min_scale": min_scale,
            "fp32_modules": fp32_modules, "fp8_every": fp8_every, "wandb": wandb, "mlflow": mlflow})
        self.monitor: Monitor | None = None
        self._loss = None
        self._in_step = False
        self._own_training_step = None
        self._own_clip = None
        self._watch_train()

    # ---- the Trainer's hooks ---------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        trainer = self.trainer
        if args.world_size > 1:
            if state.is_world_process_zero:
                print(f"amp-tui: not watching this run: it trains in {args.world_size} processes, and "
                      "AmpTuiCallback watches one", file=sys.stderr, flush=True)
            return
        self._close()   # a train() before that ended without on_train_end
        accelerator = trainer.accelerator
        engine = _engine_owning_the_scale(trainer)
        scaler = accelerator.scaler if isinstance(accelerator.scaler, torch.amp.GradScaler) else None
        dtype = _dtype_in_force(accelerator)
        self.monitor = Monitor(trainer.model, optimizer or trainer.optimizer, with_dtype(self.options, dtype),
                               scaler=scaler, scheduler=lr_scheduler or trainer.lr_scheduler, framework=FRAMEWORK)
        self._watch_training_step()
        self._watch_clipping()
        if engine is not None:
            refuse_engine_keys(self.monitor, engine)
            return
        self.monitor.autocast_forward(trainer.model)
        if args.fp16 and dtype != "float16":
            warn(self.monitor, "fp16_without_scaler", "TrainingArguments(fp16=True), but Accelerate gave this run "
                 f"no GradScaler and no fp16 autocast: it trains in {SHORT[dtype]}",
                 cause=f"Accelerate runs fp16 only on a GPU (this run is on {accelerator.device.type})",
                 fix="fp16 on a GPU; here bf16=True, or d in the dashboard")
        elif dtype == "float16" and scaler is None:
            warn(self.monitor, "fp16_without_scaler", "fp16 autocast with no GradScaler: nothing scales the loss",
                 cause="Accelerate made no GradScaler for this device",
                 fix="bf16=True, or d in the dashboard")

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        self._begin()
        if self.monitor.should_stop:
            control.should_training_stop = True

    def on_substep_end(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        self._end()     # one micro-batch: folded into the optimizer step that follows
        self._begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.gradients_ready()

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        self._end()
        if self.monitor.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    # ---- around the Trainer's own methods --------------------------------------------------------
    def _watch_train(self) -> None:
        """A failure anywhere in train() is recorded with its traceback, and the recording ends."""
        train = self.trainer.train

        def watched_train(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            except BaseException as exc:
                if self.monitor is not None and not isinstance(exc, KeyboardInterrupt):
                    self._in_step = False
                    self.monitor.fail_step(exc)
                raise
            finally:
                self._close()
        self.trainer.train = watched_train

    def _watch_training_step(self) -> None:
        """The loss of each micro-batch as the Trainer computes it (training_step divides it by the
        accumulation count; that is undone), before its logs' NaN filter."""
        trainer = self.trainer
        self._own_training_step = vars(trainer).get("training_step")   # one set on the instance before
        training_step = trainer.training_step

        def watched_training_step(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            accumulated = getattr(trainer, "current_gradient_accumulation_steps",
                                  trainer.args.gradient_accumulation_steps)
            self._loss = loss * accumulated if accumulated != 1 else loss
            return loss
        trainer.training_step = watched_training_step

    def _watch_clipping(self) -> None:
        """The Trainer clips (Accelerate's clip_grad_norm_) before on_pre_optimizer_step; the
        figures are the gradients the backward made, so they are read as the clipping starts."""
        accelerator = self.trainer.accelerator
        self._own_clip = vars(accelerator).get("clip_grad_norm_")
        clip = accelerator.clip_grad_norm_

        def watched_clip_grad_norm_(*args, **kwargs):
            if self.monitor is not None:
                self.monitor.gradients_ready()
            return clip(*args, **kwargs)
        accelerator.clip_grad_norm_ = watched_clip_grad_norm_

    def _begin(self) -> None:
        if self._in_step:
            self._end()
        self.monitor.begin_step()
        self._in_step, self._loss = True, None

    def _end(self) -> None:
        if self._in_step:
            self._in_step = False
            loss, self._loss = self._loss, None
            self.monitor.end_step(loss)

    def _close(self) -> None:
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return
        if self._own_training_step is not None:
            self.trainer.training_step = self._own_training_step
        else:
            vars(self.trainer).pop("training_step", None)
        if self._own_clip is not None:
            self.trainer.accelerator.clip_grad_norm_ = self._own_clip
        else:
            vars(self.trainer.accelerator).pop("clip_grad_norm_", None)
        if self._in_step:
            self._in_step = False
            monitor.end_step(None)   # a step the Trainer left unfinished is not recorded
        monitor.close()


def _dtype_in_force(accelerator) -> str:
    """What the forward runs in: Accelerate's autocast when it wrapped the forward, else fp32."""
    if not accelerator.native_amp:
        return "float32"
    if accelerator.mixed_precision == "fp16":
        return "float16"
    return "bfloat16" if accelerator.mixed_precision == "bf16" else "float32"


def _engine_owning_the_scale(trainer) -> str | None:
    """DeepSpeed or Megatron-LM: an engine whose own optimizer scales the loss (no torch GradScaler)."""
    kind = str(getattr(trainer.accelerator.distributed_type, "value", trainer.accelerator.distributed_type))
    if getattr(trainer, "is_deepspeed_enabled", False) or kind.upper() == "DEEPSPEED":
        return "DeepSpeed"
    if kind.upper() == "MEGATRON_LM":
        return "Megatron-LM"
    return None
