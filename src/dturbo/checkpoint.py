"""Atomic checkpoints of a server state: one safetensors file (no pickle) with the counters in its metadata.

A checkpoint is written to a temporary file in the same folder, fsynced, and renamed over the old one
(then the folder is fsynced), so a crash at any moment leaves either the old or the new checkpoint, whole.
"""

from __future__ import annotations

import copy
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
    """``data`` into ``path`` atomically: a temporary file beside it (made afresh, never through a symbolic link),
    fsynced, renamed over it. A failed write (a full disk) removes the temporary file and raises OSError; ``path``
    keeps its old content."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()  # a stale one (a crash) or a planted link: never written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
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


# [experiment] keys a resumed run may change: how long it runs, how often it is evaluated, its name, its threads and
# device.
RESUMABLE_CHANGES = ("rounds", "eval_every", "threads", "name", "device")


def config_fingerprint(config: dict[str, Any]) -> str:
    """Hash of the parts of a config that define the experiment (not how long it runs, how often it is
    evaluated, or on which device), so a run may be resumed with more rounds or on a GPU, but not with another
    model or data."""
    data = json.loads(json.dumps(config))
    exp = data.get("experiment", {})
    for key in RESUMABLE_CHANGES:
        exp.pop(key, None)
    _drop_later_defaults(data)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


DATA_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def data_fingerprint(dataset: Any) -> dict[str, str]:
    """Each array of ``dataset`` (as loaded and normalised) as ``"dtype [shape] sha256"``: what a resumed run must
    train and test on again."""
    out = {}
    for name in DATA_ARRAYS:
        a = np.ascontiguousarray(getattr(dataset, name))
        out[name] = f"{a.dtype} {list(a.shape)} {hashlib.sha256(a.data).hexdigest()[:16]}"
    return out


def data_changes(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between two :func:`data_fingerprint`, in words (empty: the same data)."""
    out = []
    for name in DATA_ARRAYS:
        a, b = saved.get(name, "?"), now.get(name, "?")
        if a != b:
            form_a, form_b = a.rpartition(" ")[0], b.rpartition(" ")[0]  # "dtype [shape]" without the hash
            out.append(f"{name}: the same dtype and shape, other values" if form_a == form_b
                       else f"{name}: {form_a} -> {form_b}")
    return out


# Keys of a method's section that came after the first checkpoints, with the value a run written before them ran
# with (the sections belong to their methods, which this floor does not import; tests/test_hostile_files.py holds
# them to the sections' values).
# A section is dotted where it lies inside another ("dturbo.sparsity").
LATER_METHOD_KEYS: dict[tuple[str, str], Any] = {("dturbo", "sampling"): "local", ("dturbo", "global_model"): "cut",
                                                 ("dturbo", "dead_units"): "kept",
                                                 ("dturbo.sparsity", "cost_power"): 1.0,
                                                 ("dturbo.transmission", "down_share"): 0.1,
                                                 ("dturbo.transmission", "biases"): "float16",
                                                 ("dturbo.transmission", "down_rounding"): "stochastic"}


