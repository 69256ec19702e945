"""The exported model's files: ``model.json`` (the ops, shapes and statistics) and ``model.safetensors`` (the
tensors), no pickle; their versions, how they are written and read back, and the errors that name what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_tensors

from ..checkpoint import atomic_write_bytes

FORMAT = "dturbo-export"
# 2: conv2d ops may carry a ``bias_map``; 3: ``input_norm`` (the dataset's input normalisation, or null).
# Older files are read as well (they take normalised inputs only). The built-in models are written as 3.
# 4: any model, as a graph of ops (:mod:`dturbo.export.graph`, written by ``export_model``).
VERSION = 3
GRAPH_VERSION = 4
READS_VERSIONS = (1, 2, 3, GRAPH_VERSION)
WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "model.json"
MAX_SPEC_BYTES = 16 << 20  # a model.json longer than this is refused unread (an export's is a few kB)
MAX_DEPTH = 32  # the deepest nesting of lists and objects in model.json


class ExportError(ValueError):
    """A run directory or an exported model cannot be read or has a layout export does not know."""


def check_input_norm(norm: Any, input_shape: tuple[int, ...], where: str) -> dict[str, Any]:
    """``norm`` as :attr:`dturbo.data.Dataset.input_norm` describes it, for inputs of ``input_shape``."""
    n = int(input_shape[0])
    ok = (isinstance(norm, dict) and isinstance(norm.get("scale"), int | float) and norm["scale"] > 0
          and all(isinstance(norm.get(k), list) and len(norm[k]) == n
                  and all(isinstance(v, int | float) for v in norm[k]) for k in ("mean", "std"))
          and all(v > 0 for v in norm["std"]))
    if not ok:
        raise ExportError(f"{where}: input_norm must be {{scale > 0, mean: [{n} numbers], std: [{n} numbers > 0]}} "
                          f"for inputs of shape {list(input_shape)}, got {norm!r}")
    return {"raw_dtype": str(norm.get("raw_dtype", "")), "scale": float(norm["scale"]),
            "mean": [float(v) for v in norm["mean"]], "std": [float(v) for v in norm["std"]]}



class Writable(Protocol):
    """What :func:`save` writes: an export in memory (:class:`dturbo.export.ops.Exported`,
    :class:`dturbo.export.graph.ExportedGraph`)."""

    def spec(self) -> dict[str, Any]: ...

    def tensors(self) -> dict[str, torch.Tensor]: ...


def save(exported: Writable, out_dir: str | Path) -> Path:
    """Write ``model.safetensors`` and ``model.json`` into ``out_dir`` (created; each file atomically): one writer
    for both formats."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} names a file; --out must be a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / WEIGHTS_FILE, save_tensors(exported.tensors(), metadata={"format": FORMAT}))
    atomic_write_bytes(out / SPEC_FILE, (json.dumps(exported.spec(), indent=1) + "\n").encode())
    return out



def _inside(model_dir: Path, path: Path) -> Path:
    """``path``, refused (ExportError) when it is a symbolic link that leads out of ``model_dir``."""
    if path.is_symlink() and not path.resolve().is_relative_to(model_dir.resolve()):
        raise ExportError(f"{path} is a symbolic link out of {model_dir}: refused (an export's files are its own)")
    return path


def _depth(value: Any) -> int:
    """The nesting depth of a JSON value (iterative: no recursion on hostile input)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d <= MAX_DEPTH:
                todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def read_spec(model_dir: Path) -> tuple[dict[str, Any], StoredTensors]:
    """(model.json, the weights file's tensors) of an exported model; ExportError for anything that is not what
    export writes. Nothing is allocated beyond model.json before its sizes are checked: the tensors are read one at
    a time when the network is built (:class:`StoredTensors`)."""
    if not model_dir.is_dir():
        raise ExportError(f"exported model directory {model_dir} does not exist")
    spec_path = _inside(model_dir, model_dir / SPEC_FILE)
    if not spec_path.is_file():
        raise ExportError(f"{model_dir} holds no exported model: {SPEC_FILE} is missing")
    size = spec_path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise ExportError(f"{spec_path} has {size} bytes, more than the {MAX_SPEC_BYTES} an export's model.json may "
                          f"have")
    try:
        spec = json.loads(spec_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"{spec_path} is corrupt (not JSON): {err}") from None
    except RecursionError:
        raise ExportError(f"{spec_path} nests lists or objects too deeply (an export's nest {MAX_DEPTH} deep at "
                          f"most)") from None
    if _depth(spec) > MAX_DEPTH:
        raise ExportError(f"{spec_path} nests lists or objects more than {MAX_DEPTH} deep")
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise ExportError(f"{spec_path} is not a dturbo export (format {FORMAT!r} expected)")
    if spec.get("version") not in READS_VERSIONS:
        raise ExportError(f"{spec_path} has format version {spec.get('version')!r}; this dturbo reads "
                          f"{', '.join(map(str, READS_VERSIONS))}")
    for key in ("ops", "input_shape", "num_classes"):
        if key not in spec:
            raise ExportError(f"{spec_path} lacks the key {key!r}")
    shape = spec["input_shape"]
    if not (isinstance(shape, list) and 1 <= len(shape) <= 4
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)):
        raise ExportError(f"{spec_path}: input_shape must be a list of 1 to 4 positive integers, got {shape!r}")
    if spec.get("input_norm") is not None:  # version 3; older files have none (normalised inputs only)
        spec["input_norm"] = check_input_norm(spec["input_norm"], tuple(shape), str(spec_path))
    return spec, StoredTensors(_inside(model_dir, model_dir / WEIGHTS_FILE))


class StoredTensors(Mapping[str, torch.Tensor]):
    """The tensors of an export's weights file, by name: their shapes known at once (from the file's header), each
    read only when asked for (so a tensor the model does not use is never read) and checked: float32 after reading,
    finite (ExportError otherwise)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise ExportError(f"the exported weights file {path} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                self._shapes = {k: tuple(int(d) for d in f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise ExportError(f"the exported weights file {path} is corrupt or not a safetensors file: {err}") from None

    def shape_of(self, key: str) -> tuple[int, ...] | None:
        return self._shapes.get(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._shapes:
            raise KeyError(key)
        try:
            with safe_open(str(self.path), framework="pt") as f:
                t = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise ExportError(f"tensor {key!r} of {self.path} cannot be read: {err}") from None
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ExportError(f"tensor {key!r} of {self.path} holds NaN or Inf")
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def stored_tensor(tensors: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    """Tensor ``key`` of the weights, of ``shape`` (None: any), its shape checked before it is read."""
    known = tensors.shape_of(key) if isinstance(tensors, StoredTensors) else None
    if key not in tensors:
        raise ExportError(f"the exported weights file has no tensor {key!r}")
    if known is not None and shape is not None and known != tuple(shape):
        raise ExportError(f"tensor {key!r} has shape {known}, {SPEC_FILE} says {tuple(shape)}")
    t = tensors[key]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ExportError(f"tensor {key!r} has shape {tuple(t.shape)}, {SPEC_FILE} says {tuple(shape)}")
    return t
