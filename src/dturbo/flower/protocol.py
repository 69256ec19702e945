"""What crosses Flower between a :class:`~dturbo.flower.strategy.DturboStrategy` and the client helpers of
:mod:`dturbo.flower.client` inside a user's own ClientApp.

The bytes travel as :mod:`dturbo.flower.wire` puts them in an ArrayRecord (one 1-D uint8 Array ``bytes``). A
**train** message (``MessageType.TRAIN``) carries

* ``down``: the client's downlink, coded by the algorithm's server half;
* ``config``: the ConfigRecord that ``Strategy.start`` got as ``train_config``, with ``server-round`` (as every
  Flower strategy sends it; dturbo's local training does not read it);
* ``task``: a ConfigRecord with ``algorithm``, ``round`` (0-based), ``client`` (the dturbo client id the server
  gave this node), ``settings`` (the experiment configuration as TOML, only the keys that differ from the
  library's defaults, so that a fresh ClientApp process builds the same client algorithm) and ``model`` (each
  Bayesian layer's name, grid and initial weight scale s_l: the client's prior needs the server's s_l, and a
  model whose layers differ is refused with both listed).

Its reply carries ``up`` (the upload bytes), ``metrics`` (a MetricRecord with ``num-examples``) and ``task``
(``client``, ``round``); or, when the client algorithm raised :class:`~dturbo.algorithms.base.ClientError`,
``failure`` (``client``, ``round``, ``reason``) and ``metrics``.

An **evaluate** message carries ``down`` (the current global model coded as a downlink that needs no client state:
the downlink of a client holding no support for D-Turbo-VBI and FedDST, the dense model for STC), ``config`` and
``task``; its reply carries ``metrics`` (``eval_loss``, ``eval_acc``, ``num-examples``).

A **query** message of type :data:`QUERY` asks a node how many training samples it holds and which
``partition-id`` its node config names; the reply carries ``metrics`` (``num-examples``) and ``task``
(``partition-id``, -1 when the node config has none).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from ..config import Config
from ..nn.bayes import bayesian_layers
from ..nn.models import layer_scale
from ..nn.shapes import grid_shape
from ..settings import parse_config
from . import wire

QUERY = "query.dturbo"
QUERY_ACTION = "dturbo"
CONFIG, METRICS = "config", "metrics"
NUM_EXAMPLES = "num-examples"


def algorithms() -> tuple[str, ...]:
    """The registered methods the strategy and the client helpers run: those whose client loads a downlink without
    training (:meth:`dturbo.protocol.ClientAlgorithm.receive`), as federated evaluation needs."""
    from ..algorithms.registry import ALGORITHMS

    return tuple(name for name, spec in ALGORITHMS.items() if spec.client.can_receive())


def settings_text(cfg: Config) -> str:
    """``cfg`` as TOML holding only the keys whose values differ from the defaults' (the train messages carry it
    whole every round, so it is kept short); :func:`parse_settings` gives ``cfg`` back."""
    import tomli_w

    return tomli_w.dumps(_diff(cfg.to_dict(), type(cfg)().to_dict()))


def _diff(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        base = defaults.get(key)
        if isinstance(value, dict) and isinstance(base, dict):
            sub = _diff(value, base)
            if sub:
                out[key] = sub
        elif value != base or key not in defaults:
            out[key] = value
    return out


def parse_settings(text: str) -> Config:
    """The configuration of a task's ``settings``."""
    return parse_config(tomllib.loads(text))


@dataclass(frozen=True)
class ModelLayer:
    """A Bayesian layer as the task describes it: name, support grid (K, M) and initial weight scale s_l."""

    name: str
    grid: tuple[int, int]
    scale: float

    def text(self) -> str:
        # repr of a float round-trips exactly: the client's prior must equal the server's bit for bit
        return f"{self.name} {self.grid[0]}x{self.grid[1]} {self.scale!r}"

    @classmethod
    def parse(cls, text: str) -> ModelLayer:
        try:
            name, grid, scale = text.rsplit(" ", 2)
            k, m = grid.split("x")
            return cls(name, (int(k), int(m)), float(scale))
        except ValueError:
            raise wire.WireError(f"malformed model layer {text!r} in the task") from None


def model_layers(model: nn.Module) -> list[ModelLayer]:
    """Every Bayesian layer of ``model`` with its grid and its s_l (:func:`dturbo.nn.models.layer_scale`)."""
    return [ModelLayer(name, grid_shape(layer), layer_scale(layer)) for name, layer in bayesian_layers(model)]


def model_grids(model: nn.Module) -> list[tuple[str, tuple[int, int]]]:
    """Every Bayesian layer of ``model``: its name and support grid."""
    return [(name, grid_shape(layer)) for name, layer in bayesian_layers(model)]


def check_same_model(sent: list[ModelLayer], mine: list[tuple[str, tuple[int, int]]]) -> None:
    """ValueError naming both when the ClientApp's model (:func:`model_grids`) does not have the server's Bayesian
    layers (names and grids; the scales may differ: the client takes the server's)."""
    theirs = [(s.name, s.grid) for s in sent]
    if theirs != mine:
        def show(layers: list[tuple[str, tuple[int, int]]]) -> str:
            return ", ".join(f"{name} {grid[0]}x{grid[1]}" for name, grid in layers) or "none"

        raise ValueError(f"the ClientApp's model does not match the strategy's: its Bayesian layers are "
                         f"[{show(mine)}], the server's [{show(theirs)}] (give both the same architecture, made "
                         f"Bayesian the same way)")


@dataclass
class Task:
    """The ``task`` ConfigRecord of a train or evaluate message, read."""

    algorithm: str
    round_idx: int
    client: int
    settings: str
    layers: list[ModelLayer]

    def record(self) -> ConfigRecord:
        return ConfigRecord({"algorithm": self.algorithm, "round": self.round_idx, "client": self.client,
                             "settings": self.settings, "model": [la.text() for la in self.layers]})


def read_task(content: RecordDict) -> Task:
    """The task of a message from a :class:`~dturbo.flower.strategy.DturboStrategy`; WireError when the message
    has none or a malformed one."""
    record = wire.task_record(content)
    try:
        algorithm = str(record["algorithm"])
        task = Task(algorithm, int(record["round"]), int(record["client"]), str(record["settings"]),
                    [ModelLayer.parse(str(t)) for t in record.get("model", [])])
    except (KeyError, TypeError, ValueError) as err:
        raise wire.WireError(f"malformed task record: {err}") from None
    if algorithm not in (known := algorithms()):
        raise wire.WireError(f"task names algorithm {algorithm!r}; the client helpers run {', '.join(known)}")
    if not all(math.isfinite(la.scale) and la.scale > 0 for la in task.layers):
        raise wire.WireError("task has a layer scale that is not a positive number")
    return task


def message_bytes(content: RecordDict) -> int:
    """The bytes of a Message's content as Flower counts them (``flwr.clientapp.mod.message_size_mod``: the sum of
    every record's ``count_bytes()``)."""
    return int(sum(record.count_bytes() for record in content.values()))


def metric_number(value: Any) -> int | float | None:
    """A metric as a MetricRecord takes it (a Python int or float), None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    return None
