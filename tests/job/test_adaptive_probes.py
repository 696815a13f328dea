"""The adaptive probe schedule in a run: `amp-tui train`, a monitored loop and a callback alike.

Every step's duration comes from a made-up clock (each step takes STEP seconds, a probed step
PROBE_COST more), so which steps are probed depends on the run's own progress, never on how
busy the machine is.
"""

import time

import pytest
import torch
from torch import nn

import amp_tui
import amp_tui.job.controller as controller_module
import amp_tui.training.step.engine as engine_module
from amp_tui.core.commands import parse_action
from amp_tui.recording.reader import read_session
from amp_tui.sources.buffer import RunBuffer
from amp_tui.training.probes.probe_schedule import FIRST_INTERVAL, FIRST_PROBED

from frameworks import at_steps, command, hf_trainer, lightning_module_class, pl_trainer, regression_loader
from support import install_made_up_clock, monitored_loop, train_run

STEP = 0.01          # seconds an unprobed step takes, by the made-up clock (probe_schedule.SHORT_STEP)
PROBE_COST = 0.02    # what probing adds to a step
# 10% budget: one probed step in ceil(0.02 * 0.9 / (0.1 * 0.01)) = 18
BUDGET = 10.0
INTERVAL = 18


@pytest.fixture
def made_up_clock(monkeypatch):
    """Each step takes STEP on the drivers' clock; collecting a probed step's figures PROBE_COST more."""
    return install_made_up_clock(monkeypatch, STEP, PROBE_COST)


HOT = range(60, 90)      # activations at 2 bits of headroom to fp16's max
OVERFLOW = 90            # and one step past it
STEPS = 170
GROWING = f'''
import torch
from torch import nn

def size(step):
    return 1e5 if step == {OVERFLOW} else 16000.0 if {HOT.start} <= step < {HOT.stop} else 1.0

def setup(ctx=None):
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].weight.fill_(1e-3)
    return {{"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": lambda m, x: m(x).float().mean(),
            "batches": [torch.full((4, 1), size(s)) for s in range({STEPS})]}}
'''


SPACING_REASONS = ("trend", "growth")   # the spacing within the budget narrowed: no change of mode


def probes_events(session):
    """The schedule's changes of mode: an escalation to every step, a return to the budget."""
    return [e for e in session.events if e["kind"] == "probes" and e["reason"] not in SPACING_REASONS]


def test_trouble_probes_every_step_until_a_clean_stretch(write_script, tmp_path, made_up_clock):
    run_dir = tmp_path / "run"
    run = train_run(write_script(GROWING), run_dir, steps=STEPS, dtype="float16", init_scale=1.0,
                    probe_budget=BUDGET, control=False)
    assert run.run() == 0
    session = read_session(run_dir)
    assert session.header["probe_every"] == "auto" and session.header["probe_budget"] == BUDGET
    steps = {r["step"]: r for r in session.steps}
    probed = [s for s in range(STEPS) if "layers" in steps[s]]
    assert probed[:FIRST_PROBED] == list(range(FIRST_PROBED))
    before = [s for s in probed if FIRST_PROBED <= s < HOT.start]
    assert before and all(b - a == INTERVAL for a, b in zip(before, before[1:]))   # the budget
    escalation, back = probes_events(session)
    first_hot = min(s for s in probed if s in HOT)
    assert (escalation["mode"], escalation["reason"], escalation["step"]) == ("every", "headroom", first_hot + 1)
    assert "bits of headroom" in escalation["message"] and escalation["message"].startswith("probing every step: ")
    assert all("layers" in steps[s] for s in range(first_hot, back["step"]))
    overflow = steps[OVERFLOW]
    assert overflow["nonfinite"] == "loss" and overflow["layers"]["act"][0] == "Infinity"
    (event,) = [e for e in session.events if e["kind"] == "nonfinite"]
    assert event["step"] == OVERFLOW and event["origin"] == "0"
    # 50 clean steps after the overflow (the trouble before it kept the stretch from starting)
    assert (back["mode"], back["reason"], back["step"]) == ("auto", "clean", OVERFLOW + 51)
    after = [s for s in range(back["step"], STEPS) if "layers" not in steps[s]]
    assert after and steps[STEPS - 1]["probes"][0] == "auto"
    assert steps[OVERFLOW]["probes"][0] == "every"


