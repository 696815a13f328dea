"""The file: safetensors, read and written by the safetensors library, checked first, written
atomically.

Nothing here knows what the tensors and the metadata mean (that is codec.py). The library parses
and writes the format; this module adds what it leaves out:
- a check of the header before the library sees the file, for what the library lets through
  (a key named twice, unknown entry fields, bytes before the JSON) and for messages that say
  what is wrong (a pickle or zip file, where a file was cut off, overlapping offsets);
- the atomic write: a temporary file in the same folder, fsync, rename, fsync of the folder.
Files are never unpickled.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from amp_tui.core import jsonsafe
from amp_tui.training.checkpoint.errors import Problem, Unencodable, dtype_name, one_line, reason

# safetensors refuses headers above 100 MB; anything larger is not a safetensors file.
MAX_HEADER = 100_000_000
# The temporary file of a save: ".<name>.tmp-<pid>-<n>" next to its target.
TEMPORARY_NAME = re.compile(r"^\..+\.safetensors\.tmp-(\d+)(?:-\d+)?$")
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}

# Temporary files of saves running in this process, so cleanup never removes one mid-write.
_in_progress: set[str] = set()
_in_progress_lock = threading.Lock()
_tmp_counter = itertools.count(1)


def _check_little_endian() -> None:
    # The digests cover the tensors' bytes as safetensors stores them: little-endian.
    if sys.byteorder != "little":
        raise Problem("checkpoints need a little-endian machine")


def _as_os_error(exc: Exception) -> Exception:
    """The OSError inside a safetensors error ("I/O error: No space left on device (os error
    28)"), so that a full disk reads as one; other errors as they are."""
    m = re.search(r"\(os error (\d+)\)", str(exc))
    if m is None:
        return exc
    code = int(m.group(1))
    return OSError(code, os.strerror(code))


# --------------------------------------------------------------------------- writing


def _safetensors():
    """The safetensors library, imported on first use: a run that saves and restores no
    checkpoint (most short runs) starts without it."""
    import safetensors.torch
    return safetensors


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    _check_little_endian()
    safetensors = _safetensors()
    try:
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    except KeyError as e:  # safetensors.torch knows no size for this dtype
        names = sorted(n for n, t in tensors.items() if t.dtype == e.args[0])
        if not names:
            raise
        raise Unencodable(f"tensor {names[0]} has dtype {dtype_name(e.args[0])}, "
                          "which safetensors cannot store") from None
    except safetensors.SafetensorError as e:
        raise _as_os_error(e) from None


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Either the complete file appears at `path` or nothing changes; raises what went wrong."""
    folder = path.parent
    # Same folder as the target so os.replace is an atomic rename, never a cross-device copy.
    tmp = folder / f".{path.name}.tmp-{os.getpid()}-{next(_tmp_counter)}"
    with _in_progress_lock:
        _in_progress.add(tmp.name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_safetensors(tmp, tensors, metadata)
        _fsync_file(tmp)  # safetensors does not sync: the data must be on disk before the rename
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
    fsync_folder(folder)


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable; not possible on every platform or filesystem."""
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
    names: frozenset[str]  # of the tensors


def _check_header(f, size: int) -> Header:
    """Read the header of an open file of `size` bytes and check it; the library decodes."""
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

    spans = []
    for name, e in header.items():
        offsets = e.get("data_offsets") if isinstance(e, dict) else None
        if not (isinstance(e, dict) and set(e) == _ENTRY_FIELDS and isinstance(offsets, list)
                and len(offsets) == 2 and all(type(x) is int and x >= 0 for x in offsets)):
            raise Problem(f"the header is corrupted (bad entry for tensor {name!r})")
        spans.append(tuple(offsets))

    # Tensors must tile the data section exactly, as safetensors requires; checked here too
    # so the message can tell a cut-off file from a damaged header.
    expected = 0
    for begin, end in sorted(spans):
        if begin != expected:
            raise Problem("the header is corrupted (tensor data offsets overlap or leave gaps)")
        expected = end
    data_len = size - 8 - n
    if data_len < expected:
        raise Problem(f"the tensor data is cut off ({data_len} of {expected} bytes): the file is "
                      "truncated, probably by an interrupted save or copy")
    if data_len > expected:
        raise Problem(f"the file has {data_len - expected} unexpected bytes after the tensor data")
    return Header(metadata, frozenset(header))


def _library_problem(exc: Exception) -> Problem:
    exc = _as_os_error(exc)
    if isinstance(exc, OSError):
        return Problem(f"could not read it ({reason(exc)})")
    return Problem(f"safetensors cannot read it ({one_line(exc)})")


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
    """The checked header of a regular file and its mtime, reading no tensor data; None if the
    file cannot be read or is not a sound safetensors file."""
    safetensors = _safetensors()
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            head = _check_header(f, st.st_size)
        # The library's own header checks (dtypes, byte sizes), so a listed file is one that a
        # restore reads.
        with safetensors.safe_open(str(path), framework="pt", backend="pread"):
            pass
    except (OSError, Problem, safetensors.SafetensorError):
        return None
    return head, st.st_mtime


def read_file(path: Path) -> tuple[Header, dict[str, torch.Tensor], float]:
    """The checked header, every tensor (in memory) and the mtime of the file at `path`; raises
    Problem."""
    _check_little_endian()
    safetensors = _safetensors()
    with _open_regular(path) as f:
        try:
            st = os.fstat(f.fileno())
            head = _check_header(f, st.st_size)
        except OSError as e:
            raise Problem(f"could not read it ({reason(e)})") from None
        # pread, not mmap: every tensor is copied into memory, so checks and apply use the same
        # bytes even if the file is replaced meanwhile, and a file truncated while it is read
        # is an error here rather than a crash (SIGBUS) of the whole process.
        try:
            tensors = safetensors.torch.load_file(path, backend="pread")
        except (safetensors.SafetensorError, OSError, KeyError, RuntimeError, ValueError) as e:
            raise _library_problem(e) from None
    if set(tensors) != head.names:
        raise Problem("the file changed while it was being read")
    return head, tensors, st.st_mtime
