"""The words the ranks agree on at each step, as one small int64 tensor: every field read back as
packed, and the maximum over the ranks' tensors (the all-reduce's) read back as what they agree
on, the same words as those carried in the gradients give (no process group needed)."""

from __future__ import annotations

import dataclasses
import signal

import pytest
import torch

from amp_tui.job.ranks.boundary_words import BoundaryWords
from amp_tui.job.ranks.gradient_channel import Slots

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 1024])
@pytest.mark.parametrize("words", [
    BoundaryWords(),
    BoundaryWords(nonfinite_rank=0, stop_rank=0, checkpoint=True, signum=int(signal.SIGTERM)),
    BoundaryWords(command=1, payload_bytes=0),
    BoundaryWords(command=INT64_MAX, payload_bytes=INT64_MAX, signum=INT64_MAX),
    BoundaryWords(command=10, payload_bytes=2**24, stop_rank=0, signum=int(signal.SIGINT)),
    BoundaryWords(stop_rank=0, checkpoint=False, signum=0),
    BoundaryWords(probe_spacing=(1 << 24) - 1, headroom_rank=0),
], ids=["nothing", "rank 0 everything", "a code alone", "largest", "a payload", "a stop alone", "the probes"])
def test_every_field_reads_back_as_packed(world_size, words):
    packed = words.pack(world_size)
    assert packed.dtype == torch.int64 and packed.shape == (BoundaryWords.SIZE,)
    assert BoundaryWords.unpack(packed, world_size) == words


@pytest.mark.parametrize("world_size", [1, 2, 7, 1024])
def test_the_first_and_the_last_rank_read_back(world_size):
    last = world_size - 1
    for rank in (0, last):
        words = BoundaryWords(nonfinite_rank=rank, stop_rank=rank, checkpoint=True, signum=64)
        assert BoundaryWords.unpack(words.pack(world_size), world_size) == words
    # a rank's word is never 0, the word of none
    assert BoundaryWords(nonfinite_rank=last, stop_rank=last).pack(world_size)[[0, 3]].tolist() == [1, 1]


def test_no_word_of_a_rank_is_negative():
    """The maximum of the other ranks' zeros must not hide any word a rank writes."""
    words = BoundaryWords(nonfinite_rank=2, command=0, payload_bytes=0, stop_rank=2, checkpoint=True, signum=15)
    assert min(words.pack(3).tolist()) >= 0


def agreed(sent: list[BoundaryWords]) -> BoundaryWords:
    """What the all-reduce (MAX) of the ranks' words gives every rank."""
    world_size = len(sent)
    return BoundaryWords.unpack(torch.stack([w.pack(world_size) for w in sent]).amax(0), world_size)


def test_the_maximum_names_the_first_rank_and_keeps_rank_0s_command():
    sent = [BoundaryWords(command=5, payload_bytes=321),
            BoundaryWords(),
            BoundaryWords(nonfinite_rank=2, stop_rank=2, signum=int(signal.SIGTERM)),
            BoundaryWords(nonfinite_rank=3, stop_rank=3, checkpoint=True, signum=int(signal.SIGINT))]
    assert agreed(sent) == BoundaryWords(nonfinite_rank=2, command=5, payload_bytes=321, stop_rank=2,
                                         checkpoint=True, signum=int(signal.SIGTERM))
    assert agreed([BoundaryWords(), BoundaryWords()]) == BoundaryWords()


def test_rank_0s_probe_spacing_and_the_first_rank_short_of_headroom_are_agreed():
    sent = [BoundaryWords(probe_spacing=7), BoundaryWords(), BoundaryWords(headroom_rank=2),
            BoundaryWords(headroom_rank=3)]
    assert agreed(sent) == BoundaryWords(probe_spacing=7, headroom_rank=2)
    slots = Slots(world_size=4, layers=0)
    summed = torch.stack([slots.pack(rank=r, code=0, payload_bytes=0, finite=True, stop=None, row=None,
                                     probe_spacing=w.probe_spacing, low_headroom=w.headroom_rank is not None)
                          for r, w in enumerate(sent)]).to(torch.float32).sum(0)
    assert BoundaryWords.from_received(slots.read(summed)) == agreed(sent)


def test_the_gradients_carry_the_same_words_but_the_first_stopping_ranks_signal():
    """What came in DDP's gradient all-reduce (the sum of the slots) reads as the maximum would,
    but for the signal, which is the first stopping rank's own there."""
    sent = [BoundaryWords(command=5, payload_bytes=321),
            BoundaryWords(nonfinite_rank=1, stop_rank=1, signum=int(signal.SIGINT)),
            BoundaryWords(stop_rank=2, checkpoint=True, signum=int(signal.SIGTERM))]
    slots = Slots(world_size=3, layers=0)
    summed = torch.stack([
        slots.pack(rank=r, code=w.command, payload_bytes=w.payload_bytes, finite=w.nonfinite_rank is None,
                   stop=(True, w.checkpoint, w.signum) if w.stop_rank is not None else None, row=None)
        for r, w in enumerate(sent)]).to(torch.float32).sum(0)
    carried = BoundaryWords.from_received(slots.read(summed))
    assert carried == dataclasses.replace(agreed(sent), signum=int(signal.SIGINT))
    assert carried == BoundaryWords(nonfinite_rank=1, command=5, payload_bytes=321, stop_rank=1,
                                    checkpoint=True, signum=int(signal.SIGINT))
    nothing = BoundaryWords.from_received(slots.read(torch.zeros(slots.size)))
    assert nothing == BoundaryWords()
