"""The server half every algorithm shares, in the shape of Flower's ``Strategy``: select the clients, then
decode -> reject -> weights on the uploads of a round. An algorithm implements :meth:`ServerBase.decode_uplink`
(one upload's bytes -> its typed record, or a reason) and its own aggregation over :meth:`ServerBase.receive`'s
:class:`Received`; a variant overrides :meth:`ServerBase.select_clients` or ``weighting``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from ..config import Config
from .base import Rejection, State, client_weights, decode_uplinks, sample_uniform
from .plain import PlainState


@dataclass
class Upload:
    """What every upload carries: n_t (checked against the round's meta) and the state outside the Bayesian
    layers (:mod:`~dturbo.algorithms.plain`), float64 by field name."""

    n_t: int
    plain: dict[str, np.ndarray]


U = TypeVar("U", bound=Upload)


@dataclass
class Received(Generic[U]):
    """A round's uploads after decoding: the valid records in order, a :class:`Rejection` per refused one, and
    p_t, the weight of each valid one (:func:`~dturbo.algorithms.base.client_weights`)."""

    uploads: list[U]
    rejected: list[Rejection]
    p: np.ndarray

    def counts(self) -> dict[str, float]:
        return {"clients_ok": float(len(self.uploads)), "clients_rejected": float(len(self.rejected))}


class ServerBase(Generic[U]):
    """Shared mechanics of a server: ``cfg``, ``total_samples`` (n) and ``plain`` are set by the subclass."""

    cfg: Config
    total_samples: int
    plain: PlainState
    weighting = "samples"  # p_t by n_t ("samples") or a plain mean ("uniform")

    def select_clients(self, round_idx: int) -> list[int]:
        """``federation.clients_per_round`` of the clients uniformly, a pure function of (seed, round)."""
        f = self.cfg.federation
        return sample_uniform(self.cfg.experiment.seed, round_idx, f.clients, f.clients_per_round)

    def downlink(self, state: State, round_idx: int) -> bytes:
        """The round's broadcast: the message every client is sent."""
        raise NotImplementedError

    def downlinks(self, state: State, round_idx: int, clients: list[int]) -> dict[int, bytes]:
        """Each selected client's downlink: by default the broadcast, one bytes object for all of them."""
        return dict.fromkeys(clients, self.downlink(state, round_idx))

    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None) -> U:
        """One upload as its record; raises MessageError / CodecError with the reason it is refused."""
        raise NotImplementedError

    def receive(self, state: State, uplinks: list[bytes], round_idx: int) -> Received[U]:
        """Every upload through :meth:`decode_uplink`; the refused ones become rejections (none valid: the round
        fails with MessageError), the valid ones get their weights p_t."""
        valid, rejected = decode_uplinks(uplinks, lambda data: self.decode_uplink(state, data, round_idx))
        return Received(valid, rejected, client_weights([u.n_t for u in valid], self.weighting))

    def aggregate_plain(self, state: State, got: Received[U]) -> State:
        """``state`` with the n_t-weighted mean of the uploads' plain state (whatever ``weighting`` is)."""
        return dict(state) | self.plain.aggregate([u.n_t for u in got.uploads], [u.plain for u in got.uploads])
