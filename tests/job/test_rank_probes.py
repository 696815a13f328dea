"""The adaptive probe schedule of several ranks (job/ranks/rank_probes.py), two ranks simulated in one
process: each step's words as `Ranks` sends them (taken at the step's loss check, before the
step's end), agreed as the all-reduce agrees them (the maximum), and handed back at the boundary
after the step. Rank 0's spacing decides on both, though each rank's own timing would space them
differently; a layer short of headroom on rank 1 alone escalates both at the same step, and in a
loop of one's own, so does a non-finite loss on rank 1 alone."""

from __future__ import annotations

import torch

from amp_tui.job.ranks.boundary_words import BoundaryWords
from amp_tui.job.ranks.rank_probes import RankProbes
from amp_tui.training.probes.probe_schedule import ProbeSchedule

F16_MAX = 65504.0


def agreed(sent: list[BoundaryWords]) -> BoundaryWords:
    return BoundaryWords.unpack(torch.stack([w.pack(len(sent)) for w in sent]).amax(0), len(sent))


def run(steps: int, *, hot_step: int | None = None, costs=((0.010, 0.012), (0.010, 0.020))):
    """Each rank's probed steps and its schedule: rank r's unprobed and probed step take
    costs[r]; with `hot_step`, rank 1's outputs in that step (when probed) come within 2 bits of
    fp16's max."""
    schedules = [ProbeSchedule("auto", budget=10, alert_bits=3, names=["a", "b"]) for _ in range(2)]
    ranks = [RankProbes(schedule, rank) for rank, schedule in enumerate(schedules)]
    probed: list[list[int]] = [[], []]
    for step in range(steps):
        planned = [s.probing(step) for s in schedules]
        sent = []
        for rank, probes in enumerate(ranks):   # the step's loss check: this rank's words
            spacing, low = probes.words()
            sent.append(BoundaryWords(probe_spacing=spacing, headroom_rank=rank if low else None))
        for rank, schedule in enumerate(schedules):   # the step's end
            hot = rank == 1 and step == hot_step
            act = [F16_MAX / 2**1.5 if hot else 1.0, 1.0] if planned[rank] else None
            schedule.observe(planned=planned[rank], duration=costs[rank][planned[rank]], dtype="float16",
                             act=act, grad=[1e-3, 1e-3] if planned[rank] else None, step=step)
            if planned[rank]:
                probed[rank].append(step)
        words = agreed(sent)
        for probes in ranks:   # the boundary after it
            probes.agreed(words.probe_spacing, words.headroom_rank)
    return probed, schedules


def test_both_ranks_probe_rank_0s_steps_though_their_own_timing_would_space_them_otherwise():
    probed, schedules = run(80)
    assert probed[0] == probed[1]
    assert probed[0][:3] == [0, 1, 2] and 5 < len(probed[0]) < 40, probed[0]
    # Rank 1's probed steps cost more: on its own it would space them wider than rank 0's.
    assert schedules[1].spacing() > schedules[0].spacing() == schedules[1].agreed_spacing


def test_rank_1_short_of_headroom_escalates_both_ranks_at_the_same_step():
    steps = 40
    probed, schedules = run(steps, hot_step=1)   # step 1 is probed (one of the first three)
    assert probed[0] == probed[1]
    # Told in step 2's words, agreed at the boundary after step 2: every step from step 3 on.
    assert probed[0] == list(range(steps)), probed[0]
    changes = [s.drain() for s in schedules]
    assert changes[0] == changes[1] and [(c.mode, c.reason) for c in changes[0]] == [("every", "headroom")]
    assert "on rank 1" in changes[0][0].message
    assert all(s.escalated for s in schedules)


def test_a_rank_short_of_headroom_puts_it_to_the_vote_instead_of_escalating_alone():
    schedule = ProbeSchedule("auto", alert_bits=3, names=["a"])
    probes = RankProbes(schedule, rank=1)
    schedule.observe(planned=True, duration=0.01, dtype="float16", act=[F16_MAX / 2], grad=[1e-3], step=0)
    assert schedule.mode == "auto" and schedule.drain() == []
    assert probes.words() == (0, True)    # a rank other than 0 sends no spacing
    assert probes.words() == (0, True)    # sent again by a later loss check of the step ...
    probes.agreed(0, 1)
    assert probes.words() == (0, False)   # ... until a boundary agreed on it
    assert schedule.mode == "every"


