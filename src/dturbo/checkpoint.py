"""Atomic checkpoints of a server state: one safetensors file (no pickle) with the counters in its metadata.

A checkpoint is written to a temporary file in the same folder, fsynced, and renamed over the old one
(then the folder is fsynced), so a crash at any moment leaves either the old or the new checkpoint, whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save

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


def config_fingerprint(config: dict[str, Any]) -> str:
    """Hash of the parts of a config that define the experiment (not how long it runs or how often it
    is evaluated), so a run may be resumed with more rounds but not with another model or data."""
    data = json.loads(json.dumps(config))
    exp = data.get("experiment", {})
    for key in ("rounds", "eval_every", "threads", "name"):
        exp.pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def save_checkpoint(folder: Path, state: dict[str, Any], counters: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in state.items()}
    for k, v in arrays.items():
        if v.dtype.kind == "f" and not np.all(np.isfinite(v)):
            raise CheckpointError(f"refusing to save a checkpoint with non-finite values in {k!r}")
    atomic_write_bytes(folder / STATE_FILE, save(arrays, metadata={"counters": json.dumps(counters)}))


def load_checkpoint(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    path = folder / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; run without --resume to start a new run")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        state = load_file(str(path))
        counters = json.loads(meta["counters"])
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({err}); it was left untouched") from None
    return state, counters
