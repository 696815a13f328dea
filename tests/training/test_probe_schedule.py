"""The probe schedule on its own, fed made-up step durations: deterministic, no wall time."""

import pytest

from amp_tui.training.probes.probe_schedule import FIRST_PROBED, ProbeSchedule

PLAIN = 0.010     # an unprobed step, seconds
PROBED = 0.030    # a probed step: probing costs 20 ms over 10 ms


def run(schedule: ProbeSchedule, steps: int, *, plain=PLAIN, probed=PROBED, first_step=0, **outcome):
    """Feed `steps` steps; returns which were probed."""
    seen = []
    for step in range(first_step, first_step + steps):
        planned = schedule.probing(step)
        seen.append(planned)
        schedule.observe(planned=planned, duration=probed if planned else plain, step=step, **outcome)
    return seen


def test_costly_probes_are_spaced_to_the_budget():
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    seen = run(schedule, 3000)
    assert all(seen[:FIRST_PROBED])
    # cost 20 ms over 10 ms steps at 1%: one probed step in ceil(0.02 * 0.99 / (0.01 * 0.01)) = 198
    assert schedule.interval() == 198
    probes = [i for i, p in enumerate(seen) if p and i >= 100]
    stretch = seen[probes[0]:probes[-1]]   # whole intervals, each with its probed step
    cost = sum(PROBED - PLAIN for p in stretch if p)
    total = sum(PROBED if p else PLAIN for p in stretch)
    assert cost / total <= 0.01 + 1e-9
    assert schedule.share() <= 0.012   # its own measure, the first steps included
    assert schedule.mode == "auto" and not schedule.drain()


def run_recorded(schedule: ProbeSchedule, steps: int, *, record: float, forecast: float) -> list[bool]:
    """Feed `steps` steps as the run controller tells them: each step's forecasts right after it
    (`forecast` seconds on a probed step, none on another), and its record, `record` seconds,
    formatted in batches of 10."""
    seen = []
    for step in range(steps):
        planned = schedule.probing(step)
        seen.append(planned)
        schedule.observe(planned=planned, duration=PROBED if planned else PLAIN, step=step)
        schedule.add_time(forecast if planned else 0.0)
        if step % 10 == 9:
            schedule.add_record_time(10 * record, 10)
    return seen


def test_what_the_run_spends_after_a_step_counts_in_the_budget():
    bare = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    run_recorded(bare, 3000, record=0.0, forecast=0.0)
    assert bare.interval() == 198
    # A probed step's forecasts take 10 ms more: probing costs 30 ms over a 10 ms step.
    forecasts = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    run_recorded(forecasts, 3000, record=0.0, forecast=0.010)
    assert forecasts.interval() == 297   # ceil(0.03 * 0.99 / (0.01 * 0.01))
    # Every step's record takes 0.04 ms, 0.4% of a step: probing gets the 0.6% left.
    records = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    seen = run_recorded(records, 6000, record=0.00004, forecast=0.0)
    assert records.probe_share() == pytest.approx(0.006)
    assert records.interval() == 332   # ceil(0.02 * 0.994 / (0.01 * 0.006))
    probes = [i for i, p in enumerate(seen) if p and i >= 3000]
    stretch = seen[probes[0]:probes[-1]]
    spent = sum(PROBED - PLAIN for p in stretch if p) + 0.00004 * len(stretch)
    assert spent / sum(PROBED if p else PLAIN for p in stretch) <= 0.01 + 1e-9   # all of it in the budget
    assert records.share() == pytest.approx(0.01, abs=0.001)   # the schedule's own measure of it
    # The run's other work between steps counts alike: 0.02 ms more, and probing gets 0.4%.
    both = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    for step in range(3000):
        planned = both.probing(step)
        both.observe(planned=planned, duration=PROBED if planned else PLAIN, step=step)
        both.add_own_time(0.00002)   # told after every step: an unprobed one's counts
        if step % 10 == 9:
            both.add_record_time(10 * 0.00004, 10)
    assert both.fixed_share() == pytest.approx(0.006) and both.probe_share() == pytest.approx(0.004)
    # A record dearer than the budget leaves probing a quarter of it, not nothing.
    dear = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    run_recorded(dear, 3000, record=0.0005, forecast=0.0)
    assert dear.probe_share() == pytest.approx(0.0025)