def own_loop(steps: int, *, nan_step: int, skipped: bool = False):
    """Two ranks of a loop of one's own (`amp_tui.monitor`): no loss check, each step's words
    made at the boundary after it, from what each rank saw. Rank 1's loss is NaN at `nan_step`
    (with `skipped`, GradScaler skipped the step, on both ranks)."""
    schedules = [ProbeSchedule("auto", budget=10, alert_bits=3, names=["a", "b"]) for _ in range(2)]
    for schedule in schedules:
        schedule.own_verdicts = True
    ranks = [RankProbes(schedule, rank) for rank, schedule in enumerate(schedules)]
    probed: list[list[int]] = [[], []]
    for step in range(steps):
        planned = [s.probing(step) for s in schedules]
        for rank, schedule in enumerate(schedules):
            nan = step == nan_step and rank == 1
            schedule.observe(planned=planned[rank], duration=0.012 if planned[rank] else 0.010,
                             nonfinite="loss" if nan else ("gradients" if skipped and step == nan_step else None),
                             skipped=skipped and step == nan_step, dtype="bfloat16",
                             act=[1.0, 1.0] if planned[rank] else None,
                             grad=[1e-3, 1e-3] if planned[rank] else None, step=step)
            if planned[rank]:
                probed[rank].append(step)
        sent = []
        for rank, probes in enumerate(ranks):   # the boundary after the step: Ranks._local_words
            nonfinite = probes.nonfinite_here()
            spacing, low = probes.words()
            sent.append(BoundaryWords(nonfinite_rank=rank if nonfinite else None, probe_spacing=spacing,
                                      headroom_rank=rank if low else None))
        words = agreed(sent)
        for probes in ranks:
            probes.agreed(words.probe_spacing, words.headroom_rank, words.nonfinite_rank)
    return probed, schedules


def test_in_a_loop_of_ones_own_a_nan_loss_on_one_rank_escalates_both_at_the_boundary_after_it():
    """No loss check agrees on each rank's loss in a loop of one's own: rank 1 alone escalating
    on its NaN would probe (and gather) steps rank 0 doesn't, and the ranks would wait for each
    other in different collectives. It goes in the boundary's words instead."""
    probed, schedules = own_loop(40, nan_step=15)
    assert probed[0] == probed[1]
    assert set(range(16, 40)) <= set(probed[0]) and 15 not in probed[0], probed[0]   # not planned
    changes = [s.drain() for s in schedules]
    assert [[(c.mode, c.reason) for c in mine] for mine in changes] == [[("every", "nonfinite")]] * 2
    # Rank 0 records the event: it knows which rank, and the rank that saw it knows what.
    assert changes[0][0].message == "probing every step: a non-finite value on rank 1"
    assert changes[1][0].message == "probing every step: a non-finite loss at step 15 on rank 1"


def test_what_a_rank_saw_is_sent_until_a_boundary_agreed_on_it():
    schedule = ProbeSchedule("auto", names=["a"])
    schedule.own_verdicts = True
    probes = RankProbes(schedule, rank=1)
    schedule.observe(planned=False, duration=0.01, nonfinite="loss", step=7)
    assert schedule.mode == "auto" and probes.nonfinite_here() and probes.nonfinite_here()   # until agreed
    probes.agreed(0, None, 1)
    assert not probes.nonfinite_here()
    [change] = schedule.drain()
    assert change.message == "probing every step: a non-finite loss at step 7 on rank 1"


def test_a_skip_is_gradscalers_on_every_rank_and_escalates_both_at_once():
    probed, schedules = own_loop(40, nan_step=15, skipped=True)
    assert probed[0] == probed[1] and set(range(16, 40)) <= set(probed[0])
    changes = [s.drain() for s in schedules]   # at once (from step 16), not at the boundary's vote
    assert [[(c.mode, c.reason) for c in mine] for mine in changes] == [[("every", "skip")]] * 2


def test_under_amp_tui_train_the_loss_check_agreed_already():
    """`amp-tui train` agrees on each rank's loss in the step's loss check and every rank
    escalates at once: the boundary's non-finite rank adds nothing there."""
    schedule = ProbeSchedule("auto", names=["a"])
    probes = RankProbes(schedule, rank=0)
    schedule.observe(planned=False, duration=0.01, nonfinite="loss", skipped=True, step=4)
    [change] = schedule.drain()
    assert (change.reason, change.message) == ("nonfinite", "probing every step: a non-finite loss at step 4")
    assert not probes.nonfinite_here()
    probes.agreed(0, None, 1)
    assert schedule.drain() == []