SCALED_NEAR_THE_MAX = """
import torch
from torch import nn

def setup(ctx=None):
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].weight.fill_(1.0)
    # d loss / d output = 1 per element: at the scale 2**14, grad x scale is 2 bits under fp16's max
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": lambda m, x: m(x).float().sum(),
            "batches": [torch.ones(1, 1)] * 40}
"""


def test_gradients_scaled_near_the_max_leave_the_schedule_alone(write_script, tmp_path):
    """What GradScaler does to every healthy fp16 run (grad x scale near the max) must not
    probe every step: the gradients are judged unscaled, and they are 16 bits under."""
    run_dir = tmp_path / "run"
    run = train_run(write_script(SCALED_NEAR_THE_MAX), run_dir, steps=40, dtype="float16",
                    init_scale=2.0 ** 14, control=False)
    assert run.run() == 0
    session = read_session(run_dir)
    first = session.steps[0]
    assert first["scale"] == 2.0 ** 14 and first["layers"]["grad"][1] == 1.0   # as the case says
    assert not probes_events(session)
    assert sum("layers" in r for r in session.steps) < 40


def test_the_budget_holds_with_costly_probes(tmp_path, made_up_clock, mlp_script):
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=200, dtype="float32", probe_budget=BUDGET, control=False)
    assert run.run() == 0
    steps = read_session(run_dir).steps
    probed = [r["step"] for r in steps if "layers" in r]
    # the first steps (warming up: not measured); one step in FIRST_INTERVAL while the cost is
    # unknown; then one step in INTERVAL
    first = FIRST_PROBED - 1 + FIRST_INTERVAL
    assert probed == [0, 1, 2, *range(first, 200, INTERVAL)]
    mode, every, cost = steps[-1]["probes"]
    assert (mode, every) == ("auto", INTERVAL)
    # what the run measured for itself: at most the budget, the first steps included
    assert 0 < cost <= BUDGET * 1.2


def test_weights_every_fourth_probed_step_and_the_last_ones_shown(tmp_path, made_up_clock, mlp_script):
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=100, dtype="float32", probe_budget=BUDGET, control=False)
    assert run.run() == 0
    session = read_session(run_dir)
    probed = [r for r in session.steps if "layers" in r]
    assert ["weight" in r["layers"] for r in probed[:5]] == [True, False, False, False, True]
    assert all(isinstance(v, (int, float)) for v in probed[0]["layers"]["weight"])
    # the dashboard's buffer: the last weights read, with their step
    buffer = RunBuffer()
    for record in [session.header, *probed[:3]]:
        buffer.feed(record)
    layers = buffer.snapshot().layers
    assert layers.step == probed[2]["step"] and layers.weight_step == probed[0]["step"]
    assert layers.weight == probed[0]["layers"]["weight"]
    # a replay: the same, found by looking back
    from amp_tui.sources.replay import ReplaySource
    source = ReplaySource(run_dir / "session.jsonl", autoplay=False)
    source.seek(probed[2]["step"] + 1)
    layers = source.snapshot().layers
    assert layers.step == probed[2]["step"] and layers.weight_step == probed[0]["step"]
    assert layers.weight == probed[0]["layers"]["weight"]
    source.seek(probed[4]["step"])
    assert source.snapshot().layers.weight_step is None   # read at the step shown


# ---- a step that was not planned to be probed, skipped -----------------------------------------

def test_an_unplanned_skip_has_its_gradient_figures_under_train(tmp_path, mlp_script):
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=6, dtype="float16", init_scale=2.0 ** 40, probe_every=10,
                    control=False)
    assert run.run() == 0
    session = read_session(run_dir)
    unplanned = [r for r in session.steps if r["step"] % 10 and r["skipped"]]
    assert unplanned, "the huge scale overflows the first steps"
    for r in unplanned:
        layers = r["layers"]
        assert all(v is None for v in layers["act"])           # gone by the time the skip is known
        assert all(v is not None for v in layers["grad"])       # measured before they were zeroed
        assert all(v is not None for v in layers["weight"])
    named = {e["step"]: e["layer"] for e in session.events if e["kind"] == "nonfinite"}
    assert all(named[r["step"]] is not None for r in unplanned)


