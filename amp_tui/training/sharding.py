"""FSDP2: a model whose parameters are sharded across the ranks with PyTorch's own
`torch.distributed.fsdp.fully_shard`, as amp-tui shards it (`--fsdp`) or finds it.

amp-tui shards nothing of its own: `shard_model` calls `fully_shard` per block and then on the
root, as torchtitan and Accelerate's FSDP2 plugin do. A sharded parameter is a `DTensor`: each
rank holds its shard (`to_local()`), and its gradient after the backward's reduce-scatter is the
shard of the whole gradient. The probes read the local shards (`local_tensor`); the ranks'
maxima are then reduced across the ranks with the figures that already go round
(job/ranks/rank_figures.py).
"""

from __future__ import annotations

from typing import Iterable

import torch


def dtensor_type():
    """DTensor's class, or None where this build of torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # a build without torch.distributed
        return None
    return DTensor


def fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def is_sharded(model: torch.nn.Module) -> bool:
    """The model (or a module in it) went through `fully_shard`, or holds DTensor parameters
    (Accelerate's FSDP2 plugin and Lightning's ModelParallelStrategy call `fully_shard` too)."""
    fsdp, dtensor = fsdp_module_type(), dtensor_type()
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        return True
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor (a plain tensor as it is)."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t.to_local()
    return t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank (a collective where it is partial); a plain tensor
    as it is. For a scalar such as the total gradient norm clipping returns."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t.full_tensor()
    return t


class ShardingError(ValueError):
    """The blocks asked for can't be sharded as asked (worded for the user)."""


def default_blocks(model: torch.nn.Module) -> list[str]:
    """The modules that own parameters directly, below the root: one FSDP unit each, so each is
    gathered only for its own forward and backward."""
    return [name for name, m in model.named_modules()
            if name and any(True for _ in m.parameters(recurse=False))]


def named_blocks(model: torch.nn.Module, blocks: Iterable) -> list[str]:
    """The module names `blocks` stands for: names as `named_modules()` gives them, or module
    classes (every module of that class, a transformer block say)."""
    modules = dict(model.named_modules())
    names: list[str] = []
    for block in blocks:
        if isinstance(block, type):
            found = [n for n, m in modules.items() if n and isinstance(m, block)]
            if not found:
                raise ShardingError(f"'fsdp_blocks': no module of the model is a {block.__name__}")
            names += found
        elif isinstance(block, str) and block in modules and block:
            names.append(block)
        else:
            raise ShardingError(f"'fsdp_blocks': {block!r} is neither a module name of the model nor a "
                                "module class")
    return list(dict.fromkeys(names))


def shard_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, blocks: Iterable | None = None,
                *, broadcast_from: int | None = None, **fully_shard_options) -> list[str]:
    """`fully_shard` each block (innermost first), then the root; the optimizer's parameter
    groups then hold the sharded parameters (fully_shard makes new ones). Returns the blocks.
    `broadcast_from`: that rank's parameters and buffers first, on every rank (fully_shard takes
    each rank's shard from its own copy). Needs the default process group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    names = named_blocks(model, blocks) if blocks is not None else default_blocks(model)
    modules = dict(model.named_modules())
    before = {id(p): name for name, p in model.named_parameters()}
    if optimizer.state:
        raise ShardingError("--fsdp: the optimizer already holds state; build it in setup() before any step")
    if broadcast_from is not None:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=broadcast_from)
    # The deepest first: a block inside another is its own unit, the outer one keeps the rest.
    for name in sorted(names, key=lambda n: n.count("."), reverse=True):
        fully_shard(modules[name], **fully_shard_options)
    fully_shard(model, **fully_shard_options)
    after = dict(model.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [after[before[id(p)]] for p in group["params"]]
        except KeyError:
            raise ShardingError("--fsdp: the optimizer holds a parameter that is not the model's") from None
    return names
