"""The exported model's files: ``model.json`` (the ops, shapes and statistics) and ``model.safetensors`` (the
tensors), no pickle; their versions, how they are written and read back, and the errors that name what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save as save_tensors

from ..checkpoint import atomic_write_bytes, read_safetensors

FORMAT = "dturbo-export"
# 2: conv2d ops may carry a ``bias_map``; 3: ``input_norm`` (the dataset's input normalisation, or null).
# Older files are read as well (they take normalised inputs only). The built-in models are written as 3.
# 4: any model, as a graph of ops (:mod:`dturbo.export.graph`, written by ``export_model``).
VERSION = 3
GRAPH_VERSION = 4
READS_VERSIONS = (1, 2, 3, GRAPH_VERSION)
WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "model.json"


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



def read_spec(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not model_dir.is_dir():
        raise ExportError(f"exported model directory {model_dir} does not exist")
    spec_path = model_dir / SPEC_FILE
    if not spec_path.is_file():
        raise ExportError(f"{model_dir} holds no exported model: {SPEC_FILE} is missing")
    try:
        spec = json.loads(spec_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"{spec_path} is corrupt (not JSON): {err}") from None
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise ExportError(f"{spec_path} is not a dturbo export (format {FORMAT!r} expected)")
    if spec.get("version") not in READS_VERSIONS:
        raise ExportError(f"{spec_path} has format version {spec.get('version')!r}; this dturbo reads "
                          f"{', '.join(map(str, READS_VERSIONS))}")
    for key in ("ops", "input_shape", "num_classes"):
        if key not in spec:
            raise ExportError(f"{spec_path} lacks the key {key!r}")
    if spec.get("input_norm") is not None:  # version 3; older files have none (normalised inputs only)
        if not isinstance(spec["input_shape"], list) or not spec["input_shape"]:
            raise ExportError(f"{spec_path}: input_shape must be a non-empty list")
        spec["input_norm"] = check_input_norm(spec["input_norm"], tuple(spec["input_shape"]), str(spec_path))
    tensors, _ = read_safetensors(model_dir / WEIGHTS_FILE, what="the exported weights file", error=ExportError)
    return spec, tensors



def stored_tensor(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    t = tensors.get(key)
    if t is None:
        raise ExportError(f"the exported weights file has no tensor {key!r}")
    if shape is not None and tuple(t.shape) != shape:
        raise ExportError(f"tensor {key!r} has shape {tuple(t.shape)}, {SPEC_FILE} says {shape}")
    return t
