"""A Source over a fixed list of records: a frozen picture of a run.

Snapshot tests and the documentation screenshots use it so the picture never depends on timing.
Commands are recorded in `sent` and, unless `answer` is None, answered at once with that outcome.
"""

from __future__ import annotations

import math
from typing import Iterable

from amp_tui.core.commands import Command, Outcome
from amp_tui.sources.buffer import RunBuffer
from amp_tui.sources.protocol import Snapshot


class FixedSource:
    def __init__(self, records: Iterable[dict], *, mode: str = "live", checkpoints: Iterable = (),
                 answer: Outcome | None = None, run_dir=None, session_path=None):
        self.mode = mode
        self.can_steer = mode in ("live", "attached")
        self.detaches = mode == "attached"
        self.output_path = None
        self.playback = None   # a frozen picture: nothing to play
        self.buffer = RunBuffer(mode)
        for record in records:
            self.buffer.feed(record)
        self._checkpoints = list(checkpoints)
        self.answer = answer
        self.sent: list[Command] = []
        self.run_dir = run_dir
        self.session_path = session_path
        self.started = False
        self.stopped = False

    def snapshot(self) -> Snapshot:
        return self.buffer.snapshot()

    def send(self, command: Command) -> tuple[bool, str]:
        if not self.can_steer:
            return False, "a recording can't be steered"
        self.sent.append(command)
        if self.answer is not None and command.on_done is not None:
            command.on_done(self.answer)
        return True, f"{command.text()} queued"

    def held_stop(self) -> str | None:
        return None   # nothing here is recorded: a stop is never held

    def checkpoints(self) -> list:
        return list(self._checkpoints)

    def start(self) -> None:
        self.started = True

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        self.stopped = True
        return True


# ---- a synthetic run (deterministic: no randomness, no wall clock) ------------------------------

SYNTHETIC_LAYERS = (
    ["wte", "wpe"]
    + [f"h.{b}.{part}" for b in range(6) for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2",
                                                      "mlp.c_fc", "mlp.c_proj")]
    + ["ln_f"]
)
SYNTHETIC_START = 1_700_000_000.0   # the records' wall time at step 0
SYNTHETIC_STEP_S = 0.125            # 8 steps a second


