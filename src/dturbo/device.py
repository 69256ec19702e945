"""Where clients train and the global model is evaluated: ``experiment.device`` -> a torch device.

Only the neural network moves (local training, E6, and evaluation); the server's closed forms (E3-E5) and
Module B's message passing are numpy on the CPU whatever the device. ``cpu`` (the default) moves nothing,
so a CPU run is bit-identical to one made before the key existed.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError

CPU = torch.device("cpu")


def resolve_device(name: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when torch sees a GPU, else cpu) as a torch device.

    Raises:
        ConfigError: ``"cuda"`` on a machine where torch sees no GPU, or an unknown name.
    """
    if name == "cpu":
        return CPU
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else CPU
    if name == "cuda":
        if not torch.cuda.is_available():
            build = (f"this torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else
                     f"this torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU")
            raise ConfigError(f"experiment.device = 'cuda' but {build}; set experiment.device = 'cpu', or 'auto' "
                              f"to use a GPU only where there is one")
        return torch.device("cuda")
    raise ConfigError(f"experiment.device must be 'cpu', 'cuda' or 'auto', got {name!r}")


def machine(device: torch.device = CPU) -> dict[str, Any]:
    """What a run's numbers depend on besides its config and seed: the versions that compute them, the CPU's model
    and the vector instructions torch's kernels use on it (``cpu_capability``: AVX2, AVX512, ...; two CPUs that
    differ there round differently, so the same run trains to other numbers), and the GPU a ``cuda`` run uses."""
    from ._version import __version__

    out: dict[str, Any] = {"dturbo": __version__, "python": platform.python_version(), "torch": torch.__version__,
                           "numpy": np.__version__, "platform": sys.platform, "cpu": _cpu_model(),
                           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
