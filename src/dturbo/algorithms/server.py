"""The server half every algorithm shares, in the shape of Flower's ``Strategy``: select the clients, then
decode -> bounds -> reject -> weights on the uploads of a round. An algorithm implements
:meth:`ServerBase.decode_uplink` (one upload's bytes -> its typed record, or a reason), :meth:`ServerBase.bounds`
(what a valid upload of the round may hold, :mod:`~dturbo.algorithms.bounds`) and its own aggregation over
:meth:`ServerBase.receive`'s :class:`Received`, combining the clients' vectors with ``robust``
(:mod:`~dturbo.algorithms.robust`, on :meth:`ServerBase.rows`) unless that is the plain mean; a variant overrides
:meth:`ServerBase.select_clients` or ``weighting``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Generic, TypeVar

import numpy as np

from ..codec import CodecError
from ..config import Config
from ..protocol import ServerAlgorithm
from .base import NO_CLIENT, MessageError, Rejection, State, client_weights, sample_uniform
from .bounds import Limit, UploadBounds
from .plain import PlainState
from .robust import RobustAggregation


@dataclass
class Upload:
    """What every upload carries: n_t and the client id it claims (checked against the round's meta, the sender
    and the bounds) and the state outside the Bayesian layers (:mod:`~dturbo.algorithms.plain`), float64 by field
    name."""

    n_t: int
    plain: dict[str, np.ndarray]
    client_id: int = field(default=NO_CLIENT, kw_only=True)

    def vectors(self) -> dict[str, np.ndarray]:
        """The vectors the round's bounds limit, by name (:class:`~dturbo.algorithms.bounds.UploadBounds`)."""
        return {}

    def losses(self) -> dict[str, float]:
        """The training figures the client reports (its mean NLL first)."""
        nll = getattr(self, "nll", None)
        return {} if nll is None else {"nll": float(nll)}


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


class ServerBase(ServerAlgorithm, Generic[U]):
    """Shared mechanics of a server: ``cfg``, ``total_samples`` (n) and ``plain`` are set by the subclass;
    ``partitions`` (each client's sample count) by whoever knows the federation (:func:`build_algorithm`)."""

    cfg: Config
    total_samples: int
    plain: PlainState
    weighting = "samples"  # p_t by n_t ("samples") or a plain mean ("uniform")
    partitions: Sequence[int] | None = None

    @property
    def max_uplink_bytes(self) -> int:  # type: ignore[override]
        """The size bound of an upload (its messages'): a longer one is refused unread, and booked up to it."""
        return int(self.messages.max_uplink_bytes)  # type: ignore[attr-defined]

    @cached_property
    def robust(self) -> RobustAggregation:
        """``[robust]``: how the clients' vectors are combined."""
        return RobustAggregation(self.cfg.robust)

    def select_clients(self, round_idx: int) -> list[int]:
        """``federation.clients_per_round`` of the clients uniformly, a pure function of (seed, round)."""
        f = self.cfg.federation
        return sample_uniform(self.cfg.experiment.seed, round_idx, f.clients, f.clients_per_round)

    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None) -> U:
        """One upload as its record; raises MessageError / CodecError with the reason it is refused."""
        raise NotImplementedError

    def bounds(self, state: State, round_idx: int) -> UploadBounds:
        """What a valid upload of round ``round_idx`` may hold, from the global ``state``: the algorithm's limits
        (none by default) and the partition sizes."""
        return UploadBounds(partitions=self.partitions)

    def receive(self, state: State, uplinks: list[bytes], round_idx: int, senders: Sequence[int] | None = None
                ) -> Received[U]:
        """Every upload through :meth:`decode_uplink`, then the round's :meth:`bounds` (with ``senders``, the client
        each came from: its claimed id must be the sender's, one upload per client); the refused ones become
        rejections (none valid: the round fails with MessageError), the valid ones get their weights p_t."""
        if senders is not None and len(senders) != len(uplinks):
            raise ValueError(f"{len(senders)} senders for {len(uplinks)} uploads")
        bounds = self.bounds(state, round_idx)
        # the state outside the Bayesian layers passes the same gate: finite, within its tensor's limit
        bounds.limits |= {t.field: Limit(t.limit(state[t.field])) for t in self.plain.tensors}
        valid: list[U] = []
        rejected: list[Rejection] = []
        answered: set[int] = set()
        for i, data in enumerate(uplinks):
            sender = None if senders is None else int(senders[i])
            try:
                up = self.decode_uplink(state, data, round_idx)
            except (MessageError, CodecError) as err:
                rejected.append(Rejection(i, str(err)))
                continue
            why = bounds.refusal(up.vectors() | up.plain, up.losses(), up.n_t, up.client_id, sender)
            if why is None and sender is not None and sender in answered:
                why = f"client {sender} already sent an upload this round"
            if why is not None:
                rejected.append(Rejection(i, why))
                continue
            if sender is not None:
                answered.add(sender)
            valid.append(up)
        if not self.robust.plain and valid:
            positions = [i for i in range(len(uplinks)) if i not in {r.uplink for r in rejected}]
            screened = self.screen(state, valid)
            rejected += [Rejection(positions[k], why) for k, why in screened.items()]
            rejected.sort(key=lambda r: r.uplink)
            valid = [u for k, u in enumerate(valid) if k not in screened]
        if not valid:
            raise MessageError("no valid client update this round: " + "; ".join(rejected))
        return Received(valid, rejected, client_weights([u.n_t for u in valid], self.weighting))

    def screen(self, state: State, uploads: list[U]) -> dict[int, str]:
        """With a robust rule: the uploads (by position in ``uploads``) to refuse next to the round's others, with
        the reason: ``[robust]``'s screens on their :meth:`rows` (:meth:`RobustAggregation.screen`)."""
        return self.robust.screen(*self.rows(state, uploads)) if self.robust.screens else {}

    def rows(self, state: State, uploads: list[U]) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Each upload as the one float vector ``[robust]`` combines, and the global values the vectors move from
        (None: they are updates, from 0)."""
        raise NotImplementedError

    def aggregate_plain(self, state: State, got: Received[U]) -> State:
        """``state`` with the uploads' plain state combined: their n_t-weighted mean (whatever ``weighting`` is), or
        with a robust ``[robust] rule`` the rule :meth:`Rule.for_state` gives (no clipping: its norm is the
        weights')."""
        decoded = [u.plain for u in got.uploads]
        if self.robust.plain or not self.plain:
            return dict(state) | self.plain.aggregate([u.n_t for u in got.uploads], decoded)
        rows = np.stack([self.plain.flatten(d) for d in decoded])
        p = np.asarray([u.n_t for u in got.uploads], dtype=np.float64)
        combined = self.robust.rule.for_state().combine(rows, p / p.sum(), len(got.rejected))
        return dict(state) | self.plain.unflatten(combined)