def test_an_unplanned_skip_has_its_gradient_figures_in_a_monitored_loop(tmp_path):
    session = monitored_loop(tmp_path / "run", 6, probe_every=10)
    unplanned = [r for r in session.steps if r["step"] % 10 and r["skipped"]]
    assert unplanned
    for r in unplanned:
        assert all(v is None for v in r["layers"]["act"])
        assert all(v is not None for v in r["layers"]["grad"])


def test_the_same_events_in_a_monitored_loop(tmp_path, made_up_clock):
    """Trouble escalates, a clean stretch comes back, as under `amp-tui train`."""
    session = monitored_loop(tmp_path / "run", 120, init_scale=1.0, bad_step=40, probe_budget=BUDGET)
    assert session.header["probe_every"] == "auto" and session.header["probe_budget"] == BUDGET
    steps = {r["step"]: r for r in session.steps}
    probed = [s for s in range(40) if "layers" in steps[s]]
    assert probed == [0, 1, 2, 12, 30]   # the first steps, one in FIRST_INTERVAL, then the budget
    escalation, back = probes_events(session)
    assert (escalation["mode"], escalation["reason"], escalation["step"]) == ("every", "nonfinite", 41)
    # not planned, skipped: its gradients (NaN from the infinite loss) measured after the fact
    assert steps[40]["skipped"] and steps[40]["layers"]["grad"] == ["NaN", "NaN"]
    assert (back["mode"], back["reason"], back["step"]) == ("auto", "clean", 91)
    assert all("layers" in steps[s] for s in range(41, 91))
    assert any("layers" not in steps[s] for s in range(91, 120))


