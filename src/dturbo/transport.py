"""How a round's messages reach the clients: the :class:`Transport` seam of the runner, and the in-process one.

A transport takes each selected client's downlink bytes (client id -> bytes, in the order the clients are served:
the same bytes object for all of them when the method broadcasts, its own for each with D-Turbo-VBI's
``positions = "delta"``) and the round, and returns, per client, its upload bytes or why it has none (a
:class:`~dturbo.algorithms.base.ClientError`). The runner
(:class:`dturbo.sim.Simulator`) drives every transport the same way, so every transport makes the same run
directory: :class:`InProcessClients` here, Flower's SuperNodes (:class:`dturbo.flower.server_app.FlowerTransport`),
and wrappers such as injected faults (:class:`dturbo.faults.FaultyTransport`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .algorithms.base import ClientAlgorithm, ClientData, ClientError, MessageError
from .algorithms.statistics import answer
from .codec import CodecError

# What a transport returns for one client: its upload, or why it has none.
Reply = bytes | ClientError


class ClientLost(ClientError):
    """A client did not answer at all (its node went away, a timeout): no upload, no reason from it."""


class ClientLate(ClientError):
    """A client answered after the round's deadline: its upload is ignored."""


# What a transport is given: each selected client's downlink, in the order of the clients.
Downlinks = Mapping[int, bytes]


class Transport(Protocol):
    def __call__(self, downlinks: Downlinks, round_idx: int) -> dict[int, Reply]:
        """Send each client its downlink and return each one's reply. A call with the same ``round_idx`` again is
        a retry of that round (``federation.on_too_few = "retry"``)."""
        ...


class InProcessClients:
    """The clients as objects in this process: one client algorithm fitted on each client's data in turn (in the
    order of ``downlinks``: the aggregation sums in this order)."""

    def __init__(self, client: ClientAlgorithm, data: list[ClientData]) -> None:
        self.client = client
        self.data = data

    def __call__(self, downlinks: Downlinks, round_idx: int) -> dict[int, Reply]:
        replies: dict[int, Reply] = {}
        for cid, downlink in downlinks.items():
            try:
                replies[cid] = answer(self.client, downlink, self.data[cid], cid)
            except ClientError as err:  # its own failure (e.g. diverged): a reason, not a crash
                replies[cid] = err
            except (MessageError, CodecError) as err:  # a downlink it cannot read, or trained values its upload cannot
                # carry: it fails the round, the run goes on
                replies[cid] = ClientError(f"cannot read its downlink or encode its upload: {err}")
        return replies
