"""Choosing FSDP2's blocks (no process group needed), the script contract's `fsdp_blocks`, and
`--fsdp` refused where there is nothing to shard across."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_tui.cli import main
from amp_tui.training.script import ScriptError, validate_setup
from amp_tui.training.sharding import ShardingError, default_blocks, is_sharded, local_tensor, named_blocks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.scale = nn.Parameter(torch.ones(1))   # owned by the root: sharded with it


def test_by_default_each_module_owning_parameters_is_a_block():
    assert default_blocks(Model()) == ["embed", "blocks.0.attn", "blocks.0.norm", "blocks.1.attn", "blocks.1.norm"]


def test_blocks_are_named_or_given_by_class():
    model = Model()
    assert named_blocks(model, [Block]) == ["blocks.0", "blocks.1"]
    assert named_blocks(model, ["embed", Block, "blocks.0"]) == ["embed", "blocks.0", "blocks.1"]
    with pytest.raises(ShardingError, match="'blocks.7' is neither"):
        named_blocks(model, ["blocks.7"])
    with pytest.raises(ShardingError, match="no module of the model is a Conv2d"):
        named_blocks(model, [nn.Conv2d])


def test_a_plain_model_is_not_sharded_and_its_tensors_are_their_own_shards():
    model = Model()
    assert not is_sharded(model)
    assert local_tensor(model.scale) is model.scale and local_tensor(None) is None


def test_fsdp_blocks_must_be_a_list(tmp_path):
    model = nn.Linear(2, 2)
    values = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
              "loss_fn": lambda m, b: m(b).sum(), "batches": [torch.ones(1, 2)]}
    assert validate_setup({**values, "fsdp_blocks": ["weight", nn.Linear]}, tmp_path / "s.py").fsdp_blocks \
        == ["weight", nn.Linear]
    with pytest.raises(ScriptError, match="'fsdp_blocks' from s.py must be a list"):
        validate_setup({**values, "fsdp_blocks": "blocks"}, tmp_path / "s.py")


def test_fsdp_in_one_process_is_refused(mlp_script, capsys):
    assert main(["train", str(mlp_script), "--headless", "--fsdp", "--steps", "1"]) == 2
    assert "--fsdp shards the model across several ranks: give --nproc N" in capsys.readouterr().err
