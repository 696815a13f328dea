"""The gathers to rank 0 (step figures, non-finite details, RNG states), apart from the step's words."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from amp_tui.job.ranks.rank_figures import OWN_KINDS, merge_figures, pack_figures
from amp_tui.job.ranks.ranks_lost import RanksLost
from amp_tui.job.ranks.rng_states import rng_state
from amp_tui.training.step.engine import StepResult


class RankGathers:
    """What every rank sends to rank 0 (see distributed.py's docstring, "the figures"). Mixed into
    `Ranks`, whose collectives (`_collective`, `_let_go`) and step-time bookkeeping these use."""

    # ---- the figures ------------------------------------------------------------------------
    def gather_step(self, result: StepResult, names: list[str], *, details: bool) -> StepResult:
        """Every rank's figures of a probed step (or an agreed non-finite one, with `details`: a
        step whose loss check or gradients every rank judged alike) to rank 0, which gets the
        result to record: each layer's maximum over the ranks, each rank's loss and step time,
        and where a value went non-finite, the first rank that saw it with its layer and
        diagnosis. The other ranks get `result` back. Rank 0 waits here for every rank's end of
        the step; `gather_later` does not."""
        if details and result.nonfinite is not None:
            return self._gather_details(result, names)
        due = self.gather_later(result, names)
        return due() if due is not None else result

    def gather_later(self, result: StepResult, names: list[str]) -> Callable[[], StepResult] | None:
        """The gather of a probed step's figures, started (None: an unprobed step has none): the
        function returned waits for it and gives what `gather_step` would have. Waited for once
        the next step's loss check has been answered, it is long done: every rank issued it at
        the end of this step, before that check. Issued at once, waited for later, it keeps
        gloo's rule (every rank issues the same collectives in the same order) and rank 0 no
        longer waits at the end of each probed step for the slowest rank to finish it. Not for a
        non-finite step that needs `details`."""
        compute_s = self._take_compute_s(result)
        if result.figures is None:
            return None
        loss_rank = self.nonfinite_rank if result.nonfinite == "loss" else None   # reset at the boundary
        if self._channel is not None:
            return self._figures_by_gradients(result, compute_s, names, loss_rank)
        arrived = self._start_gather(pack_figures(result, compute_s))

        def figures(*, failed: bool = False) -> StepResult:
            rows = arrived()
            if rows is None:
                return result
            return merge_figures(result, rows, names, None, loss_rank=loss_rank)
        return figures

    def _figures_by_gradients(self, result: StepResult, compute_s: float, names: list[str],
                              loss_rank: int | None) -> Callable[..., StepResult]:
        """gather_later where DDP's all-reduce carries the figures: this rank's row goes with the
        next step's gradients. Where they are asked for first (a pause, a stop, a save, a restore,
        the end: every rank at the same boundary) it goes on its own, in a gather. After a
        failure (`failed`) no collective is started: a row still here never comes."""
        row = pack_figures(result, compute_s, kinds=OWN_KINDS)
        self._rows_out, self._rows_in = row, None

        def figures(*, failed: bool = False) -> StepResult:
            came = self._rows_in
            if came is not None and came[0] is row:
                rows = came[1]
            elif self._rows_out is row and not failed:
                self._rows_out = None
                rows = self._start_gather(row)()
            else:
                raise RanksLost("the other ranks' figures of the step never came")
            if not self.is_main or rows is None:
                return result
            return merge_figures(result, rows, names, None, loss_rank=loss_rank, kinds=OWN_KINDS)
        return figures

    def _take_compute_s(self, result: StepResult) -> float:
        compute_s = self._compute_s if self._compute_s is not None else result.duration
        self._compute_s = None
        return compute_s

    def _start_gather(self, packed: torch.Tensor) -> Callable[[], torch.Tensor | None]:
        """This rank's packed figures on their way to rank 0: the function returned waits for
        them and gives rank 0 every rank's row, on the host (None on the others)."""
        packed = packed.to(self._comm)
        rows = [torch.empty_like(packed) for _ in range(self.world_size)] if self.is_main else None
        what = "gathering the step's figures"
        work = [self._collective(what, lambda: dist.gather(packed, gather_list=rows, dst=0, async_op=True))]

        def arrived() -> torch.Tensor | None:
            self._let_go(work, what, packed, *(rows or ()))
            return torch.stack(rows).cpu() if rows is not None else None
        return arrived

    def _gather_details(self, result: StepResult, names: list[str]) -> StepResult:
        """A non-finite step's figures, and where each rank saw it go non-finite: its layer, its
        diagnosis and the op its own replay found (rare: waited for at once)."""
        rows = self._start_gather(pack_figures(result, self._take_compute_s(result)))()
        mine = {"loss": result.loss, "layer": result.first_nonfinite_layer, "diagnosis": result.diagnosis,
                "op_trace": result.op_trace}
        seen = [None] * self.world_size if self.is_main else None
        self._collective("gathering where the step went non-finite",
                         lambda: dist.gather_object(mine, seen, dst=0))
        if rows is None:
            return result
        return merge_figures(result, rows, names, seen,
                             loss_rank=self.nonfinite_rank if result.nonfinite == "loss" else None)

    # ---- checkpoints ------------------------------------------------------------------------
    def gather_rng(self) -> list[dict] | None:
        """Every rank's RNG state, on rank 0 (None on the others): a checkpoint holds them all."""
        mine = rng_state(self.device)
        states = [None] * self.world_size if self.is_main else None
        self._collective("gathering the RNG states for a checkpoint",
                         lambda: dist.gather_object(mine, states, dst=0))
        return states

    def checkpoint_extra(self, states: list[dict]) -> dict:
        return {"world_size": self.world_size, "rank_rng": states}
