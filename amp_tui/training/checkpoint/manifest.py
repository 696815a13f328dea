"""A sharded checkpoint's folder and its manifest.

A model sharded with FSDP2 can be saved without gathering it on one rank (checkpoint/dcp.py):
every rank writes its own shards with `torch.distributed.checkpoint` and its
`HuggingFaceStorageWriter` (safetensors files, one per rank, "shard-0000N-model-00001-of-00001
.safetensors"), into a folder "step-0000123.shards" beside the single-file checkpoints. Rank 0
then writes the manifest, `amp-tui-checkpoint.json`: what the single-file checkpoint keeps in
its safetensors metadata (step, dtype, extra with every rank's RNG state, scaler, scheduler, the
optimizer's parameter groups), the names, full shapes and dtypes of the tensors, the world size,
and the size and SHA-256 digest of each shard file; a digest of the manifest itself last.

The folder is written as ".step-0000123.shards.tmp-<pid>" and renamed once the manifest is in
it, so a listed folder is a whole checkpoint. Nothing here, nor in the files torch writes, is a
pickle: `HuggingFaceStorageWriter` with `save_distributed=True` writes no `.metadata` file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from amp_tui.core import jsonsafe
from amp_tui.core.precision import DTYPES
from amp_tui.training.checkpoint.errors import Problem, few, one_line, reason

FORMAT = "amp-tui-sharded-checkpoint"
FORMAT_VERSION = "1"
MANIFEST = "amp-tui-checkpoint.json"
DIR_SUFFIX = ".shards"
SHARD_SUFFIX = ".safetensors"
TEMPORARY_DIR = re.compile(r"^\..+\.shards\.tmp-(\d+)$")
REQUIRED = ("step", "dtype", "world_size", "extra", "scaler", "scheduler", "model", "optimizer",
            "tensors", "files", "digest")


def is_sharded_dir(path: Path) -> bool:
    """`path` is a sharded checkpoint's folder (by its name; its manifest is checked on reading)."""
    path = Path(path)
    return path.name.endswith(DIR_SUFFIX) and not path.name.startswith(".") and path.is_dir()


def sharded_path(folder: Path, step: int) -> Path:
    """folder/"step-0000123.shards", or "-2", "-3"... if that name (or the file's) is taken."""
    base, n = f"step-{step:07d}", 2
    name = base
    while (Path(folder) / f"{name}{DIR_SUFFIX}").exists() or (Path(folder) / f"{name}.safetensors").exists():
        name, n = f"{base}-{n}", n + 1
    return Path(folder) / f"{name}{DIR_SUFFIX}"


def temporary_dir(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.tmp-{pid}")


def _digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(jsonsafe.dumps(body).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shard_files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if p.name.endswith(SHARD_SUFFIX))


def describe_files(folder: Path) -> dict[str, dict]:
    """Each shard file's size and digest, read a block at a time (never the whole model in memory)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in shard_files(folder)}


def write_manifest(folder: Path, manifest: dict) -> None:
    """The manifest into `folder`, with its digest, flushed to the disk."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}
    manifest["digest"] = _digest(manifest)
    path = Path(folder) / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        f.write(jsonsafe.dumps(manifest))
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> dict:
    """The checked manifest of a sharded checkpoint's folder (raises Problem)."""
    path = Path(folder) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise Problem(f"the folder has no {MANIFEST}: it is not a whole sharded checkpoint") from None
    except (OSError, UnicodeDecodeError) as e:
        raise Problem(f"could not read its {MANIFEST} ({reason(e)})") from None
    try:
        manifest = jsonsafe.loads(text, unique_keys=True)
    except ValueError as e:
        raise Problem(f"its {MANIFEST} is not valid JSON ({one_line(e)})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise Problem(f"its {MANIFEST} is not an amp-tui sharded checkpoint's")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise Problem(f"it has sharded checkpoint format version {manifest.get('format_version')!r}; "
                      f"this amp-tui reads version {FORMAT_VERSION}")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise Problem(f"its {MANIFEST} lacks {few(missing)}: the checkpoint is corrupted")
    if _digest(manifest) != manifest["digest"]:
        raise Problem(f"its {MANIFEST} does not match its digest: the checkpoint is corrupted")
    step, dtype, world = manifest["step"], manifest["dtype"], manifest["world_size"]
    if type(step) is not int or step < 0:
        raise Problem(f"the step in its manifest is {step!r}, not a number")
    if dtype not in DTYPES:
        raise Problem(f"the dtype in its manifest is {dtype!r}, not one of {', '.join(DTYPES)}")
    if type(world) is not int or world < 1:
        raise Problem(f"the world size in its manifest is {world!r}")
    return manifest


def check_files(folder: Path, manifest: dict) -> None:
    """Every shard file the manifest names is there, whole (size and digest), and no other:
    torch's reader would read any .safetensors file in the folder."""
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        raise Problem("its manifest names no shard file")
    present = {p.name for p in shard_files(folder)}
    stray = present - set(files)
    if stray:
        raise Problem(f"the folder holds shard files its manifest does not name: {few(stray)}")
    for name, want in files.items():
        path = Path(folder) / name
        try:
            size = path.stat().st_size
            if size != want.get("bytes"):
                raise Problem(f"shard file {name} has {size} bytes, its manifest says {want.get('bytes')}: "
                              "the checkpoint is truncated or corrupted")
            if file_sha256(path) != want.get("sha256"):
                raise Problem(f"shard file {name} does not match its digest: the checkpoint is corrupted")
        except FileNotFoundError:
            raise Problem(f"shard file {name} is missing") from None
        except OSError as e:
            raise Problem(f"could not read shard file {name} ({reason(e)})") from None


def peek(folder: Path) -> tuple[int, str, float] | None:
    """The step, dtype and mtime of a sharded checkpoint's folder, from its manifest alone; None
    where it is not a sound one."""
    try:
        manifest = read_manifest(folder)
        mtime = (Path(folder) / MANIFEST).stat().st_mtime
    except (Problem, OSError, json.JSONDecodeError):
        return None
    return manifest["step"], manifest["dtype"], mtime
