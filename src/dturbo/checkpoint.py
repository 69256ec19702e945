"""Atomic checkpoints of a server state: one safetensors file (no pickle) with the counters in its metadata.

A checkpoint is written to a temporary file in the same folder, fsynced, and renamed over the old one
(then the folder is fsynced), so a crash at any moment leaves either the old or the new checkpoint, whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load, save

if TYPE_CHECKING:
    import torch

STATE_FILE = "state.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or belongs to another experiment."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_safetensors(path: Path, *, what: str, error: type[Exception]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; a missing, unreadable or corrupt one raises ``error`` naming
    ``what`` it is and its path (a run's model file, an export's weights)."""
    if not path.is_file():
        raise error(f"{what} {path} is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise error(f"{what} {path} is corrupt or not a safetensors file: {err}") from None
    return tensors, meta


def config_fingerprint(config: dict[str, Any]) -> str:
    """Hash of the parts of a config that define the experiment (not how long it runs, how often it is
    evaluated, or on which device), so a run may be resumed with more rounds or on a GPU, but not with another
    model or data."""
    data = json.loads(json.dumps(config))
    exp = data.get("experiment", {})
    for key in ("rounds", "eval_every", "threads", "name", "device"):
        exp.pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def save_checkpoint(folder: Path, state: dict[str, Any], counters: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in state.items()}
    for k, v in arrays.items():
        if v.dtype.kind == "f" and not np.all(np.isfinite(v)):
            raise CheckpointError(f"refusing to save a checkpoint with non-finite values in {k!r}")
    data = save(arrays, metadata={"counters": json.dumps(counters), CHECKSUM_KEY: _PLACEHOLDER})
    # The checksum covers the tensor bytes (everything after the header, which holds the checksum itself):
    # written as a same-length placeholder, then patched, so the file is serialised once.
    start = _data_start(data)
    digest = hashlib.sha256(data[start:]).hexdigest()
    header = data[:start]
    if header.count(_PLACEHOLDER.encode()) != 1:  # cannot happen: names and counters hold no '?' run
        raise CheckpointError("internal error: checksum placeholder not found once in the checkpoint header")
    atomic_write_bytes(folder / STATE_FILE, header.replace(_PLACEHOLDER.encode(), digest.encode()) + data[start:])


CHECKSUM_KEY = "sha256"  # metadata key: sha256 (hex) of the tensor bytes
_PLACEHOLDER = "?" * 64


class CheckpointWarning(UserWarning):
    """A checkpoint loads but cannot be verified (written before checkpoints carried a checksum)."""


def _data_start(data: bytes) -> int:
    """Offset of the tensor bytes in a safetensors file: 8-byte little-endian header length, then the header."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: too short for a safetensors file")
    return 8 + int.from_bytes(data[:8], "little")


def load_checkpoint(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state, counters) of the checkpoint in ``folder``; :class:`CheckpointError` if it is missing, unreadable
    or corrupted (its tensor bytes do not match the checksum saved with them). Nothing is ever modified."""
    path = folder / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; run without --resume to start a new run")
    try:
        data = path.read_bytes()
        start = _data_start(data)
        meta = json.loads(data[8:start]).get("__metadata__") or {}
        state = load(data)
        counters = json.loads(meta["counters"])
    except (SafetensorError, OSError, KeyError, ValueError, AttributeError) as err:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({err}); it was left untouched") from None
    expected = meta.get(CHECKSUM_KEY)
    if expected is None:
        warnings.warn(f"checkpoint {path} has no checksum (written by an older dturbo): it cannot be verified; "
                      f"the next checkpoint will carry one", CheckpointWarning, stacklevel=2)
    elif hashlib.sha256(data[start:]).hexdigest() != expected:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: its tensor bytes do not match the sha256 checksum saved with them "
            f"(a disk or copy error); it was left untouched. Restore the run folder from a backup, or start the "
            f"run again into a fresh --out"
        )
    return state, counters
