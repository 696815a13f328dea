"""A sharded checkpoint's folder (training/checkpoint/manifest.py) in the listing, without any
rank: listed by its manifest, left out when the manifest or a shard file is damaged, its
temporary folder removed once its save is gone. Saving and loading shards is the 2-rank
test's (tests/e2e/test_fsdp.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from amp_tui.training.checkpoint import (
    CheckpointError,
    checkpoint_files,
    cleanup_temporary_files,
    list_checkpoints,
    manifest,
)
from amp_tui.training.checkpoint.dcp import read_sharded


def write_folder(folder, step=3, shape=(4, 2)):
    folder.mkdir(parents=True)
    save_file({"model.weight": torch.zeros(shape)}, str(folder / "shard-00001-model-00001-of-00001.safetensors"))
    manifest.write_manifest(folder, {
        "step": step, "dtype": "bfloat16", "world_size": 2, "extra": {"world_size": 2}, "scaler": None,
        "scheduler": None, "model": {"weight": {"shape": list(shape), "dtype": "float32"}},
        "optimizer": {"class": "SGD", "param_names": ["weight"], "param_shapes": [list(shape)], "state": {},
                      "param_groups": [{"lr": 0.1, "params": ["weight"]}]},
        "tensors": ["model.weight"], "files": manifest.describe_files(folder)})
    return folder


def test_a_folder_is_listed_beside_the_files_newest_first(tmp_path):
    folder = write_folder(manifest.sharded_path(tmp_path, 3))
    assert folder.name == "step-0000003.shards"
    [info] = list_checkpoints(tmp_path)
    assert (info.path, info.step, info.dtype, info.kind) == (folder, 3, "bfloat16", "full")
    assert checkpoint_files(tmp_path) == [folder]
    assert manifest.sharded_path(tmp_path, 3).name == "step-0000003-2.shards"


def test_a_damaged_manifest_or_shard_file_is_not_listed_or_refused(tmp_path):
    folder = write_folder(tmp_path / "step-0000003.shards")
    model = torch.nn.Linear(2, 4, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert read_sharded(folder, model=model, optimizer=opt).step == 3
    shard = folder / "shard-00001-model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its digest"):
        read_sharded(folder, model=model, optimizer=opt)
    text = json.loads((folder / manifest.MANIFEST).read_text())
    text["step"] = 4
    (folder / manifest.MANIFEST).write_text(json.dumps(text))
    assert list_checkpoints(tmp_path) == []
    assert checkpoint_files(tmp_path) == [folder]   # still there for --resume to say why it was skipped


def test_the_live_model_is_checked_against_the_manifest(tmp_path):
    folder = write_folder(tmp_path / "step-0000003.shards")
    model = torch.nn.Linear(2, 5, bias=False)
    with pytest.raises(CheckpointError, match="shape"):
        read_sharded(folder, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_temporary_folder_of_a_save_that_is_gone_is_removed(tmp_path):
    gone = tmp_path / ".step-0000003.shards.tmp-999999999"
    gone.mkdir()
    (gone / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"x")
    alive = tmp_path / f".step-0000004.shards.tmp-{os.getppid()}"
    alive.mkdir()
    assert list_checkpoints(tmp_path) == []
    assert cleanup_temporary_files(tmp_path) == 1
    assert not gone.exists() and alive.exists()
