"""Checkpoints: one safetensors file per save, written atomically and checked before use.

A full checkpoint holds the model weights, the optimizer state, the LR scheduler state, the
GradScaler state, the RNG states and a SHA-256 digest of every tensor. A weights-only file (what
``safetensors.torch.save_model`` writes, e.g. a model downloaded from a hub) can be restored too;
it sets the weights and leaves everything else as it is.

Restoring is two steps so that a bad file never leaves a half-restored run behind:
``read_checkpoint`` reads the file and checks everything against the live model and optimizer
without changing anything; ``LoadedCheckpoint.apply`` then changes the live objects.

Nothing here unpickles: files are read and written by the safetensors library, each header
checked strictly first, and all non-tensor state is JSON in the safetensors metadata.

The parts: ``io`` (the safetensors file: checked reading, atomic writing), ``codec`` (the run
state to tensors and tagged JSON and back, with the digests), ``live`` (what is read from the live
model and optimizer), ``checks`` (against the live objects), ``files`` (names, listing, temporary
files), ``save`` and ``restore``.
"""

from amp_tui.training.checkpoint.codec import FORMAT, FORMAT_VERSION
from amp_tui.training.checkpoint.errors import CheckpointError
from amp_tui.training.checkpoint.files import (
    CheckpointInfo,
    checkpoint_files,
    checkpoint_path,
    cleanup_temporary_files,
    list_checkpoints,
)
from amp_tui.training.checkpoint.restore import WEIGHTS_NOTICE, LoadedCheckpoint, read_checkpoint
from amp_tui.training.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "WEIGHTS_NOTICE",
    "checkpoint_files",
    "checkpoint_path",
    "cleanup_temporary_files",
    "list_checkpoints",
    "read_checkpoint",
    "save_checkpoint",
]
