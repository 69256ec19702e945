"""The algorithm registry: ``experiment.algorithm`` -> (server class, client class), and how a configuration
becomes the pair on its model.

Every pair is written against the protocol of :mod:`dturbo.algorithms.base`; the runner (:mod:`dturbo.sim`) and the
Flower apps build theirs with :func:`build_algorithm`. A new method adds its pair here and its name to the
``algorithm`` choices of :class:`dturbo.config.ExperimentConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from ..config import Config, ConfigError
from ..data import Dataset
from ..nn import models
from .base import ClientAlgorithm, ServerAlgorithm
from .dssm import DssmClient, DssmServer
from .dturbo import DturboClient, DturboServer
from .fedavg import FedAvgClient, FedAvgServer
from .feddst import FedDstClient, FedDstServer
from .fedpaq import FedPaqClient, FedPaqServer
from .fedpm import FedPmClient, FedPmServer
from .stc import StcClient, StcServer

__all__ = ["ALGORITHMS", "ModelFactory", "build_algorithm", "model_factory"]

ALGORITHMS: dict[str, tuple[type, type]] = {  # (ServerAlgorithm, ClientAlgorithm) of algorithms/base
    "dturbo": (DturboServer, DturboClient),
    "fedavg": (FedAvgServer, FedAvgClient),
    "fedpaq": (FedPaqServer, FedPaqClient),
    "dssm": (DssmServer, DssmClient),
    "fedpm": (FedPmServer, FedPmClient),
    "stc": (StcServer, StcClient),
    "feddst": (FedDstServer, FedDstClient),
}

# A zero-argument function returning the seeded initial model, the same every call: what both halves start from.
ModelFactory = Callable[[], nn.Module]


def model_factory(cfg: Config, input_shape: Sequence[int], num_classes: int) -> ModelFactory:
    """The seeded factory of the built-in model ``[model]`` names, for samples of ``input_shape`` and
    ``num_classes`` classes: how a run builds its model and how a saved run's model is built again
    (:meth:`dturbo.rundir.RunDir.build_model`). A model of one's own: ``dturbo.Experiment``'s ``model=``,
    :func:`dturbo.nn.convert.user_model_factory`."""
    if cfg.model.name == "custom":
        raise ConfigError("config key 'model.name': 'custom' stands for a model given to dturbo.Experiment(model=...) "
                          "in Python; it cannot be built from the config (dturbo run, Flower): name a built-in model")
    shape = tuple(int(d) for d in input_shape)

    def make() -> nn.Module:
        return models.build_model(
            cfg.model.name, shape, num_classes, sigma_mode=cfg.dturbo.sigma_mode,
            sigma_init_ratio=cfg.dturbo.sigma_init_ratio, hidden=cfg.model.hidden, width=cfg.model.width,
            seed=cfg.experiment.seed,
        )

    return make


class Federated(Protocol):
    """What :func:`build_algorithm` reads of a federation (:class:`dturbo.federation.Federation`); its ``clients``
    too where it has them (their sizes are the n_t of valid uploads)."""

    dataset: Dataset

    @property
    def total_samples(self) -> int: ...


def build_algorithm(cfg: Config, fed: Federated, factory: ModelFactory | None = None
                    ) -> tuple[ServerAlgorithm, ClientAlgorithm]:
    """The configured algorithm's server and client halves on the model of ``factory``, by default the built-in
    model of ``[model]`` for the federation's data."""
    if factory is None:
        factory = model_factory(cfg, fed.dataset.input_shape, fed.dataset.num_classes)
    if cfg.experiment.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {cfg.experiment.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    # Input size and classes vs model, before anything runs: a clear ModelInputError / ModelOutputError instead of
    # a traceback mid-round. fork_rng: building reseeds torch's global RNG, which the run's own draws must not notice.
    with torch.random.fork_rng(devices=[]):
        model = factory()
        name = cfg.model.name if cfg.model.name != "custom" else type(model).__name__
        models.check_input_shape(model, fed.dataset.input_shape, name, fed.dataset.num_classes,
                                 getattr(fed.dataset, "input_dtype", torch.float32))
    server_cls, client_cls = ALGORITHMS[cfg.experiment.algorithm]
    server = server_cls(cfg, factory, fed.total_samples)
    clients = getattr(fed, "clients", None)
    if clients is not None:  # the partition sizes: n_t of a valid upload (algorithms.bounds)
        server.partitions = [len(c) for c in clients]
    return server, client_cls(cfg, factory)
