"""--fp8-every: the fp8 what-if recurring, every N steps or spaced to a share of the probe budget
(job/steering/fp8_schedule.py); each one an `fp8` event from `"source": "schedule"`."""

from __future__ import annotations

from amp_tui.cli import main
from amp_tui.job.steering.fp8_schedule import FIRST_COST_STEPS, FP8_SHARE, Fp8Schedule
from amp_tui.recording.reader import read_session
from amp_tui.training.step.step_result import StepResult


def step(duration: float, fp8: dict | None = None) -> StepResult:
    result = StepResult(step=0, loss=1.0, scale=None, skipped=False, skipped_total=0, updates_applied=1,
                        dtype="bfloat16", micro_batches=1)
    result.duration, result.fp8 = duration, fp8
    return result


def due_steps(schedule: Fp8Schedule, steps: int, *, duration: float, cost: float) -> list[int]:
    """The boundaries a run of `steps` equal steps asks for a what-if at, each costing `cost`."""
    asked, pending = [], False
    for n in range(steps):
        if schedule.commands(n):
            asked.append(n)
            pending = True
        schedule.observe(step(duration, {"seconds": cost} if pending else None))
        pending = False
    return asked


def test_every_n_steps():
    assert due_steps(Fp8Schedule(5, 1.0), 21, duration=0.01, cost=1.0) == [5, 10, 15, 20]
    assert due_steps(Fp8Schedule(None, 1.0), 50, duration=0.01, cost=1.0) == []


def test_auto_keeps_the_what_ifs_within_their_share_of_the_probe_budget():
    duration, cost, budget = 0.01, 0.3, 1.0   # a what-if of 30 steps
    asked = due_steps(Fp8Schedule("auto", budget), 60_000, duration=duration, cost=cost)
    # The first after FIRST_COST_STEPS steps' worth of budget, then each paid for by the training after it.
    first = FIRST_COST_STEPS / (budget / 100 * FP8_SHARE)
    assert abs(asked[0] - first) <= 1
    spent = len(asked) * cost
    assert spent <= 60_000 * duration * budget / 100 * FP8_SHARE + cost
    assert len(asked) >= 4


def test_a_run_with_fp8_every_records_a_what_if_at_each_nth_step(mlp_script, tmp_path):
    assert main(["train", str(mlp_script), "--headless", "--device", "cpu", "--dtype", "bf16", "--steps", "9",
                 "--run-dir", str(tmp_path / "run"), "--fp8-every", "4"]) == 0
    session = read_session(tmp_path / "run")
    events = [e for e in session.events if e["kind"] == "fp8"]
    assert [(e["step"], e["source"]) for e in events] == [(4, "schedule"), (8, "schedule")]
    assert session.header["fp8_every"] == 4
    for e in events:
        assert (tmp_path / "run" / e["path"]).is_file() and (tmp_path / "run" / e["filter"]).is_file()