def test_a_larger_budget_probes_more_often():
    tight = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    loose = ProbeSchedule("auto", budget=10.0, live_seconds=1e9)
    assert sum(run(loose, 2000)) > 5 * sum(run(tight, 2000))
    everything = ProbeSchedule("auto", budget=100.0)
    assert all(run(everything, 50))


def test_the_cost_is_measured_as_it_goes():
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    run(schedule, 2000)
    before = schedule.interval()
    run(schedule, 4000, probed=PLAIN * 1.2, first_step=2000)   # probing became cheap
    assert schedule.interval() == 20 < before / 9   # ceil(0.002 * 0.99 / 0.0001)


def test_a_probe_at_least_every_few_seconds_of_training():
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=2.0)
    seen = run(schedule, 3000, plain=0.5, probed=5.0)   # probing is very costly here
    probed = [i for i, p in enumerate(seen) if p]
    gaps = [b - a for a, b in zip(probed, probed[1:])]
    assert max(gaps[2:]) <= 5   # 4 unprobed steps of 0.5 s, then a probe


def test_a_fixed_schedule_is_as_it_was():
    schedule = ProbeSchedule(10)
    assert run(schedule, 30, skipped=True) == [s % 10 == 0 for s in range(30)]
    assert schedule.weights_due() and not schedule.drain()


@pytest.mark.parametrize("outcome, reason", [
    ({"skipped": True, "nonfinite": "gradients"}, "skip"),
    ({"nonfinite": "loss", "skipped": True}, "nonfinite"),
    ({"scale": 65536.0, "next_scale": 32768.0}, "scale_drop"),
    ({"act": [1.0, 60000.0 / 2 ** 2.4], "dtype": "float16"}, "headroom"),
    ({"grad": [1e-3, 60000.0 / 2 ** 2.4], "scale": 1.0, "dtype": "float16"}, "headroom"),
])
def test_trouble_probes_every_step_until_a_clean_stretch(outcome, reason):
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=1e9, clean_steps=50, names=["stem", "blocks.3"])
    run(schedule, 500)
    step = 500
    planned = schedule.probing(step)
    schedule.observe(planned=planned, duration=PLAIN, step=step, **outcome)
    (change,) = schedule.drain()
    assert (change.mode, change.reason) == ("every", reason)
    if reason == "headroom":
        assert "blocks.3 at" in change.message and "bits of headroom" in change.message
    assert all(run(schedule, 49, first_step=501))
    assert not schedule.drain()
    assert run(schedule, 1, first_step=550) == [True]
    (back,) = schedule.drain()
    assert (back.mode, back.reason) == ("auto", "clean")
    assert not any(run(schedule, 5, first_step=551))


def test_gradients_the_scaler_keeps_near_the_max_are_no_sign_of_trouble():
    """GradScaler raises the scale until grad × scale overflows: in a healthy fp16 run that
    product sits within a bit or two of the max for good. Judged on it, the run would probe every
    step from the scaler's first growth to its end; the gradients are judged unscaled."""
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=1e9, names=["stem", "blocks.3"])
    run(schedule, 500)
    schedule.observe(planned=schedule.probing(500), duration=PLAIN, step=500, dtype="float16",
                     act=[1.0, 2.0], grad=[1e-3, 0.5], scale=2.0 ** 16, next_scale=2.0 ** 16)
    assert not schedule.drain() and schedule.mode == "auto"


def test_more_trouble_while_escalated_starts_the_clean_stretch_again():
    schedule = ProbeSchedule("auto", clean_steps=10)
    run(schedule, 100)
    run(schedule, 1, first_step=100, skipped=True)
    run(schedule, 8, first_step=101)
    run(schedule, 1, first_step=109, skipped=True)
    assert all(run(schedule, 9, first_step=110))
    assert [c.reason for c in schedule.drain()] == ["skip"]
    run(schedule, 1, first_step=119)
    assert [c.reason for c in schedule.drain()] == ["clean"]


def test_the_command_pins_every_step_and_lets_go():
    schedule = ProbeSchedule("auto", clean_steps=5)
    run(schedule, 100)
    change = schedule.set_mode("every")
    assert (change.mode, change.reason) == ("every", "command")
    assert schedule.set_mode("every") is None
    assert all(run(schedule, 20, first_step=100))   # no clean stretch lets a pin go
    assert not schedule.drain()
    back = schedule.set_mode("auto")
    assert (back.mode, back.reason) == ("auto", "command")
    assert schedule.set_mode("auto") is None
    fixed = ProbeSchedule(4)
    fixed.set_mode("every")
    assert all(run(fixed, 6))
    fixed.set_mode("auto")
    assert run(fixed, 4, first_step=8) == [True, False, False, False]


