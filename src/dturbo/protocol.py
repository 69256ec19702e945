"""The protocol every federated method implements and every runner drives (docs/architecture.md).

A method is a server half (:class:`ServerAlgorithm`), a client half (:class:`ClientAlgorithm`) and an
:class:`AlgorithmSpec` that names them, its config section and its defaults; registering the spec
(:func:`dturbo.algorithms.register`) is all a runner, the config and the command line need to know of it. Every hook
a runner calls is declared here with its default, so a method implements only what it changes. Messages cross the
boundary as encoded bytes (:mod:`dturbo.codec`); a runner counts ``len(message) * 8`` bits, so bit accounting is
what is really sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np
    import torch
    from pydantic import BaseModel
    from torch import nn

    from .config import Config

__all__ = [
    "AlgorithmSpec", "ClientAlgorithm", "ClientData", "ClientError", "MessageError", "ModelFactory", "NO_CLIENT",
    "Rejection", "RoundResult", "ScheduleWarning", "ServerAlgorithm", "State",
]

# A server state is a flat mapping of names to numpy arrays plus scalars, so that it can be
# checkpointed to safetensors without pickle.
State = dict[str, Any]
# The client id under which a node that holds nothing from earlier rounds loads a downlink (ClientAlgorithm.receive).
NO_CLIENT = -1
# A zero-argument function returning the seeded initial model, the same every call: what both halves start from.
ModelFactory = Callable[[], "nn.Module"]


class ScheduleWarning(UserWarning):
    """A method's schedule does not reach its target within the run (a warning: short test runs do it on
    purpose)."""


class ClientError(RuntimeError):
    """A client could not produce a valid update (e.g. its local training diverged)."""


class MessageError(ValueError):
    """A message is malformed or does not fit the model (wrong layer count, length, values)."""


@dataclass
class ClientData:
    """One client's local data, as tensors."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


class Rejection(str):
    """An upload the server refused, as data: ``uplink`` (its position in the list ``aggregate`` was given, which
    the runner maps to the client that sent it) and ``reason``. It reads as the text ``"uplink i: reason"`` (a
    ``str``), so that messages and logs built from it stay plain text."""

    uplink: int
    reason: str

    def __new__(cls, uplink: int, reason: str) -> Rejection:
        self = super().__new__(cls, f"uplink {uplink}: {reason}")
        self.uplink, self.reason = uplink, reason
        return self


@dataclass
class RoundResult:
    """A round's new server state, its metrics (``density`` and ``clients_ok`` at least) and the refused uploads."""

    state: State
    metrics: dict[str, float]
    rejected: list[Rejection] = field(default_factory=list)


class ServerAlgorithm:
    """The server half: built as ``cls(cfg, model_factory, total_samples)``; ``partitions`` (each client's sample
    count) is set by whoever knows the federation (:func:`dturbo.algorithms.build_algorithm`)."""

    # message kind -> field-name suffix -> payload layout (codec.PAYLOAD_LAYOUTS), for the bit ledger
    layouts: dict[str, dict[str, str]]
    # The size bound of an upload: a longer one is refused unread and booked up to it; None: booked as sent.
    max_uplink_bytes: int | None = None
    partitions: list[int] | None = None  # each client's sample count, where the federation is known

    def init(self) -> State:
        """The state of round 0."""
        raise NotImplementedError

    def select_clients(self, round_idx: int) -> list[int]:
        """The clients of round ``round_idx``, a pure function of (seed, round)."""
        raise NotImplementedError

    def downlink(self, state: State, round_idx: int) -> bytes:
        """The round's broadcast: the message every client is sent."""
        raise NotImplementedError

    def downlinks(self, state: State, round_idx: int, clients: list[int]) -> dict[int, bytes]:
        """Each of ``clients``' downlink of the round, in their order: by default the broadcast, one bytes object
        for all of them (a method that codes per client overrides it)."""
        return dict.fromkeys(clients, self.downlink(state, round_idx))

    def evaluation_downlink(self, state: State, round_idx: int) -> bytes:
        """The global model coded so that a node that holds nothing from earlier rounds loads it
        (:meth:`ClientAlgorithm.receive`): a Flower strategy's federated evaluation sends it. By default the
        broadcast; a method whose broadcast builds on what clients hold overrides it."""
        return self.downlink(state, round_idx)

    def negated_payload(self, name: str, payload: bytes, downlink: bytes) -> bytes | None:
        """The payload of upload field ``name`` with its meaning negated, as a sign-flipping attacker writes it
        (:mod:`dturbo.attacks`), for a layout only the method reads (FedPM's range-coded mask, whose coder's model
        is the client's ``downlink``); None: the method has no such field."""
        return None

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int, senders: list[int] | None = None
                  ) -> RoundResult:
        """The round's result from its uploads; ``senders``: the client each upload came from (the one the runner
        asked), checked against the id the upload claims; None: unknown (not checked)."""
        raise NotImplementedError

    def global_model(self, state: State) -> nn.Module:
        """The global model of ``state``, to evaluate and save."""
        raise NotImplementedError

    def support_messages(self, state: State) -> dict[str, np.ndarray] | None:
        """Arrays the run directory keeps of every round (messages/, docs/rundir.md); None: nothing."""
        return None


