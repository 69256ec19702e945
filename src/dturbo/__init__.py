"""dturbo: Bayesian federated model compression with D-Turbo-VBI (see docs/algorithm.md).

The library's entry points (docs/api.md): :func:`load_config` and :class:`Config`, and
:class:`Experiment`, whose ``run()`` returns an :class:`ExperimentResult`; :func:`bayesianize` (any
``torch.nn.Module`` as a D-Turbo-VBI model). They pull in torch, so they are imported on first use
(``import dturbo`` stays light for the command line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from .experiment import Experiment, ExperimentResult
    from .nn.convert import bayesianize

__version__ = "0.2.0"
__all__ = ["Config", "ConfigError", "Experiment", "ExperimentResult", "bayesianize", "load_config"]


def __getattr__(name: str) -> Any:
    if name in ("Experiment", "ExperimentResult"):
        from . import experiment

        return getattr(experiment, name)
    if name == "bayesianize":
        from .nn.convert import bayesianize

        return bayesianize
    raise AttributeError(f"module 'dturbo' has no attribute {name!r}")
