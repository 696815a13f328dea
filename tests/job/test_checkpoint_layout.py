"""How a model sharded with FSDP2 is checkpointed: the choice of `--fsdp-checkpoint auto` between
gathering on rank 0 and each rank writing its shards, and the state size it judges by."""

from __future__ import annotations

import pytest
import torch

from amp_tui.job.checkpoints.checkpoint_layout import FULL_SHARE, LAYOUTS, choose, state_bytes

GIB = 1024 ** 3


def test_full_and_sharded_are_taken_as_asked_whatever_the_size():
    assert choose("full", 100 * GIB, 1 * GIB)[0] == "full"
    assert choose("sharded", 1, 100 * GIB)[0] == "sharded"


def test_auto_gathers_while_twice_the_state_fits_in_the_share_of_available_memory():
    available = 64 * GIB
    edge = int(FULL_SHARE * available) // 2
    layout, why = choose("auto", edge, available)
    assert layout == "full" and "gathered on rank 0" in why
    layout, why = choose("auto", edge + 1, available)
    assert layout == "sharded" and "each rank writes its shards" in why and "available" in why


def test_auto_shards_where_the_available_memory_is_unknown():
    assert choose("auto", 1, None)[0] == "sharded"


def test_an_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="auto, full, sharded"):
        choose("gathered", 1, GIB)
    assert LAYOUTS == ("auto", "full", "sharded")


def test_the_state_counts_the_model_and_the_optimizer_or_adams_two_moments_before_its_first_step():
    model = torch.nn.Linear(10, 10)   # 110 float32 parameters
    opt = torch.optim.AdamW(model.parameters())
    assert state_bytes(model, opt) == 110 * 4 + 2 * 110 * 4
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    # exp_avg and exp_avg_sq (float32) and a float32 step per parameter tensor
    assert state_bytes(model, opt) == 110 * 4 + 2 * 110 * 4 + 2 * 4