class ClientAlgorithm:
    """The client half: built as ``cls(cfg, model_factory)``; one object serves every client of a process."""

    # Whether the client keeps private state between rounds (export_state / import_state carry it through a
    # checkpoint and a Flower node's state); a stateless client is never asked for it.
    keeps_state: ClassVar[bool] = False
    cfg: Config
    device: torch.device  # where local work runs
    # The client's working copy of the network (built from the model factory): after fit, the model it trained
    # (a Flower node hands its weights to the user's model); its ``input_shape`` is the samples' shape.
    model: nn.Module

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        """Client ``client_id``'s upload of the round ``downlink`` opens, trained on ``data``."""
        raise NotImplementedError

    def receive(self, downlink: bytes, client_id: int) -> nn.Module:
        """The model ``downlink`` gives client ``client_id``, loaded exactly as :meth:`fit` loads it before training
        and holding nothing from earlier rounds the server did not send (BatchNorm calibration measures it:
        :mod:`dturbo.algorithms.statistics`). A method without it cannot calibrate; its statistics are averaged."""
        raise NotImplementedError(f"{type(self).__name__} cannot load a downlink without training")

    @classmethod
    def can_receive(cls) -> bool:
        """Whether the method implements :meth:`receive`."""
        return cls.receive is not ClientAlgorithm.receive

    def use_server_priors(self, scales: list[float]) -> None:
        """Take the server's scale of each Bayesian layer's prior (its initial weights' s_l, in layer order): a
        client whose model was built apart from the server's (a user's Flower ClientApp) has its own. A method
        without priors ignores them."""

    def export_state(self) -> dict[str, np.ndarray]:
        """The private state to checkpoint, as flat arrays by name; none by default."""
        return {}

    def import_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Take back what :meth:`export_state` gave (ValueError when it does not fit); nothing by default."""


def _no_warnings(cfg: Config, fed: Any) -> list[Warning]:
    return []


def _no_model_options(cfg: Config) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class AlgorithmSpec:
    """A federated method, as the registry knows it.

    ``name``: ``experiment.algorithm``'s value and the name of its config section; ``section``: the pydantic model of
    that section (a ``dturbo.config`` section: unknown keys forbidden); ``server`` / ``client``: the two halves, or
    functions building them with the same arguments; ``default_lr``: ``train.lr`` when unset; ``label``: the name
    figures and reports show; ``describe(section)``: a run's label from the method's config section, with the
    settings that tell its runs apart (none: ``label``). ``run_warnings(cfg, fed)``: the warnings about the
    configuration a run raises before it starts (none by default), given what the run knows of its federation:
    ``total_samples``, and ``clients`` (each client's data) where known; ``model_options(cfg)``: keyword arguments of
    :func:`dturbo.nn.models.build_model` beyond the ``[model]`` section's (the Bayesian layers' sigma; none: the
    model's defaults)."""

    name: str
    section: type[BaseModel]
    server: Callable[..., ServerAlgorithm]
    client: Callable[..., ClientAlgorithm]
    default_lr: float
    label: str = ""
    run_warnings: Callable[[Config, Any], list[Warning]] = _no_warnings
    model_options: Callable[[Config], dict[str, Any]] = _no_model_options
    describe: Callable[[Any], str] | None = None

    def label_of(self, cfg: Config) -> str:
        """The label of a run of this method configured by ``cfg``."""
        return self.describe(getattr(cfg, self.name)) if self.describe else self.label

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.name.islower():
            raise ValueError(f"algorithm name {self.name!r}: a lower-case identifier (it names a config section)")
        if not self.label:
            object.__setattr__(self, "label", self.name)
