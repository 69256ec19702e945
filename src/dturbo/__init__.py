"""dturbo: Bayesian federated model compression with D-Turbo-VBI (see docs/algorithm.md).

The library's entry points (docs/api.md): :func:`load_config` and :class:`Config` (the whole configuration), and
:class:`Experiment`, whose ``run()`` returns an :class:`ExperimentResult`; :func:`bayesianize` (any
``torch.nn.Module`` as a D-Turbo-VBI model). They pull in torch, so they are imported on first use
(``import dturbo`` stays light for the command line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .config import ConfigError

if TYPE_CHECKING:
    from .config import Config
    from .experiment import Experiment, ExperimentResult
    from .nn.convert import bayesianize
    from .settings import load_config

__all__ = ["Config", "ConfigError", "Experiment", "ExperimentResult", "bayesianize", "load_config"]


def __getattr__(name: str) -> Any:
    if name == "Config":  # the class of the methods registered now (dturbo.algorithms.registry.config_class)
        from .algorithms.registry import config_class

        return config_class()
    if name == "load_config":
        from .settings import load_config

        return load_config
    if name in ("Experiment", "ExperimentResult"):
        from . import experiment

        return getattr(experiment, name)
    if name == "bayesianize":
        from .nn.convert import bayesianize

        return bayesianize
    raise AttributeError(f"module 'dturbo' has no attribute {name!r}")