def lightning_fit(run_dir, steps, plan):
    """A Lightning fit under the callback (the adaptive schedule, its default); `plan`: commands
    submitted at the end of the given optimizer steps (applied at the next boundary)."""
    from lightning.pytorch import Callback

    from amp_tui.integrations.lightning import AmpTuiCallback
    callback = AmpTuiCallback(run_dir=run_dir, announce=False)

    class Planned(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in plan:
                callback.monitor.controller.submit(command(plan[trainer.global_step]))
    trainer = pl_trainer([callback, Planned()], steps=steps)
    torch.manual_seed(0)
    trainer.fit(lightning_module_class()(), regression_loader())
    return read_session(run_dir)


def test_the_probe_command_in_a_monitored_loop_and_under_lightning(tmp_path):
    session = monitored_loop(tmp_path / "loop", 8, init_scale=1.0, plan={2: "probe=every", 5: "probe=auto"})
    # (a Lightning step's end submits for the next boundary)
    under_lightning = lightning_fit(tmp_path / "lightning", 8, {2: "probe=every", 5: "probe=auto"})
    for s, at in ((session, (2, 5)), (under_lightning, (2, 5))):
        assert [(e["step"], e["mode"], e["reason"], e["source"]) for e in probes_events(s)] == \
            [(at[0], "every", "command", "api"), (at[1], "auto", "command", "api")]
        assert probes_events(s)[0]["message"] == "probing every step: asked for"
        assert all("layers" in r for r in s.steps if at[0] <= r["step"] < at[1])


def test_the_schedule_under_the_hf_trainer(tmp_path, made_up_clock):
    """The HF Trainer's callback has the same schedule: auto in the header, the first steps then
    one in FIRST_INTERVAL probed, and the probe command's events."""
    from amp_tui.integrations.transformers import AmpTuiCallback
    trainer = hf_trainer(tmp_path, steps=16)
    callback = AmpTuiCallback(trainer, run_dir=tmp_path / "hf", announce=False)
    trainer.add_callback(callback)
    trainer.add_callback(at_steps({12: "probe=every", 14: "probe=auto"}, lambda: callback.monitor))
    trainer.train()
    session = read_session(tmp_path / "hf")
    assert session.header["probe_every"] == "auto"
    probed = [r["step"] for r in session.steps if "layers" in r]
    assert probed[:FIRST_PROBED] == list(range(FIRST_PROBED)) and FIRST_PROBED not in probed
    assert [(e["step"], e["mode"], e["reason"]) for e in probes_events(session)] == \
        [(12, "every", "command"), (14, "auto", "command")]
    assert {12, 13} <= set(probed)


def test_the_monitor_takes_the_headroom_that_escalates(tmp_path):
    """`probe_alert_bits=` reaches the monitor's schedule: a layer within that many bits of
    fp16's max (here every layer: fp16 has 16 bits above 1) probes every step."""
    wary = probes_events(monitored_loop(tmp_path / "wary", 12, init_scale=1.0, probe_alert_bits=30))
    assert wary and (wary[0]["mode"], wary[0]["reason"]) == ("every", "headroom")
    assert not probes_events(monitored_loop(tmp_path / "default", 12, init_scale=1.0))


SLOW = 0.003   # seconds a piece of amp-tui's own work is made to take


def test_the_trainers_work_around_the_step_counts_as_the_runs_own(tmp_path, mlp_script, monkeypatch):
    # Telling the schedule about the step happens inside GuardedTrainer.step, after the step's
    # duration is measured: it is what every step pays, so it comes out of the budget.
    tell = engine_module.observe_step

    def slow_tell(*args, **kwargs):
        time.sleep(SLOW)
        return tell(*args, **kwargs)
    monkeypatch.setattr(engine_module, "observe_step", slow_tell)
    run = train_run(mlp_script, tmp_path / "run", steps=60, dtype="float32", control=False)
    assert run.run() == 0
    schedule = run.trainer.probe_schedule
    assert schedule.own_time >= SLOW
    assert schedule.plain_time is not None and schedule.fixed_share() >= SLOW / schedule.plain_time


def fp32_monitored_loop(run_dir, steps, *, note_at=None):
    """A plain fp32 loop under the monitor (`note_at`: a note submitted before that step), left
    open for its schedule and counters to be read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = amp_tui.monitor(model, opt, run_dir=run_dir, announce=False, control=False)
    x = torch.randn(16, 4)
    for i in range(steps):
        if i == note_at:
            monitor.controller.submit(parse_action("note=a note", source="api"))
        opt.zero_grad()
        with monitor.step() as step:
            loss = model(x).pow(2).mean()
            step.loss = loss
            loss.backward()
            opt.step()
    return monitor


def test_the_monitors_boundary_and_block_entry_count_as_its_own(tmp_path, monkeypatch):
    boundary = controller_module.RunController.boundary

    def slow_boundary(self, *args, **kwargs):
        time.sleep(SLOW)
        return boundary(self, *args, **kwargs)
    monkeypatch.setattr(controller_module.RunController, "boundary", slow_boundary)
    monitor = fp32_monitored_loop(tmp_path / "run", 60)
    schedule = monitor.driver.probe_schedule
    # two boundaries an update: the one after it and the one entering the next block
    assert schedule.own_time >= 2 * SLOW
    monitor.close()


def test_a_boundary_that_holds_the_loop_is_not_counted_as_the_monitors_own_work(tmp_path, monkeypatch):
    # A pause, or a command applied at the boundary, is not what every step costs: it must not
    # grow the training time the budget is a share of, nor the own work taken from it.
    held = 2.0
    at_work = controller_module.RunController._boundary_at_work

    def slow_at_work(self, *args, **kwargs):
        time.sleep(held)
        return at_work(self, *args, **kwargs)
    monkeypatch.setattr(controller_module.RunController, "_boundary_at_work", slow_at_work)
    monitor = fp32_monitored_loop(tmp_path / "run", 20, note_at=10)
    schedule = monitor.driver.probe_schedule
    monitor.close()
    assert monitor.controller.budget.held_seconds >= held
    assert schedule.total_seconds < held
    notes = [e for e in read_session(tmp_path / "run").events if e["kind"] == "note"]
    assert len(notes) == 1