def _section(tree: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    """The (sub)section ``dotted`` of a config tree, None where the tree lacks it."""
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def with_earlier_values(tree: dict[str, Any]) -> dict[str, Any]:
    """A run's config.toml as read (``tree``), each later key it lacks (:data:`LATER_METHOD_KEYS`) set to the value
    the run ran with, in the sections it has."""
    out = copy.deepcopy(tree)
    for (section, key), value in LATER_METHOD_KEYS.items():
        if (part := _section(out, section)) is not None:
            part.setdefault(key, value)
    return out


def continued(folder: Path, fingerprint: str, fresh: dict[str, Any]) -> tuple[dict[str, np.ndarray], int, float] | None:
    """(state, rounds done, cumulative bits) of the checkpoint in ``folder``, checked against the configuration's
    ``fingerprint`` and a fresh state of the model (:func:`check_state`); None when ``folder`` holds none;
    CheckpointError naming the problem (nothing is modified)."""
    if not (folder / STATE_FILE).exists():
        return None
    state, counters = load_checkpoint(folder)
    counters = run_counters(folder / STATE_FILE, counters)
    if counters["fingerprint"] != fingerprint:
        raise CheckpointError(f"checkpoint in {folder} belongs to another configuration; it was left untouched")
    check_state(state, fresh, folder)
    return state, int(counters["rounds_done"]), float(counters["cum_bits"])


def _drop_later_defaults(data: dict[str, Any]) -> None:
    """Leave out the keys that came after the first checkpoints while they hold the values runs written before them
    ran with (the plain mean, no attackers, the cosine screen against the median, no floor on update norms,
    :data:`LATER_METHOD_KEYS`), so that such a run still resumes."""
    from .config import FaultsConfig, RobustConfig

    if data.get("robust") == RobustConfig().model_dump(mode="json", exclude_none=True):
        data.pop("robust")
    later = {("faults", "attackers"): FaultsConfig().attackers, ("faults", "attack"): FaultsConfig().attack,
             ("robust", "cosine_to"): RobustConfig().cosine_to, ("robust", "refuse_short"): RobustConfig().refuse_short,
             ("robust", "refuse_close"): RobustConfig().refuse_close,
             **LATER_METHOD_KEYS}
    for (section, key), default in later.items():
        if (part := _section(data, section)) is not None and part.get(key, default) == default:
            part.pop(key, None)


def save_checkpoint(folder: Path, state: dict[str, Any], counters: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in state.items()}
    for k, v in arrays.items():
        if v.dtype.kind == "f" and not np.all(np.isfinite(v)):
            raise CheckpointError(f"refusing to save a checkpoint with non-finite values in {k!r}")
    data = save(arrays, metadata={"counters": json.dumps(counters), CHECKSUM_KEY: _PLACEHOLDER})
    # The checksum covers the whole file, header (names, dtypes, shapes, counters) and tensor bytes, as written with
    # a same-length placeholder where the checksum goes; then the placeholder is patched, so the file is serialised
    # once.
    start = _data_start(data)
    if data[:start].count(_PLACEHOLDER.encode()) != 1:  # cannot happen: names and counters hold no '?' run
        raise CheckpointError("internal error: checksum placeholder not found once in the checkpoint header")
    digest = hashlib.sha256(data).hexdigest()
    atomic_write_bytes(folder / STATE_FILE, data[:start].replace(_PLACEHOLDER.encode(), digest.encode()) + data[start:])


CHECKSUM_KEY = "sha256_file"  # metadata key: sha256 (hex) of the whole file with this value as the placeholder
TENSORS_CHECKSUM_KEY = "sha256"  # of older checkpoints: sha256 (hex) of the tensor bytes only
_PLACEHOLDER = "?" * 64


class CheckpointWarning(UserWarning):
    """A checkpoint loads but cannot be verified whole (written by an older dturbo)."""


def _data_start(data: bytes) -> int:
    """Offset of the tensor bytes in a safetensors file: 8-byte little-endian header length, then the header."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: too short for a safetensors file")
    start = 8 + int.from_bytes(data[:8], "little")
    if start > len(data):
        raise ValueError(f"its header claims {start - 8} bytes, the file has {len(data) - 8}")
    return start


def _verify(path: Path, data: bytes, start: int, meta: dict[str, Any], unverified: bool) -> None:
    """Check the checksum saved in a checkpoint's header; CheckpointError when the file does not match it, or when
    it carries no checksum of the whole file and ``unverified`` is false."""
    again = ("Restore the run folder from a backup, or start the run again into a fresh --out")
    expected = meta.get(CHECKSUM_KEY)
    if isinstance(expected, str):
        header = data[:start]
        if len(expected) != 64 or header.count(expected.encode()) != 1:
            raise CheckpointError(f"checkpoint {path} is corrupted: its checksum field is malformed; it was left "
                                  f"untouched. {again}")
        if hashlib.sha256(header.replace(expected.encode(), _PLACEHOLDER.encode()) + data[start:]).hexdigest() \
                != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: it does not match the sha256 checksum saved with it (its tensors, "
                f"or its header: names, dtypes, shapes, counters; a disk or copy error, or an edit); it was left "
                f"untouched. {again}")
        return
    old = meta.get(TENSORS_CHECKSUM_KEY)
    if not unverified:
        what = "a checksum of its tensors only" if old is not None else "no checksum"
        raise CheckpointError(
            f"checkpoint {path} has {what}, not one of the whole file (an older dturbo wrote it, or the key was "
            f"deleted): it cannot be verified, and was left untouched. If you wrote it and trust it, resume with "
            f"`dturbo run ... --resume-unverified` (Python: resume='unverified'); the next checkpoint carries a "
            f"checksum of the whole file")
    if old is None:
        warnings.warn(f"checkpoint {path} has no checksum (written by an older dturbo): it cannot be verified; "
                      f"the next checkpoint will carry one", CheckpointWarning, stacklevel=3)
    elif hashlib.sha256(data[start:]).hexdigest() != old:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: its tensor bytes do not match the sha256 checksum saved with them "
            f"(a disk or copy error); it was left untouched. {again}")
    else:
        warnings.warn(f"checkpoint {path} was written by an older dturbo: its checksum covers its tensors, not its "
                      f"header (names, counters); the next checkpoint covers both", CheckpointWarning, stacklevel=3)


def run_counters(path: Path, counters: Any) -> dict[str, Any]:
    """A run's checkpoint counters (rounds_done, cum_bits, fingerprint), checked; CheckpointError naming them."""
    ok = (isinstance(counters, dict) and isinstance(counters.get("rounds_done"), int)
          and not isinstance(counters["rounds_done"], bool) and counters["rounds_done"] >= 0
          and isinstance(counters.get("cum_bits"), int | float) and counters["cum_bits"] >= 0
          and isinstance(counters.get("fingerprint"), str))
    if not ok:
        raise CheckpointError(f"checkpoint {path} is corrupt: its counters {counters!r} are not rounds_done >= 0, "
                              f"cum_bits >= 0 and a fingerprint; it was left untouched")
    return counters


def check_state(state: dict[str, Any], fresh: dict[str, Any], folder: Path) -> None:
    """CheckpointError unless the checkpointed ``state`` holds the arrays of ``fresh`` (a new run's initial state on
    the same model): the same keys, each of the same dtype and shape."""
    if set(state) != set(fresh):
        raise CheckpointError(f"checkpoint in {folder} does not match the model; left untouched")
    odd = [k for k, v in fresh.items() if np.shape(state[k]) != np.shape(v)
           or np.asarray(state[k]).dtype != np.asarray(v).dtype]
    if odd:
        k = odd[0]
        raise CheckpointError(
            f"checkpoint in {folder} does not match the model: {k!r} is {np.asarray(state[k]).dtype} "
            f"{np.shape(state[k])}, the model's is {np.asarray(fresh[k]).dtype} {np.shape(fresh[k])}; left untouched")


def load_checkpoint(folder: Path, *, unverified: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state, counters) of the checkpoint in ``folder``; :class:`CheckpointError` if it is missing, unreadable
    or corrupted (it does not match the checksum saved with it: its tensors, or its header's names, dtypes, shapes
    and counters), or carries no checksum of the whole file; ``unverified``: such a checkpoint of an older dturbo
    loads, with a :class:`CheckpointWarning`. Nothing is ever modified."""
    path = folder / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; run without --resume to start a new run")
    try:
        data = path.read_bytes()
        start = _data_start(data)
        meta = json.loads(data[8:start]).get("__metadata__") or {}
        _verify(path, data, start, meta, unverified)
        state = load(data)
        counters = json.loads(meta["counters"])
    except (SafetensorError, OSError, KeyError, ValueError, AttributeError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({err}); it was left untouched") from None
    if not isinstance(counters, dict):
        raise CheckpointError(f"checkpoint {path} is corrupt: its counters are not a mapping; it was left untouched")
    return state, counters
