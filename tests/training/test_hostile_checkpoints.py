"""Hostile safetensors headers are refused with a clear message and bounded memory."""

import json
import struct
import tracemalloc

import pytest
import torch
from torch import nn

from amp_tui.training.checkpoint import CheckpointError, list_checkpoints, read_checkpoint


def target():
    model = nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def write(path, header_bytes: bytes, data: bytes = b"", length: int | None = None):
    n = len(header_bytes) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header_bytes + data)
    return path


def header(entries: dict, metadata=None) -> bytes:
    h = dict(entries)
    if metadata is not None:
        h["__metadata__"] = metadata
    return json.dumps(h).encode()


def refused(path, *words):
    model, opt = target()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as exc:
        read_checkpoint(path, model=model, optimizer=opt)
    message = str(exc.value)
    assert str(path.name) in message and "\n" not in message
    for word in words:
        assert word in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return message


def test_huge_header_length_is_refused_without_allocating_it(tmp_path):
    path = write(tmp_path / "huge.safetensors", b"{}", length=2**60)
    refused(path, "not a safetensors file")  # once first: imports and caches are not the file's
    tracemalloc.start()
    refused(path, "not a safetensors file")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 10 * 2**20


def test_overlapping_offsets_are_refused(tmp_path):
    entries = {"model.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
               "model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    refused(write(tmp_path / "overlap.safetensors", header(entries), b"\0" * 16), "overlap")


def test_gapped_offsets_are_refused(tmp_path):
    entries = {"model.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
               "model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}}
    refused(write(tmp_path / "gap.safetensors", header(entries), b"\0" * 32), "gaps")


def test_duplicate_tensor_names_are_refused(tmp_path):
    raw = (b'{"model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
           b' "model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}')
    refused(write(tmp_path / "dup.safetensors", raw, b"\0" * 16), "corrupted")


def test_non_string_metadata_is_refused(tmp_path):
    entries = {"model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    refused(write(tmp_path / "meta.safetensors", header(entries, {"step": 3}), b"\0" * 8), "__metadata__")


# What the safetensors library lets through and amp-tui still refuses.

def test_a_tensor_named_twice_with_the_same_entry_is_refused(tmp_path):
    raw = (b'{"model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
           b' "model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}')
    refused(write(tmp_path / "twice.safetensors", raw, b"\0" * 8), "corrupted", "duplicate key")


def test_a_metadata_key_named_twice_is_refused(tmp_path):
    raw = (b'{"__metadata__": {"format": "pt", "format": "amp-tui-checkpoint"},'
           b' "model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}')
    refused(write(tmp_path / "meta-twice.safetensors", raw, b"\0" * 8), "corrupted", "duplicate key")


def test_an_entry_with_unknown_fields_is_refused(tmp_path):
    entries = {"model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "scale": 2}}
    refused(write(tmp_path / "field.safetensors", header(entries), b"\0" * 8), "bad entry")


def test_bytes_before_the_header_json_are_refused(tmp_path):
    entries = {"model.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    refused(write(tmp_path / "space.safetensors", b" " + header(entries), b"\0" * 8),
            "not a safetensors file")


# What the library refuses: said in one line, and such a file is not listed as a checkpoint.

@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]},     # 3 floats in 8 bytes
    {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]},     # no such dtype
], ids=["wrong-byte-size", "unknown-dtype"])
def test_entries_the_library_refuses_are_refused_and_not_listed(tmp_path, entry):
    path = write(tmp_path / "entry.safetensors", header({"model.bias": entry}), b"\0" * 8)
    refused(path, "safetensors cannot read it")
    assert list_checkpoints(tmp_path) == []
