"""Rank 0's record of a non-finite step from what every rank saw (job/ranks/rank_figures.py)."""

import torch

from amp_tui.job.ranks.rank_figures import merge_figures
from amp_tui.training.step.engine import StepResult


def seen(layer=None, op_trace=None, loss=1.0):
    return {"loss": loss, "layer": layer, "diagnosis": None, "op_trace": op_trace}


def gradients_step(op_trace):
    return StepResult(step=3, loss=1.0, scale=256.0, skipped=True, skipped_total=1, updates_applied=2,
                      dtype="float16", micro_batches=1, nonfinite="gradients", op_trace=op_trace)


def test_gradients_all_reduced_non_finite_are_named_after_the_rank_whose_replay_found_the_op():
    """Every rank skips gradients DDP made non-finite everywhere; the one whose own replay found
    the op is named, with its op, even where no checked pass located a layer."""
    mine = {"op_message": "no op made a non-finite value in the replay"}
    theirs = {"op": "aten.mm", "op_module": "2", "op_phase": "backward", "op_message": "aten.mm in 2 ..."}
    merged = merge_figures(gradients_step(mine), torch.zeros(2, 2, dtype=torch.float64), [],
                           [seen(op_trace=mine), seen(op_trace=theirs, loss=2.0)], loss_rank=None)
    assert merged.per_rank.nonfinite_rank == 1 and merged.op_trace == theirs


def test_a_located_layer_still_names_the_first_rank_that_saw_it_with_that_ranks_op_trace():
    first = {"op": "aten.addmm", "op_module": "0", "op_phase": "backward", "op_message": "..."}
    merged = merge_figures(gradients_step(first), torch.zeros(2, 2, dtype=torch.float64), [],
                           [seen(layer="0", op_trace=first), seen(layer="0", op_trace={"op": "aten.mm"})],
                           loss_rank=None)
    assert merged.per_rank.nonfinite_rank == 0 and merged.op_trace == first