def synthetic_records(steps: int = 400, *, total: int | None = 1000, ending: str = "running",
                      layers: list[str] | None = None, forecast: bool = False) -> list[dict]:
    """A plausible fp16 run: init_scale overflow skips, a scheduled scale change, checkpoints, a
    layer creeping towards 65504. `ending`: "running", "nonfinite" (the last loss is NaN and the
    run paused itself), "error" (the script raised), or "finished". `forecast`: from step
    FORECAST_FROM on, the creeping layer's headroom forecast (`layers.eta`), its trend's own."""
    names = list(layers or SYNTHETIC_LAYERS)
    hot = names.index("h.4.mlp.c_fc") if "h.4.mlp.c_fc" in names else len(names) // 2
    records: list[dict] = [{
        "type": "header", "format": "amp-tui-session", "version": 1, "script": "demos/gpt_tiny.py",
        "device": {"type": "cpu", "index": None, "backend": "CPU", "name": "Test CPU"},
        "dtype": "float16", "init_scale": 65536.0, "steps": total, "layers": names,
        "on_nonfinite": "pause"}]
    scale, skipped, updates = 65536.0, 0, 0
    for step in range(steps):
        t = SYNTHETIC_START + step * SYNTHETIC_STEP_S
        overflow = step < 3 or step in (180, 181)
        loss = 6.0 * (0.985 ** step) + 0.8 + 0.15 * math.sin(step / 3.0)
        grow = 1.0 + step / 150.0
        act = [round(0.8 * grow * (1 + (i % 7)), 5) for i in range(len(names))]
        act[hot] = round(1800.0 * grow ** 2.2, 1)         # the outlier: ~3e4 by step 400
        grad = [("Infinity" if overflow and i == hot else round(2e-3 / (1 + i % 5), 7))
                for i in range(len(names))]
        weight = [round(0.02 + 0.01 * (i % 9), 5) for i in range(len(names))]
        last = step == steps - 1
        record = {"type": "step", "step": step, "loss": round(loss, 6), "scale": scale,
                  "skipped": overflow, "dtype": "float16", "micro_batches": 1,
                  "time": round(t, 3), "duration": SYNTHETIC_STEP_S,
                  "layers": {"act": act, "grad": grad, "weight": weight}}
        if forecast and step >= FORECAST_FROM:
            record["layers"]["eta"] = [creeping_eta(step) if i == hot else None for i in range(len(names))]
        if ending == "nonfinite" and last:
            record.update(loss="NaN", skipped=True, nonfinite="loss")
            record["layers"]["act"][hot] = "Infinity"
            overflow = True
        skipped += overflow
        updates += not overflow
        record.update(skipped_total=skipped, updates=updates)
        records.append(record)
        if overflow and not (ending == "nonfinite" and last):
            records.append(_event(step, "nonfinite", f"gradients overflowed at scale {scale:g}; first "
                                  f"non-finite gradient: {names[hot]}: update skipped, scale now "
                                  f"{scale / 2:g}", t, where="gradients", layer=names[hot],
                                  scale=scale, dtype="float16"))
            scale /= 2
        if step == 99:
            records.append(_event(step + 1, "intervention", f"loss scale {scale:g} → 4096", t,
                                  action="scale", value=4096.0, source="at",
                                  before={"dtype": "float16", "scale": scale, "init_scale": 65536.0},
                                  after={"dtype": "float16", "scale": 4096.0, "init_scale": 4096.0}))
            scale = 4096.0
        if step % 100 == 99:
            path = f"checkpoints/step-{step + 1:07d}.safetensors"
            records.append(_event(step + 1, "checkpoint_saved", f"checkpoint {path} saved at step "
                                  f"{step + 1} (2.1 MB, 0.04s)", t, path=path,
                                  checkpoint_step=step + 1, dtype="float16", source="checkpoint_every"))
    t = SYNTHETIC_START + steps * SYNTHETIC_STEP_S
    if ending == "nonfinite":
        step = steps - 1
        records.append(_event(step, "nonfinite", f"non-finite loss (NaN) in fp16; first non-finite "
                              f"output: {names[hot]}: update skipped", t, where="loss",
                              layer=names[hot], loss="NaN", scale=scale, dtype="float16"))
        records.append(_event(steps, "paused", f"paused after a non-finite loss at step {step} "
                              "(--on-nonfinite pause): change the dtype, cut the scale or restore",
                              t, reason="nonfinite"))
    elif ending == "error":
        records.append(_event(steps, "error", f"step {steps}: the script raised ValueError: "
                              "batch 7 has no labels (gpt_tiny.py, line 41, in loss_fn)", t,
                              during="step", traceback=SYNTHETIC_TRACEBACK))
        records.append({"type": "end", "step": steps, "status": "error", "updates": updates,
                        "skipped_total": skipped, "dtype": "float16", "scale": scale,
                        "time": round(t, 3), "exit_status": 1})
    elif ending == "finished":
        records.append({"type": "end", "step": steps, "status": "finished", "updates": updates,
                        "skipped_total": skipped, "dtype": "float16", "scale": scale,
                        "time": round(t, 3), "exit_status": 0})
    return records


FORECAST_FROM = 40


def creeping_eta(step: int) -> int:
    """The steps the creeping layer's trend (log2 1800 + 2.2 log2(1 + step/150)) leaves it before
    65504, at its slope at `step`."""
    left = math.log2(65504.0) - math.log2(1800.0 * (1.0 + step / 150.0) ** 2.2)
    slope = 2.2 / (math.log(2) * (150.0 + step))
    return math.ceil(left / slope)


SYNTHETIC_TRACEBACK = """Traceback (most recent call last):
  File "amp_tui/engine.py", line 214, in step
    loss = self.loss_fn(self.model, batch)
  File "demos/gpt_tiny.py", line 41, in loss_fn
    raise ValueError(f"batch {index} has no labels")
ValueError: batch 7 has no labels
"""


def _event(step: int, kind: str, message: str, t: float, **fields) -> dict:
    return {"type": "event", "step": step, "kind": kind, "message": message, "time": round(t, 3),
            **fields}
