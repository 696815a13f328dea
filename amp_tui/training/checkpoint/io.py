"""The file: a safetensors file read whole and checked before use, written atomically.

Nothing here knows what the tensors and the metadata mean (that is codec.py); this module only
turns a file into a header and tensors and back, refusing anything that is not a sound
safetensors file without ever unpickling it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from amp_tui.core import jsonsafe
from amp_tui.training.checkpoint.codec import raw_bytes
from amp_tui.training.checkpoint.errors import Problem, Unencodable, dtype_name, one_line, reason

# safetensors refuses headers above 100 MB; anything larger is not a safetensors file.
MAX_HEADER = 100_000_000
# The temporary file of a save: ".<name>.tmp-<pid>-<n>" next to its target.
TEMPORARY_NAME = re.compile(r"^\..+\.safetensors\.tmp-(\d+)(?:-\d+)?$")

# safetensors dtype names. Optional entries only exist in newer torch builds.
_ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
                     ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _ST_TO_TORCH[_name] = getattr(torch, _attr)
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}

# Temporary files of saves running in this process, so cleanup never removes one mid-write.
_in_progress: set[str] = set()
_in_progress_lock = threading.Lock()
_tmp_counter = itertools.count(1)


def _check_little_endian() -> None:
    # safetensors stores little-endian bytes and we copy raw memory both ways.
    if sys.byteorder != "little":
        raise Problem("checkpoints need a little-endian machine")


# --------------------------------------------------------------------------- writing
# Written here rather than with safetensors.torch.save_file: since safetensors 0.8 that needs
# numpy, which amp-tui does not depend on. The layout is the standard one and the tests check
# that safetensors itself reads these files back.


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    _check_little_endian()
    # Larger elements first, as safetensors does, so every tensor is aligned for mmap readers.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _TORCH_TO_ST:
            raise Unencodable(f"tensor {name} has dtype {dtype_name(t.dtype)}, "
                              "which safetensors cannot store")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name in order:
        f.write(raw_bytes(tensors[name]))


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Either the complete file appears at `path` or nothing changes; raises what went wrong."""
    folder = path.parent
    # Same folder as the target so os.replace is an atomic rename, never a cross-device copy.
    tmp = folder / f".{path.name}.tmp-{os.getpid()}-{next(_tmp_counter)}"
    with _in_progress_lock:
        _in_progress.add(tmp.name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            write_safetensors(f, tensors, metadata)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    finally:
        with _in_progress_lock:
            _in_progress.discard(tmp.name)
    # Make the rename itself durable; not possible on every platform/filesystem.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def being_written(name: str) -> bool:
    """Whether `name` is the temporary file of a save running in this process."""
    with _in_progress_lock:
        return name in _in_progress


# --------------------------------------------------------------------------- reading


@dataclass
class Header:
    metadata: dict[str, str] | None
    entries: dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> dtype, shape, begin, end
    data_start: int
    data_len: int


def _parse_header(f, size: int) -> Header:
    """Read and check a safetensors header from an open file of `size` bytes."""
    if size == 0:
        raise Problem("the file is empty")
    if size < 10:  # 8-byte length + "{}" is the smallest safetensors file
        raise Problem(f"the file is only {size} bytes: it was cut off or is not a safetensors file")
    f.seek(0)
    prefix = f.read(9)
    if len(prefix) < 9:
        raise Problem("the file changed while it was being read")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2 or n > MAX_HEADER or n > size - 8 or prefix[8:9] != b"{":
        # Not a plausible safetensors header: say what the file looks like instead.
        if prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
            raise Problem("it is a pickle file, not safetensors (amp-tui never unpickles files)")
        if prefix.startswith(b"PK\x03\x04"):
            raise Problem("it is a zip archive (torch.save format?), not safetensors")
        if n <= MAX_HEADER and n > size - 8:
            raise Problem(f"the header is cut off ({size - 8} of {n} bytes): the file is "
                          "truncated or not a safetensors file")
        raise Problem("it is not a safetensors file")
    raw = prefix[8:] + f.read(n - 1)
    if len(raw) != n:
        raise Problem("the file changed while it was being read")
    try:
        header = jsonsafe.loads(raw.decode("utf-8"), unique_keys=True)
    except (UnicodeDecodeError, ValueError) as e:
        raise Problem(f"the header is corrupted ({one_line(e)})") from None
    if not isinstance(header, dict):
        raise Problem("the header is corrupted (not a JSON object)")

    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise Problem("the header is corrupted (__metadata__ is not a map of strings)")

    entries = {}
    for name, e in header.items():
        ok = (isinstance(e, dict) and set(e) == {"dtype", "shape", "data_offsets"}
              and isinstance(e["shape"], list) and isinstance(e["data_offsets"], list)
              and len(e["data_offsets"]) == 2
              and all(type(x) is int and x >= 0 for x in e["shape"] + e["data_offsets"]))
        if not ok:
            raise Problem(f"the header is corrupted (bad entry for tensor {name!r})")
        dtype = _ST_TO_TORCH.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dtype is None:
            raise Problem(f"tensor {name!r} has dtype {e['dtype']!r}, which amp-tui cannot read")
        begin, end = e["data_offsets"]
        numel = math.prod(e["shape"])
        if end - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise Problem(f"the header is corrupted (tensor {name!r} has the wrong byte size)")
        entries[name] = (dtype, e["shape"], begin, end)

    # Tensors must tile the data section exactly, as safetensors requires.
    expected = 0
    for _, _, begin, end in sorted(entries.values(), key=lambda v: (v[2], v[3])):
        if begin != expected:
            raise Problem("the header is corrupted (tensor data offsets overlap or leave gaps)")
        expected = end
    data_len = size - 8 - n
    if data_len < expected:
        raise Problem(f"the tensor data is cut off ({data_len} of {expected} bytes): the file is "
                      "truncated, probably by an interrupted save or copy")
    if data_len > expected:
        raise Problem(f"the file has {data_len - expected} unexpected bytes after the tensor data")
    return Header(metadata, entries, 8 + n, data_len)


def _open_regular(path: Path):
    try:
        st = path.stat()
    except FileNotFoundError:
        raise Problem("the file does not exist") from None
    except OSError as e:
        raise Problem(reason(e)) from None
    if stat.S_ISDIR(st.st_mode):
        raise Problem("it is a folder, not a checkpoint file")
    if not stat.S_ISREG(st.st_mode):
        raise Problem("it is not a regular file")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise Problem(reason(e)) from None
    return f


def read_header(path: Path) -> tuple[Header, float] | None:
    """The checked header of a regular file and its mtime, reading nothing else; None if the file
    cannot be read or is not a sound safetensors file."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            return _parse_header(f, st.st_size), st.st_mtime
    except (OSError, Problem):
        return None


def read_file(path: Path) -> tuple[Header, dict[str, torch.Tensor], float]:
    """The checked header, every tensor and the mtime of the file at `path`; raises Problem."""
    _check_little_endian()
    f = _open_regular(path)
    with f:
        try:
            st = os.fstat(f.fileno())
            head = _parse_header(f, st.st_size)
            # Read into memory once: checks and apply then use the same bytes even if the file
            # is replaced or truncated meanwhile (an mmap would crash on truncation).
            buf = bytearray(head.data_len)
            got = f.readinto(buf) if head.data_len else 0
        except OSError as e:
            raise Problem(f"could not read it ({reason(e)})") from None
    if got != head.data_len:
        raise Problem("the file changed while it was being read")
    tensors = {}
    for name, (dtype, shape, begin, end) in head.entries.items():
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=begin)
            tensors[name] = raw.view(dtype).reshape(shape)
    return head, tensors, st.st_mtime
