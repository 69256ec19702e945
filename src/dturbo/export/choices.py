"""The kernel and setting choices :func:`dturbo.export.load` times, kept beside the model for the next load.

Timing the candidate kernels of every layer takes about as long as a few hundred forward passes; the fastest ones
depend on the machine, its threads, the batch size and the model, and on nothing else. A load that times them
writes what it chose to ``choices.json`` in the model's folder under a key naming all of those; a later load with
the same key applies them without timing. A folder that cannot be written, or a file that is unreadable, names
layers the model does not have, or kernels dturbo does not know, only means timing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..kernels import CONV_KERNELS, KERNELS, POOL_KERNELS

FILE = "choices.json"
MAX_BYTES = 1 << 20  # a larger file is not one load() wrote


@dataclass
class Choices:
    """What a timed load chose: per linear, convolution and max-pooling layer its kernel, the memory format, and
    the convolutions fused with the layers after them."""

    linears: dict[str, str] = field(default_factory=dict)
    convs: dict[str, str] = field(default_factory=dict)
    pools: dict[str, str] = field(default_factory=dict)
    channels_last: bool = False
    fused: dict[str, list[str]] = field(default_factory=dict)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def key(spec: dict[str, Any], tensors: dict[str, torch.Tensor], batch_size: int) -> str:
    """The circumstances the choices hold for: this machine (processor, cores, torch and its threads), the batch
    size, and the model (its spec, and each tensor's shape and nonzeros, which the sparse kernels' speed follows)."""
    from .._version import __version__

    model = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name]
        model.update(f"{name}:{list(t.shape)}:{int(torch.count_nonzero(t))};".encode())
    return "|".join([_cpu_name(), f"{os.cpu_count()} cores", f"torch {torch.__version__}",
                     f"{torch.get_num_threads()} threads", f"batch {batch_size}", f"dturbo {__version__}",
                     model.hexdigest()[:16]])


def read(model_dir: Path, at: str) -> Choices | None:
    """The choices stored under key ``at``, or None (none stored, or a file that is not what :func:`write`
    writes)."""
    path = model_dir / FILE
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_BYTES:
            return None
        entry = json.loads(path.read_text()).get(at)
        c = Choices(dict(entry["linears"]), dict(entry["convs"]), dict(entry["pools"]), bool(entry["channels_last"]),
                    {str(k): [str(x) for x in v] for k, v in entry["fused"].items()})
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    known = (set(c.linears.values()) <= set(KERNELS) and set(c.convs.values()) <= set(CONV_KERNELS)
             and set(c.pools.values()) <= {*POOL_KERNELS, "fused"})
    return c if known else None


def write(model_dir: Path, at: str, c: Choices) -> None:
    """Store ``c`` under key ``at`` (other keys kept); a folder that cannot be written is left as it is."""
    path = model_dir / FILE
    try:
        stored = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else {}
        if not isinstance(stored, dict):
            stored = {}
    except (OSError, ValueError, RecursionError):
        stored = {}
    stored[at] = {"linears": c.linears, "convs": c.convs, "pools": c.pools, "channels_last": c.channels_last,
                  "fused": c.fused}
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(stored, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def fits(c: Choices, net: nn.Module, linears: list[str]) -> bool:
    """Whether ``c`` names exactly this network's layers (of the right kinds)."""
    children = dict(net.named_children())
    fused_ok = all(isinstance(children.get(n), nn.Conv2d) and all(x in children for x in layers)
                   for n, layers in c.fused.items())
    return (set(c.linears) == set(linears) and fused_ok
            and all(isinstance(children.get(n), nn.Conv2d) for n in c.convs)
            and all(isinstance(children.get(n), nn.MaxPool2d) for n in c.pools if c.pools[n] != "fused"))
