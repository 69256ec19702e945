"""The registry of federated methods: ``experiment.algorithm`` -> :class:`~dturbo.protocol.AlgorithmSpec`, the one
list of methods the runners, the config and the command line read; the full configuration class composed from the
sections every run reads and each method's (:func:`config_class`); and how a configuration becomes a method's two
halves on its model.

Every method is written against :mod:`dturbo.protocol`; the runner (:mod:`dturbo.sim`) and the Flower apps build
theirs with :func:`build_algorithm`. A new method is a module defining its halves, its config section and its
``AlgorithmSpec``, and one :func:`register` call: its section then appears in :func:`config_class`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
from pydantic import Field, create_model, model_validator
from torch import nn

from ..config import AFTER_DEFAULT_METHOD, CORE_SECTIONS, Config, ConfigError, ExperimentConfig, Section
from ..data import Dataset
from ..nn import models
from ..protocol import AlgorithmSpec, ClientAlgorithm, ModelFactory, ServerAlgorithm

__all__ = ["ALGORITHMS", "AlgorithmSpec", "ModelFactory", "build_algorithm", "config_class", "model_factory",
           "model_options", "register", "unregister"]

# The registered methods by name, in registration order (the order of their config sections).
ALGORITHMS: dict[str, AlgorithmSpec] = {}
# The method of a config that names none (``experiment.algorithm``'s default).
DEFAULT_ALGORITHM = ExperimentConfig.model_fields["algorithm"].default


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add a method: ``experiment.algorithm = spec.name`` runs it, and ``[spec.name]`` (its section) joins the
    config. A name taken by a method or by a section every run reads is refused (ValueError)."""
    if spec.name in ALGORITHMS or spec.name in CORE_SECTIONS:
        raise ValueError(f"algorithm {spec.name!r}: the name is taken (a registered method or a config section)")
    ALGORITHMS[spec.name] = spec
    config_class.cache_clear()
    return spec


def unregister(name: str) -> AlgorithmSpec:
    """Remove a registered method and its config section; returns its spec (KeyError: none of that name)."""
    if name not in ALGORITHMS:
        raise KeyError(f"no registered algorithm {name!r}")
    spec = ALGORITHMS.pop(name)
    config_class.cache_clear()
    return spec


class _MethodsConfig(Config):
    @model_validator(mode="after")
    def _algorithm_lr(self) -> _MethodsConfig:
        # Filled, not derived on use: config.json then records the rate a run trained with.
        train, experiment = self.train, self.experiment
        if train.lr is None:
            train.lr = ALGORITHMS[experiment.algorithm].default_lr
        return self


@functools.cache
def config_class() -> type[Config]:
    """The whole configuration (:class:`dturbo.Config`): the sections every run reads
    (:data:`dturbo.config.CORE_SECTIONS`), the default method's section after ``[train]`` and the other registered
    methods' after those, in registration order; ``experiment.algorithm`` one of the registered methods. Composed
    once per set of registered methods: every class it returns subclasses :class:`dturbo.config.Config`."""
    default = ExperimentConfig.model_fields["algorithm"]
    experiment = create_model(
        "ExperimentConfig", __base__=ExperimentConfig, __module__=ExperimentConfig.__module__,
        algorithm=(Literal[tuple(ALGORITHMS)], Field(default.default, description=default.description)))
    fields: dict[str, Any] = {}
    for name, section in {**CORE_SECTIONS, "experiment": experiment}.items():
        fields[name] = _field(section)
        if name == AFTER_DEFAULT_METHOD and DEFAULT_ALGORITHM in ALGORITHMS:
            fields[DEFAULT_ALGORITHM] = _field(ALGORITHMS[DEFAULT_ALGORITHM].section)
    for name, spec in ALGORITHMS.items():
        fields.setdefault(name, _field(spec.section))
    return create_model("Config", __base__=_MethodsConfig, __module__="dturbo", __doc__=(
        "The whole configuration: the sections every run reads and one section per registered method "
        "(dturbo.algorithms.registry.config_class)."), **fields)


def _field(section: type[Section]) -> tuple[type[Section], Any]:
    return section, Field(default_factory=section)


def model_options(cfg: Config) -> dict[str, Any]:
    """The keyword arguments the configured method builds its model with (``AlgorithmSpec.model_options``:
    D-Turbo-VBI's ``sigma_mode`` and ``sigma_init_ratio``), for :func:`dturbo.bayesianize` and the built-in models."""
    return _spec(cfg).model_options(cfg)


def model_factory(cfg: Config, input_shape: Sequence[int], num_classes: int) -> ModelFactory:
    """The seeded factory of the built-in model ``[model]`` names, for samples of ``input_shape`` and
    ``num_classes`` classes: how a run builds its model and how a saved run's model is built again
    (:meth:`dturbo.rundir.RunDir.build_model`). A model of one's own: ``dturbo.Experiment``'s ``model=``,
    :func:`dturbo.nn.convert.user_model_factory`."""
    if cfg.model.name == "custom":
        raise ConfigError("config key 'model.name': 'custom' stands for a model given to dturbo.Experiment(model=...) "
                          "in Python; it cannot be built from the config (dturbo run, Flower): name a built-in model")
    shape = tuple(int(d) for d in input_shape)
    options = model_options(cfg)

    def make() -> nn.Module:
        return models.build_model(cfg.model.name, shape, num_classes, hidden=cfg.model.hidden, width=cfg.model.width,
                                  widths=cfg.model.widths, seed=cfg.experiment.seed, **options)

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
    spec = _spec(cfg)
    # Input size and classes vs model, before anything runs: a clear ModelInputError / ModelOutputError instead of
    # a traceback mid-round. fork_rng: building reseeds torch's global RNG, which the run's own draws must not notice.
    with torch.random.fork_rng(devices=[]):
        models.check_memory(factory, cfg.model.name)  # counted on the meta device, before any allocation
        model = factory()
        name = cfg.model.name if cfg.model.name != "custom" else type(model).__name__
        models.check_input_shape(model, fed.dataset.input_shape, name, fed.dataset.num_classes,
                                 getattr(fed.dataset, "input_dtype", torch.float32))
    server = spec.server(cfg, factory, fed.total_samples)
    clients = getattr(fed, "clients", None)
    if clients is not None:  # the partition sizes: n_t of a valid upload (algorithms.bounds)
        server.partitions = [len(c) for c in clients]
    return server, spec.client(cfg, factory)


def _spec(cfg: Config) -> AlgorithmSpec:
    if cfg.experiment.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {cfg.experiment.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[cfg.experiment.algorithm]


# The built-in methods, in the order of their config sections; each module defines its SPEC.
from . import dssm, dturbo, fedavg, feddst, fedpaq, fedpm, stc  # noqa: E402

for _module in (dturbo, fedavg, fedpaq, dssm, fedpm, stc, feddst):
    register(_module.SPEC)
