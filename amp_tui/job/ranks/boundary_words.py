"""The words the ranks agree on at each step: whether every rank's loss was finite, rank 0's
command for the next step boundary, every rank's stop vote, and the adaptive probe schedule's
words: rank 0's spacing of the probed steps and whether a rank saw a layer under the alert's
headroom (job/ranks/rank_probes.py).

Where they go in a collective of their own, they are one small int64 tensor that an
`all_reduce(MAX)` agrees on, so each word is written for the maximum to mean what is wanted:

    [first not finite, command code, payload bytes, first stop, checkpoint, signal,
     probe spacing, first low headroom]

A rank is written as world_size - rank, so the maximum names the lowest rank that wrote one (0:
none did). The command code, the payload's length and the probe spacing are rank 0's alone: the
others write 0 and each is >= 0 (a spacing of 0: none sent). Checkpoint is 1 where any rank asked
for one with its stop, and the signal the largest signal number among the votes. Where they ride
on DDP's gradient all-reduce instead
(job/ranks/gradient_channel.py), `from_received` reads the same words from what every rank sent, with
the first stopping rank's own signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from amp_tui.job.ranks.gradient_channel import Received


def _rank_word(rank: int | None, world_size: int) -> int:
    return 0 if rank is None else world_size - rank


def _word_rank(word: int, world_size: int) -> int | None:
    return None if word == 0 else world_size - word


@dataclass(frozen=True)
class BoundaryWords:
    """One rank's words before the all-reduce, or every rank's after it."""

    nonfinite_rank: int | None = None   # the first rank whose loss was not finite
    command: int = 0                    # rank 0's command code (job/ranks/command_codec.py)
    payload_bytes: int = 0              # the length of rank 0's payload, broadcast at the boundary
    stop_rank: int | None = None        # the first rank that asked to stop
    checkpoint: bool = False            # a checkpoint asked for with a stop
    signum: int = 0                     # the signal that brought a stop (0: none)
    probe_spacing: int = 0              # rank 0's spacing of the probed steps (0: none sent)
    headroom_rank: int | None = None    # the first rank whose last probed step was short of headroom

    SIZE: ClassVar[int] = 8

    def pack(self, world_size: int) -> torch.Tensor:
        """The words as the int64 tensor that goes round (on the CPU)."""
        return torch.tensor([_rank_word(self.nonfinite_rank, world_size), self.command, self.payload_bytes,
                             _rank_word(self.stop_rank, world_size), int(self.checkpoint), self.signum,
                             self.probe_spacing, _rank_word(self.headroom_rank, world_size)],
                            dtype=torch.int64)

    @classmethod
    def unpack(cls, packed: torch.Tensor, world_size: int) -> BoundaryWords:
        """The words from the tensor (one transfer where it is on a GPU)."""
        nonfinite, command, payload_bytes, stop, checkpoint, signum, spacing, headroom = packed.tolist()
        return cls(nonfinite_rank=_word_rank(nonfinite, world_size), command=command,
                   payload_bytes=payload_bytes, stop_rank=_word_rank(stop, world_size),
                   checkpoint=bool(checkpoint), signum=signum, probe_spacing=spacing,
                   headroom_rank=_word_rank(headroom, world_size))

    @classmethod
    def from_received(cls, got: Received) -> BoundaryWords:
        """Every rank's words from what came in the gradients, as the maximum would give them,
        but for the signal: the first stopping rank's own."""
        bad = [r for r, flag in enumerate(got.nonfinite) if flag]
        stopping = [r for r, (asked, _, _) in enumerate(got.stops) if asked]
        low = [r for r, flag in enumerate(got.low_headroom) if flag]
        return cls(nonfinite_rank=bad[0] if bad else None, command=got.code, payload_bytes=got.payload_bytes,
                   stop_rank=stopping[0] if stopping else None,
                   checkpoint=any(got.stops[r][1] for r in stopping),
                   signum=got.stops[stopping[0]][2] if stopping else 0,
                   probe_spacing=got.probe_spacing, headroom_rank=low[0] if low else None)
