"""Restoring is two steps so that a bad file never leaves a half-restored run behind:
``read_checkpoint`` reads the file and checks everything against the live model and optimizer
without changing anything; ``LoadedCheckpoint.apply`` then changes the live objects."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from amp_tui.training.checkpoint import checks, codec, io, live, manifest
from amp_tui.training.checkpoint.dcp import ShardedCheckpoint, read_sharded
from amp_tui.training.checkpoint.errors import CheckpointError, Problem
from amp_tui.training.checkpoint.files import CheckpointInfo

WEIGHTS_NOTICE = "weights only: optimizer, scaler and RNG keep their current state"


class LoadedCheckpoint:
    """A checkpoint read into memory and checked; `apply` restores it onto live objects."""

    def __init__(self, info: CheckpointInfo, *, model_state: dict[str, torch.Tensor],
                 optimizer: dict | None = None, scheduler: dict | None = None,
                 scheduler_class: str | None = None, scheduler_note: str | None = None,
                 scaler_state: dict | None = None, extra: dict | None = None,
                 rng_cpu: torch.Tensor | None = None,
                 rng_cuda: dict[int, torch.Tensor] | None = None):
        self.info = info
        self.kind = info.kind
        self.step = info.step
        self.dtype = info.dtype
        self.scaler_state = scaler_state
        self.extra = extra if extra is not None else {}
        self.notice: str | None = WEIGHTS_NOTICE if info.kind == "weights" else None
        self._model_state = model_state
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._scheduler_class = scheduler_class
        self._scheduler_note = scheduler_note
        self._rng_cpu = rng_cpu
        self._rng_cuda = rng_cuda or {}

    def __repr__(self) -> str:
        return (f"LoadedCheckpoint(path={str(self.info.path)!r}, kind={self.kind!r}, "
                f"step={self.step!r}, dtype={self.dtype!r})")

    def _check(self, model, optimizer, scheduler) -> tuple[live.ModelState, dict[str, str]]:
        """Raise Problem if this checkpoint cannot be applied; return the live model's state and
        the alias plan for its weights."""
        state = live.model_state(model)
        aliases = checks.check_model(self._model_state, state)
        if self.kind == "full":
            checks.check_optimizer(self._optimizer, optimizer)
            checks.check_scheduler(self._scheduler_class, scheduler)
            checks.check_rng(self._rng_cpu, self._rng_cuda)
        return state, aliases

    def apply(self, model, optimizer, scheduler=None) -> None:
        """Restore onto the live objects: weights; for full checkpoints also the optimizer,
        the scheduler (if saved and given) and the RNG states.

        Everything is checked and prepared first, so a file that read_checkpoint accepted is
        not left half-applied.
        """
        try:
            state, plan = self._check(model, optimizer, scheduler)
        except Problem as e:
            raise CheckpointError(f"cannot restore {self.info.path}: {e}") from None

        weights = {state.names[k]: t for k, t in self._model_state.items()}
        for alias, present in plan.items():
            weights[state.names[alias]] = self._model_state[present]

        if self.kind == "full":
            osd = self._optimizer_state_dict(optimizer)
            sched = (copy.deepcopy(self._scheduler)
                     if scheduler is not None and self._scheduler is not None else None)
            cuda = ({i: s for i, s in self._rng_cuda.items() if i < torch.cuda.device_count()}
                    if self._rng_cuda and live.cuda_ready() else {})

        with torch.no_grad():
            state.module.load_state_dict(weights, strict=True)
        if self.kind != "full":
            return
        optimizer.load_state_dict(osd)
        if sched is not None:
            scheduler.load_state_dict(sched)
        if self._rng_cpu is not None:
            torch.set_rng_state(self._rng_cpu.clone())
        for i, state in cuda.items():
            torch.cuda.set_rng_state(state.clone(), i)

    def _optimizer_state_dict(self, optimizer) -> dict:
        saved = self._optimizer

        def fresh(value):
            # Clones so the optimizer owns its state (no views into the file buffer, and a
            # second apply starts from the file's values again).
            if isinstance(value, torch.Tensor):
                return value.clone()
            if isinstance(value, tuple):
                return tuple(fresh(v) for v in value)
            if isinstance(value, list):
                return [fresh(v) for v in value]
            if isinstance(value, dict):
                return {k: fresh(v) for k, v in value.items()}
            return value

        groups = []
        for live_group, sg in zip(optimizer.param_groups, saved["param_groups"]):
            group = fresh(sg)
            for key, value in group.items():
                # A tensor hyperparameter (lr as a tensor) goes back to where the live one lives.
                have = live_group.get(key)
                if isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor):
                    group[key] = value.to(have.device)
            groups.append(group)
        return {"state": {idx: fresh(s) for idx, s in saved["state"].items()},
                "param_groups": groups}


def read_checkpoint(path: Path, *, model, optimizer, scheduler=None) -> LoadedCheckpoint | ShardedCheckpoint:
    """Read a checkpoint and check it against the live objects, changing nothing (a sharded
    checkpoint's folder: its manifest and files; its shards are read when it is applied).

    Raises CheckpointError naming the file and the problem.
    """
    path = Path(path)
    if manifest.is_sharded_dir(path):
        return read_sharded(path, model=model, optimizer=optimizer, scheduler=scheduler)
    try:
        ckpt = _load(path)
        ckpt._check(model, optimizer, scheduler)
    except Problem as e:
        raise CheckpointError(f"cannot restore {path}: {e}") from None
    if ckpt.kind == "full" and scheduler is not None and ckpt._scheduler is None:
        why = ckpt._scheduler_note or "the checkpoint has no scheduler state"
        ckpt.notice = f"{why}; the scheduler keeps its current state"
    return ckpt


def _load(path: Path) -> LoadedCheckpoint:
    head, tensors, mtime = io.read_file(path)
    if codec.kind(head.metadata, head.names) == "weights":
        info = CheckpointInfo(path=path, step=None, dtype=None, kind="weights", mtime=mtime)
        return LoadedCheckpoint(info, model_state=codec.saved_weights(tensors))
    step, dtype, state = codec.decode(head.metadata, tensors)
    info = CheckpointInfo(path=path, step=step, dtype=dtype, kind="full", mtime=mtime)
    return LoadedCheckpoint(info, **state)