def test_an_outside_escalation_is_said_once():
    schedule = ProbeSchedule("auto")
    run(schedule, 100)
    schedule.escalate("dtype", "the dtype changed fp16 → bf16")
    schedule.escalate("restore", "a checkpoint restored")
    (change,) = schedule.drain()
    assert change.reason == "dtype" and change.message == "probing every step: the dtype changed fp16 → bf16"
    fixed = ProbeSchedule(10)
    fixed.escalate("dtype", "the dtype changed")
    assert fixed.mode == "auto" and not fixed.drain()   # a fixed schedule stays as asked


def test_weights_every_few_probed_steps_and_on_every_escalated_one():
    schedule = ProbeSchedule("auto", weights_every=4, live_seconds=1e9)
    reads = []
    for step in range(2000):
        planned = schedule.probing(step)
        if planned:
            reads.append(schedule.weights_due())
        schedule.observe(planned=planned, duration=PROBED if planned else PLAIN, step=step)
    assert reads[:8] == [True, False, False, False, True, False, False, False]
    schedule.escalate("command", "asked")
    assert schedule.weights_due()


def test_the_record_says_the_schedule_and_its_cost():
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    run(schedule, 1000)
    mode, every, cost = schedule.record_field()
    assert mode == "auto" and every == 198 and 0 < cost <= 1.2
    schedule.escalate("headroom", "blocks.3 at 2.4 bits of headroom")
    assert schedule.record_field() == ["every", "blocks.3 at 2.4 bits of headroom"]
    assert ProbeSchedule(3).record_field() is None
    assert ProbeSchedule(3).header_fields() == {"probe_every": 3, "probe_budget": 1.0}


def test_a_cost_lost_in_the_noise_keeps_the_last_spacing_instead_of_probing_every_other_step():
    """A busy machine can make probed steps measure no dearer than unprobed ones for a while:
    that is noise, not free probing. The spacing the last resolvable cost gave stays, and the
    share the schedule reports doesn't count only the noise's slower half."""
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    run(schedule, 3000)
    assert schedule.interval() == 198
    run(schedule, 3000, probed=PLAIN, first_step=3000)   # now a probed step measures as cheap
    assert schedule.interval() == 198
    noisy = ProbeSchedule("auto", budget=1.0, live_seconds=1e9)
    seen = []
    for step in range(600):   # durations alternate around the same median, probed or not
        planned = noisy.probing(step)
        seen.append(planned)
        noisy.observe(planned=planned, duration=PLAIN * (1.5 if step % 2 else 0.5), step=step)
    assert sum(seen[100:]) <= 500 / 8 and noisy.share() < 0.05


def test_a_layer_run_in_fp32_is_judged_against_fp32s_max():
    """A module put in fp32 (`f`, `fp32=`, --fp32-modules) keeps activations past fp16's max, as
    it should: judged against fp16's, every step was trouble and the run probed every step for
    good after the fix."""
    schedule = ProbeSchedule("auto", budget=1.0, live_seconds=1e9, clean_steps=10, names=["inp", "amplifier"])
    run(schedule, 100)
    run(schedule, 1, first_step=100, nonfinite="loss", skipped=True)
    assert [c.reason for c in schedule.drain()] == ["nonfinite"]
    schedule.fp32_modules = lambda: ["amplifier"]
    for step in range(101, 111):
        schedule.observe(planned=schedule.probing(step), duration=PLAIN, step=step, dtype="float16",
                         act=[10.0, 7.1e5], grad=[0.05, 1e-7], scale=65536.0, next_scale=65536.0)
    assert [c.reason for c in schedule.drain()] == ["clean"]
    # a layer inside a module in fp32 is in fp32 too; one beside it is not
    schedule.names = ["amplifier.proj"]
    assert schedule.least_headroom("float16", [7.1e5], None)[1] > 100
    schedule.names = ["amplifier2"]
    assert schedule.least_headroom("float16", [7.1e5], None)[1] < 0
