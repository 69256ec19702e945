"""The algorithm registry: ``experiment.algorithm`` -> (server class, client class).

Every pair is written against the protocol of :mod:`dturbo.algorithms.base`; the runner (:mod:`dturbo.sim`) and the
Flower apps look the configured name up here. A new method adds its pair here and its name to the ``algorithm``
choices of :class:`dturbo.config.ExperimentConfig`.
"""

from __future__ import annotations

from .dssm import DssmClient, DssmServer
from .dturbo import DturboClient, DturboServer
from .fedavg import FedAvgClient, FedAvgServer
from .fedpaq import FedPaqClient, FedPaqServer
from .fedpm import FedPmClient, FedPmServer
from .stc import StcClient, StcServer

__all__ = ["ALGORITHMS"]

ALGORITHMS: dict[str, tuple[type, type]] = {  # (ServerAlgorithm, ClientAlgorithm) of algorithms/base
    "dturbo": (DturboServer, DturboClient),
    "fedavg": (FedAvgServer, FedAvgClient),
    "fedpaq": (FedPaqServer, FedPaqClient),
    "dssm": (DssmServer, DssmClient),
    "fedpm": (FedPmServer, FedPmClient),
    "stc": (StcServer, StcClient),
}
