"""`--on-nonfinite isolate`: the autopilot puts the overflowing op's module in fp32 once a replay of
the failing step says it is enough (else the enclosing module, else the dtype ladder), lowers the
scale on a backward overflow, says each decision as an `intervention` from "autopilot", and `undo`
takes the last one back. The same in a loop of the user's own, from the next step. Small models on
the CPU (tests/autopilot_cases.py)."""

import math
import threading
from pathlib import Path

import pytest
from autopilot_cases import ATTENTION, DIVERGING, LARGE_LOSS, WIDENING

import amp_tui
from amp_tui.cli import main
from amp_tui.core.commands import Command
from amp_tui.recording.reader import read_session
from amp_tui.recording.timeline import interventions_as_at

from support import train_run, wait_for

TOLERANCE = 0.05   # the mean loss of the last 10 steps, relative to bf16's on the same data


def train(script, run_dir, *flags, steps=40):
    assert main(["train", str(script), "--headless", "--device", "cpu", "--steps", str(steps),
                 "--run-dir", str(run_dir), *flags]) == 0
    return read_session(run_dir)


def autopilot(session) -> list[dict]:
    return [e for e in session.events if e["kind"] == "intervention" and e["source"] == "autopilot"]


def tail_mean(steps, n=10) -> float:
    return sum(s["loss"] for s in steps[-n:]) / n


def test_an_attention_overflow_puts_the_attention_alone_in_fp32_and_trains_like_bf16(write_script, tmp_path):
    script = write_script(ATTENTION)
    isolated = train(script, tmp_path / "isolate", "--dtype", "fp16", "--on-nonfinite", "isolate")
    decisions = autopilot(isolated)
    assert [(d["action"], d["value"], d["verified"], d["widened"]) for d in decisions] == \
        [("fp32", "attn", True, 0)]
    decision = decisions[0]
    assert decision["step"] == 1 and decision["before"] == {"fp32_modules": []}
    assert decision["after"] == {"fp32_modules": ["attn"]}
    assert "attn now in fp32, fp16 everywhere else: step 0 replayed finite with attn in fp32" in decision["message"]
    steps = isolated.steps
    assert sum(s["skipped"] for s in steps) == 1 and steps[0]["skipped"]
    assert {s["dtype"] for s in steps} == {"float16"}
    bf16 = train(script, tmp_path / "bf16", "--dtype", "bf16").steps
    assert abs(tail_mean(steps) - tail_mean(bf16)) <= TOLERANCE * tail_mean(bf16)


def test_the_module_alone_not_enough_widens_to_its_parent_then_the_ladder(write_script, tmp_path):
    script = write_script(WIDENING)
    widened = train(script, tmp_path / "widen", "--dtype", "fp16", "--on-nonfinite", "isolate", steps=3)
    nonfinite = [e for e in widened.events if e["kind"] == "nonfinite"]
    assert [e["op_module"] for e in nonfinite] == ["attn.scores"]
    [decision] = autopilot(widened)
    assert (decision["action"], decision["value"], decision["verified"], decision["widened"]) == \
        ("fp32", "attn", True, 1)
    assert "with attn.scores in fp32 it stayed non-finite" in decision["message"]
    assert [s["skipped"] for s in widened.steps] == [True, False, False]
    # No widening allowed: the dtype ladder's next rung, as the autopilot's decision.
    laddered = train(script, tmp_path / "ladder", "--dtype", "fp16", "--on-nonfinite", "isolate",
                     "--isolate-widen", "0", steps=3)
    [decision] = autopilot(laddered)
    assert (decision["action"], decision["value"]) == ("dtype", "bfloat16")
    assert "step 0 stayed non-finite with attn.scores in fp32 (--isolate-widen 0)" in decision["reason"]
    assert [s["dtype"] for s in laddered.steps] == ["float16", "bfloat16", "bfloat16"]


