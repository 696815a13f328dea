"""The adaptive probe schedule of several ranks (job/rank_probes.py), two ranks simulated in one
process: each step's words as `Ranks` sends them (taken at the step's loss check, before the
step's end), agreed as the all-reduce agrees them (the maximum), and handed back at the boundary
after the step. Rank 0's spacing decides on both, though each rank's own timing would space them
differently; a layer short of headroom on rank 1 alone escalates both at the same step."""

from __future__ import annotations

import torch

from amp_tui.job.boundary_words import BoundaryWords
from amp_tui.job.rank_probes import RankProbes
from amp_tui.training.probe_schedule import ProbeSchedule

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
