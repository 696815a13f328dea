"""One fix, worded for the way of running: the flag under `amp-tui train`, the monitor's argument
and the live command in the user's own loop; and the guards' advice gives way to the fix the op
replay verified, in those words."""

from amp_tui.core.fixes import MONITOR, TRAIN, fix_command, fix_in_words
from amp_tui.training.step.engine import StepResult
from amp_tui.training.step.guards import GuardConfig, PrecisionGuard


def test_a_fix_is_the_flag_under_train_and_the_monitors_argument_with_the_live_command_in_a_loop():
    assert fix_in_words("--fp32-modules 'blocks.0.attn'", TRAIN) == "--fp32-modules 'blocks.0.attn'"
    assert fix_in_words("--dtype bf16", TRAIN) == "--dtype bf16"
    assert fix_in_words("--fp32-modules 'blocks.0.attn'", MONITOR, "runs/x") == \
        "fp32_modules=['blocks.0.attn'], or live: amp-tui ctl runs/x fp32=blocks.0.attn"
    assert fix_in_words("--dtype bf16", MONITOR) == "dtype='bf16', or live: amp-tui ctl RUN dtype=bf16"
    # the live command is the one `f` sends
    assert fix_command("--dtype bf16").text() == "dtype=bf16"
    # the loop's own GradScaler takes the scale; no live command starts a run over
    assert fix_in_words("--init-scale 2048", MONITOR) == "GradScaler(init_scale=2048)"
    assert fix_in_words("lower the scale (s)", MONITOR) == "lower the scale (s)"


def overflow(step, *, fix=None, scale=65536.0):
    """An fp16 step whose gradients overflowed (a large loss at a large scale), with the op
    replay's verified fix when `fix` is given."""
    trace = {"op": "aten.mm", "op_module": "head", "fix": fix, "fix_verified": True} if fix else None
    return StepResult(step=step, loss=2e5, scale=scale, skipped=True, skipped_total=step + 1,
                      updates_applied=0, dtype="float16", micro_batches=1, nonfinite="gradients",
                      op_trace=trace)


def test_the_guards_advice_before_a_verified_fix_is_its_own_and_after_it_the_fix_in_the_loops_words():
    words = lambda fix: fix_in_words(fix, MONITOR)   # noqa: E731
    guard = PrecisionGuard(GuardConfig(alert_scale_drops=2, alert_window=10), words=words)
    scale = 65536.0
    first = guard.observe(overflow(0, scale=scale), scale / 2, True).alerts + \
        guard.observe(overflow(1, scale=scale / 2), scale / 4, True).alerts
    [drops] = [a for a in first if a.reason == "scale_drops"]
    # No replay verified anything yet: the rule of thumb, in the loop's words.
    assert "GradScaler(init_scale=" in drops.fix and "--init-scale" not in drops.fix
    later = []
    for step in range(2, 12):
        scale /= 2
        later += guard.observe(overflow(step, fix="--dtype bf16", scale=scale), scale / 2, True).alerts
    # The skip-share alert comes once 10 steps fill its window, at step 9, whose replay verified the fix.
    [share] = [a for a in later if a.reason == "skip_share"]
    assert share.fix == "dtype='bf16', or live: amp-tui ctl RUN dtype=bf16 (verified on step 9)"
