"""A model sharded with FSDP2 (`fully_shard`), and its optimizer, seen whole by the checkpoint
codec: the same file as a one-process run's, so the checks, the listing, `--resume`, replay and
`safetensors.safe_open` read it as they read any other.

Saving gathers the full state dicts on rank 0 (`get_model_state_dict` and
`get_optimizer_state_dict` with `full_state_dict=True, cpu_offload=True`: a collective that every
rank joins; only rank 0 holds the tensors, in host memory), and rank 0 writes the file as for a
replicated model. Restoring reads the whole file on every rank and hands it to
`set_model_state_dict` / `set_optimizer_state_dict`, which keep each rank's shard. So the whole
model must fit in one host's memory (the reason this is for models that do: docs/distributed.md).

torch's sharded state dicts name the optimizer's parameters by their names in the model; the
codec's files number them in the optimizer's order, as `torch.optim` does. The views translate.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_tui.training.checkpoint.live import flat_params


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


class FullStateModel:
    """What the codec reads and loads of a sharded model: `state_dict()` the gathered full one
    (saving; {} on the ranks other than 0) or, where nothing was gathered (restoring), a stand-in
    of each tensor's full shape and dtype for the checks; `load_state_dict` shards a full one."""

    def __init__(self, model: torch.nn.Module, gathered: dict[str, torch.Tensor] | None = None):
        self.model = model
        self._gathered = gathered

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._gathered is not None:
            return self._gathered
        # One element expanded to the full shape: what the checks compare (names, shapes and
        # dtypes) without a full copy of the model per rank.
        return {name: torch.empty((), dtype=t.dtype).expand(t.shape)
                for name, t in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        return set_model_state_dict(self.model, state,
                                    options=StateDictOptions(full_state_dict=True, strict=strict))


class FullStateOptimizer:
    """What the codec reads and loads of a sharded model's optimizer: its parameter groups and
    live state (sharded, with the full shapes) for the checks, its full state dict numbered in
    the optimizer's order."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, gathered: dict | None = None):
        self.model, self.optimizer = model, optimizer
        self.class_name = type(optimizer).__name__
        self._gathered = gathered
        names = {id(p): name for name, p in model.named_parameters()}
        self._names = [names[id(p)] for p in flat_params(optimizer)]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict:
        if self._gathered is None:
            return {"state": {}, "param_groups": []}
        index = {name: i for i, name in enumerate(self._names)}
        return {"state": {index[name]: s for name, s in self._gathered["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                 for g in self._gathered["param_groups"]]}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        by_name = {"state": {self._names[int(i)]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [self._names[int(i)] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=True))


def gathered_views(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """(FullStateModel, FullStateOptimizer): the full model and optimizer state gathered on rank 0,
    as the codec reads a live pair.
    A collective: every rank calls it at the same point."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    options = _options()
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    return FullStateModel(model, weights), FullStateOptimizer(model, optimizer, optim)


def loading_views(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """(FullStateModel, FullStateOptimizer): the pair a full checkpoint is checked against and
    loaded into, every rank its shards."""
    return FullStateModel(model), FullStateOptimizer(model, optimizer)