def test_every_block_overflowing_alike_puts_each_attention_in_fp32_not_the_blocks(tmp_path):
    """The shipped demo: both blocks' attention scores overflow fp16. With the first attention in
    fp32 the replay still overflows, in the second one: that attention joins it, instead of the
    first block, then the whole dtype, being tried."""
    demo = Path(__file__).resolve().parents[2] / "demos" / "attention_overflow.py"
    session = train(demo, tmp_path / "run", "--dtype", "fp16", "--on-nonfinite", "isolate", steps=4)
    [decision] = autopilot(session)
    assert (decision["action"], decision["verified"], decision["widened"]) == ("fp32", True, 0)
    assert decision["after"] == {"fp32_modules": ["blocks.0.attn", "blocks.1.attn"]}
    assert "blocks.0.attn and blocks.1.attn now in fp32, fp16 everywhere else" in decision["message"]
    assert [s["skipped"] for s in session.steps] == [True, False, False, False]
    assert {s["dtype"] for s in session.steps} == {"float16"}


def test_a_backward_overflow_from_the_scale_lowers_it_and_says_so(write_script, tmp_path):
    session = train(write_script(LARGE_LOSS), tmp_path / "run", "--dtype", "fp16", "--on-nonfinite", "isolate",
                    "--init-scale", "1048576", steps=1)
    # A start above GradScaler's default is the user's, not its calibration (training/step/calibration.py).
    [decision] = autopilot(session)
    assert decision["action"] == "scale" and decision["value"] == 524288.0
    assert decision["before"]["scale"] == 1048576.0 and decision["after"]["scale"] == 524288.0
    assert ("loss scale 2^20 → 524288: the backward overflowed at 2^20 (halved, as GradScaler's backoff does)"
            in decision["message"])


@pytest.mark.parametrize("rollback", [True, False])
def test_an_isolation_the_loss_diverges_after_moves_down_the_ladder_and_rolls_back(write_script, tmp_path,
                                                                                    rollback):
    flags = ["--dtype", "fp16", "--on-nonfinite", "isolate", "--checkpoint-every", "2", "--init-scale", "1"]
    session = train(write_script(DIVERGING), tmp_path / "run", *flags, *(["--rollback"] if rollback else []),
                    steps=10)
    isolation, move = autopilot(session)
    assert (isolation["step"], isolation["value"]) == (5, "attn")
    # Decided once step 8, the third loss far above the reference, is recorded: clean steps are
    # recorded in batches, so that is at the boundary of step 9 or a little later.
    assert move["step"] >= 9 and (move["action"], move["value"]) == ("dtype", "bfloat16")
    assert move["reason"].startswith("the loss diverged after the isolation of step 4 (")
    restored = [e for e in session.events if e["kind"] == "checkpoint_restored"]
    # As the ladder rolls back: the newest checkpoint saved before the step the isolation answered.
    assert [(e["checkpoint_step"], e["source"]) for e in restored] == ([(4, "autopilot")] if rollback else [])


def test_an_isolation_at_the_first_step_takes_its_next_losses_as_the_reference(write_script, tmp_path):
    script = write_script(DIVERGING.replace("OVERFLOW_AT = 4", "OVERFLOW_AT = 0"))
    session = train(script, tmp_path / "run", "--dtype", "fp16", "--on-nonfinite", "isolate", "--init-scale", "1",
                    steps=10)
    isolation, move = autopilot(session)
    assert (isolation["step"], isolation["value"]) == (1, "attn")
    assert move["step"] >= 9 and move["value"] == "bfloat16"
    assert move["reason"].startswith("the loss diverged after the isolation of step 0 (")


