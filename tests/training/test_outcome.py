"""One outcome builder for both drivers (training/step/outcome.py): how a step is classified and
counted, whichever loop ran it."""

import math

from amp_tui.job.drivers.hook_driver import HookDriver
from amp_tui.training.step.engine import GuardedTrainer
from amp_tui.training.step.outcome import CountedSteps, StepOutcomes


def test_a_skip_while_the_scale_comes_down_is_calibration_not_a_nonfinite_step():
    outcomes = StepOutcomes()
    assert outcomes.classify(loss_finite=True, skipped=True, scale=65536.0) == (None, True)
    assert outcomes.classify(loss_finite=True, skipped=False, scale=32768.0) == (None, False)
    # Calibration is over at the first applied update: the next skip is trouble.
    assert outcomes.classify(loss_finite=True, skipped=True, scale=32768.0) == ("gradients", False)


def test_a_nonfinite_loss_or_a_held_back_update_is_never_calibration():
    assert StepOutcomes().classify(loss_finite=False, skipped=True, scale=65536.0) == ("loss", False)
    assert StepOutcomes().classify(loss_finite=True, skipped=True, held_back=True,
                                   scale=65536.0) == ("gradients", False)
    # bf16/fp32, no GradScaler: gradients the loop applied anyway are still a non-finite step.
    assert StepOutcomes().classify(loss_finite=True, skipped=False, gradients_nonfinite=True,
                                   scale=None) == ("gradients", False)


def test_the_counter_moves_on_and_the_counts_take_the_step_in():
    outcomes = StepOutcomes()
    skipped = outcomes.close(skipped=True, applied=False, loss=math.inf, scale=2.0, dtype="float16",
                             micro_batches=1)
    applied = outcomes.close(skipped=False, applied=True, lr=1e-3, loss=1.0, scale=1.0, dtype="float16",
                             micro_batches=1)
    assert (skipped.step, skipped.skipped_total, skipped.updates_applied) == (0, 1, 0)
    assert (applied.step, applied.skipped_total, applied.updates_applied, applied.lr) == (1, 1, 1, 1e-3)
    # A step whose loop never stepped the optimizer (and nothing skipped it) applies nothing.
    idle = outcomes.close(skipped=False, applied=False, loss=1.0, scale=None, dtype="float32", micro_batches=1)
    assert (idle.skipped_total, idle.updates_applied, outcomes.step_index) == (1, 1, 3)


def test_both_drivers_count_through_the_one_builder():
    for driver in (GuardedTrainer, HookDriver):
        assert issubclass(driver, CountedSteps)
        # Neither keeps counts of its own beside the builder's.
        assert not {"step_index", "skipped_total", "updates_applied", "calibration"} & set(vars(driver))
