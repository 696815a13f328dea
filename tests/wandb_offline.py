"""An offline W&B run read back: the records of its `.wandb` file, parsed with wandb's own
protocol buffers (`wandb.proto.wandb_internal_pb2.Record`).

wandb (0.31) ships no Python reader of the file any more; its framing is LevelDB's log format,
which wandb-core writes: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
chunks, each `crc32 (4) | length (2) | type (1) | data`, the CRC a zlib CRC-32 of the type byte
then the data; a record is one FULL chunk or FIRST, MIDDLE..., LAST.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32 * 1024
CHUNK_HEAD = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    """The Record protocol buffers of one `.wandb` file, in order; a bad checksum raises."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"not a W&B run file: {path}"
    pos, pending = 7, b""
    while pos + CHUNK_HEAD <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEAD:
            pos += left          # the block's tail is padding
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEAD])
        if kind == 0 and length == 0:
            pos += left          # zero padding to the block's end
            continue
        chunk = data[pos + CHUNK_HEAD:pos + CHUNK_HEAD + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad checksum at {pos}"
        pos += CHUNK_HEAD + length
        if kind == FIRST:
            pending = chunk
            continue
        if kind == MIDDLE:
            pending += chunk
            continue
        body = pending + chunk if kind == LAST else chunk
        pending = b""
        record = wandb_internal_pb2.Record()
        record.ParseFromString(body)
        yield record


def run_file(wandb_dir: Path) -> Path:
    """The `.wandb` file of the one offline run under `wandb_dir` (WANDB_DIR)."""
    files = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {wandb_dir}, found {files}"
    return files[0]


def history(path: Path) -> list[dict]:
    """The run's history rows, each a dict of its keys and JSON-decoded values."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def alerts(path: Path) -> list:
    return [r.alert for r in records(path) if r.WhichOneof("record_type") == "alert"]


def artifacts(path: Path) -> list:
    return [r.artifact for r in records(path) if r.WhichOneof("record_type") == "artifact"]