def test_undo_over_ctl_takes_the_isolation_back_and_refuses_when_nothing_is_left(write_script, tmp_path, capsys):
    run = train_run(write_script(ATTENTION), tmp_path / "run", device="cpu", dtype="float16", steps=4,
                    on_nonfinite="isolate", at=["1:pause"])
    thread = threading.Thread(target=run.run)
    thread.start()
    try:
        assert wait_for(lambda: run.state == "paused", 120)
        assert run.controller.local_fp32.names == ["attn"]
        run_dir = str(run.run_dir)
        assert main(["ctl", run_dir, "undo"]) == 0
        assert "undid the autopilot's attn in fp32" in capsys.readouterr().out
        assert run.controller.local_fp32.names == []
        assert main(["ctl", run_dir, "undo"]) == 1
        assert "nothing to undo: every decision of the autopilot is undone already" in capsys.readouterr().out
        assert main(["ctl", run_dir, "resume"]) == 0
    finally:
        run.request_stop()
        thread.join(120)
    events = read_session(tmp_path / "run").events
    undo = [e for e in events if e["kind"] == "intervention" and e.get("action") == "undo"]
    assert [(e["before"], e["after"]) for e in undo] == [({"fp32_modules": ["attn"]}, {"fp32_modules": []})]
    assert undo[0]["source"].startswith("ctl")
    [refused] = [e for e in events if e["kind"] == "refused"]   # the second undo, not an error
    assert refused["command"] == "undo" and refused["source"].startswith("ctl") and "pid" in refused["client"]
    assert not [e for e in events if e["kind"] == "error"]
    # Repeated (--repeat-interventions), the run's autopilot decides again; the user's undo is kept.
    assert [a for a in interventions_as_at(tmp_path / "run") if "pause" not in a and "resume" not in a] == ["1:undo"]


def test_undo_without_the_autopilot_says_why(mlp_script, tmp_path):
    run = train_run(mlp_script, tmp_path / "run", device="cpu", steps=1, control=False)
    assert run.run() == 0
    outcome = run.controller.apply(Command("undo", None, "api"))
    assert not outcome.ok and "--on-nonfinite isolate" in outcome.message


def test_a_monitored_loop_isolates_from_the_next_step(write_script, tmp_path):
    namespace: dict = {}
    exec(compile(ATTENTION, "attention_loop", "exec"), namespace)
    monitor, losses = namespace["loop"](tmp_path / "loop", on_nonfinite="isolate")
    assert monitor.controller.local_fp32.names == []   # close() gave the model its own forwards back
    session = read_session(tmp_path / "loop")
    decisions = autopilot(session)
    assert decisions[-1]["after"] == {"fp32_modules": ["attn"]}
    # The monitor's replay names the op's module and finds the step finite with it in fp32; the
    # loop can't be rewound, so the isolation holds from the next step.
    assert [(d["step"], d["value"], d["verified"], d["widened"]) for d in decisions] == [(1, "attn", True, 0)]
    assert "applied from the next step: this loop can't be rewound" in decisions[0]["message"]
    assert "the replay of this step was finite with it" in decisions[0]["message"]
    steps = session.steps
    assert sum(s["skipped"] for s in steps) == 1 and {s["dtype"] for s in steps} == {"float16"}
    bf16 = train(write_script(ATTENTION, "bf16.py"), tmp_path / "bf16", "--dtype", "bf16").steps
    assert abs(sum(losses[-10:]) / 10 - tail_mean(bf16)) <= TOLERANCE * tail_mean(bf16)


def test_a_monitored_loop_without_the_op_widens_from_the_first_non_finite_layer(tmp_path):
    namespace: dict = {}
    exec(compile(ATTENTION, "attention_loop", "exec"), namespace)
    monitor, losses = namespace["loop"](tmp_path / "loop", replay=False, on_nonfinite="isolate")
    session = read_session(tmp_path / "loop")
    assert [e.get("op") for e in session.events if e["kind"] == "nonfinite"] == [None, None]
    # The probes name the attention's output projection, the first layer whose output went
    # non-finite: in fp32 from the next step, which still overflows, so the attention is next.
    decisions = autopilot(session)
    assert [(d["value"], d["verified"], d["widened"]) for d in decisions] == [("attn.o", None, 0), ("attn", None, 1)]
    assert (decisions[1]["before"], decisions[1]["after"]) == ({"fp32_modules": ["attn.o"]}, {"fp32_modules": ["attn"]})
    assert monitor.controller.local_fp32.names == []   # close() gave the model its own forwards back
    assert [s["skipped"] for s in session.steps[:3]] == [True, True, False]
    assert all(math.isfinite(loss) for loss in losses[2:])


def test_the_monitor_takes_skip_or_isolate(mlp_script):
    import torch
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'skip' or 'isolate'"):
        amp_tui.monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), on_nonfinite="pause")
