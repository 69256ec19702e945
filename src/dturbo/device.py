"""Where clients train and the global model is evaluated: ``experiment.device`` -> a torch device.

Only the neural network moves (local training, E6, and evaluation); the server's closed forms (E3-E5) and
Module B's message passing are numpy on the CPU whatever the device. ``cpu`` (the default) moves nothing,
so a CPU run is bit-identical to one made before the key existed.
"""

from __future__ import annotations

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
