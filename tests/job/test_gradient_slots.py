"""The slots in which each rank's words ride on DDP's gradient all-reduce: the sum of every rank's
vector, in the gradients' dtype, reads back as what each rank sent (no process group needed:
the all-reduce is a sum)."""

from __future__ import annotations

import math

import pytest
import torch

from amp_tui.job.ranks.gradient_channel import Slots


def summed(slots: Slots, sent: list[dict], dtype: torch.dtype) -> torch.Tensor:
    """What an all-reduce of the ranks' vectors, in `dtype`, gives every rank."""
    return torch.stack([slots.pack(rank=r, **words).to(dtype) for r, words in enumerate(sent)]).sum(0)


def words(**overrides) -> dict:
    base = {"code": 0, "payload_bytes": 0, "finite": True, "stop": None, "row": None}
    return {**base, **overrides}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_ranks_words_read_back_as_sent(dtype):
    slots = Slots(world_size=3, layers=4)
    rows = [torch.tensor([0.5, 0.012, 1.0, -1.0, 65504.0, 3.0], dtype=torch.float64),
            torch.tensor([float("nan"), 0.5, float("inf"), 2.0, 0.0, 1e-7], dtype=torch.float64),
            torch.tensor([2.25, 1.5, 4.0, 8.0, 16.0, 32.0], dtype=torch.float64)]
    sent = [words(code=7, payload_bytes=1234, row=rows[0]),   # rank 0: a command with a payload
            words(finite=False, stop=(True, True, 15), row=rows[1]),   # rank 1: NaN loss, SIGTERM
            words(code=3, payload_bytes=99, stop=(True, False, 0), row=rows[2])]   # others' code: ignored
    got = slots.read(summed(slots, sent, dtype))
    assert (got.code, got.payload_bytes) == (7, 1234)   # rank 0's alone
    assert got.nonfinite == [False, True, False]
    assert got.stops == [(False, False, 0), (True, True, 15), (True, False, 0)]
    assert got.rows.shape == (3, 6)
    for rank, row in enumerate(rows):
        back = got.rows[rank].tolist()
        expected = row.to(dtype).double().tolist()
        assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(back, expected)), (rank, back)


def test_rows_are_missing_unless_every_rank_sent_one():
    slots = Slots(world_size=2, layers=1)
    sent = [words(row=torch.tensor([1.0, 0.1, 2.0], dtype=torch.float64)), words()]
    got = slots.read(summed(slots, sent, torch.float32))
    assert got.rows is None and got.nonfinite == [False, False] and got.stops == [(False, False, 0)] * 2


def test_nothing_sent_reads_as_nothing_asked():
    slots = Slots(world_size=2, layers=3)
    got = slots.read(torch.zeros(slots.size))
    assert (got.code, got.payload_bytes, got.rows) == (0, 0, None)
    assert got.nonfinite == [False, False] and got.stops == [(False, False, 0)] * 2
    assert (got.probe_spacing, got.low_headroom) == (0, (False, False))
    assert slots.size == 3 + (2 + 3) * 2 + 2 * (3 + 3)


def test_rank_0s_probe_spacing_and_each_ranks_low_headroom_read_back():
    slots = Slots(world_size=3, layers=2)
    sent = [words(probe_spacing=(1 << 24) - 1), words(probe_spacing=5, low_headroom=True),
            words(low_headroom=True, finite=False)]
    got = slots.read(summed(slots, sent, torch.float32))
    assert got.probe_spacing == (1 << 24) - 1   # rank 0's alone, exact in fp32
    assert got.low_headroom == (False, True, True) and got.nonfinite == [False, False, True]
