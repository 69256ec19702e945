"""One round of federated training, as every runner runs it: the simulator (:class:`dturbo.sim.Simulator`, over any
transport: in process, Flower's SuperNodes, injected faults) and the Flower Strategy in a user's own app
(:class:`dturbo.flower.strategy.DturboStrategy`) call :func:`fit_round`, so that what a round accepts, aggregates and
books is the same code whoever carries the messages.

A round: the server selects its clients and writes their downlinks; they travel (the runner's ``send``); each
selected client's reply is sorted (an upload, or why there is none: :class:`Attempt`); the ledger books the
downlinks sent and every upload, an upload longer than the server's size bound as the bound's bytes, unread
(:class:`dturbo.ledger.Traffic`); the server decodes each upload, checks it against its sender, the round and the
sender's partition (:mod:`dturbo.algorithms.bounds`) and aggregates the valid ones. With fewer than
``federation.min_clients`` valid uploads the round runs again (``on_too_few = "retry"``, at most ``max_retries``
times) or stops: :class:`TooFewClientsError`. A state that cannot be sent, or holds NaN or Inf, is never continued
from: :class:`PoisonedStateError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .algorithms.base import ClientError, MessageError, RoundResult, ServerAlgorithm, State
from .codec import CodecError
from .config import FederationConfig
from .faults import Corrupted
from .ledger import Traffic
from .transport import ClientLate, ClientLost, Downlinks, Reply

COUNTS = ("clients_failed", "clients_dropped", "clients_late", "clients_corrupted")


@dataclass
class Attempt:
    """What one attempt at a round gathered: the uplinks to aggregate, who sent each, the client counts and the
    events (one line each in events.log)."""

    participants: int
    uplinks: list[bytes] = field(default_factory=list)
    senders: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    events: list[str] = field(default_factory=list)

    def take(self, cid: int, reply: Reply) -> None:
        """Sort one client's reply: an uplink to aggregate, or a count and an event saying why not."""
        if isinstance(reply, ClientLost):
            self.counts["clients_dropped"] += 1
            self.events.append(f"client {cid}: did not answer ({reply})")
        elif isinstance(reply, ClientLate):
            self.counts["clients_late"] += 1
            self.events.append(f"client {cid}: answered after the deadline ({reply}), ignored")
        elif isinstance(reply, ClientError):
            self.counts["clients_failed"] += 1
            self.events.append(f"client {cid}: {reply}")
        else:
            if isinstance(reply, Corrupted):
                self.counts["clients_corrupted"] += 1
            self.uplinks.append(reply)
            self.senders.append(cid)


@dataclass
class Round:
    """A completed round: the server's result, the bits of every attempt, the attempt that completed it, how many
    attempts before it were run again, and the events of all of them."""

    result: RoundResult
    traffic: Traffic
    attempt: Attempt
    retries: int
    events: list[str]


@dataclass
class Sent:
    """An attempt whose messages a runner has already exchanged (Flower's loop sends a Strategy's first attempt):
    the selected clients' downlinks, the ones that left (bytes booked) and the replies that came back."""

    downlinks: Downlinks
    sent: list[bytes]
    replies: Mapping[int, Reply]


# How a runner carries an attempt's downlinks: (the bytes that left, each client's reply).
Send = Callable[[Downlinks], tuple[list[bytes], Mapping[int, Reply]]]


class TooFewClientsError(RuntimeError):
    """A round could not gather ``federation.min_clients`` valid client updates. ``events`` says why, one line per
    client and attempt; ``attempts``: how many ran."""

    def __init__(self, message: str, events: list[str] | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.events = events or []
        self.attempts = attempts


class PoisonedStateError(RuntimeError):
    """The server state took a NaN or Inf, or a value its downlink cannot carry; the run stops before it can be
    checkpointed."""


def fit_round(server: ServerAlgorithm, state: State, rnd: int, fed: FederationConfig, send: Send,
              first: Sent | None = None) -> Round:
    """Round ``rnd`` (0-based) from ``state``: select, send (``send``; ``first``: the first attempt, already
    exchanged), accept, book and aggregate, again while fewer than ``fed.min_clients`` uploads are valid
    (module docstring). Raises TooFewClientsError (nothing of the round is kept) or PoisonedStateError."""
    traffic = Traffic(server.layouts, server.max_uplink_bytes)
    events: list[str] = []
    for retries in range(fed.max_retries + 1):
        if first is not None and retries == 0:
            selected, sent, replies = first.downlinks, first.sent, first.replies
        else:
            selected = downlinks(server, state, rnd)
            sent, replies = send(selected)
        attempt = Attempt(len(selected))
        for cid in selected:  # the order the server sums in: the selection's
            attempt.take(cid, replies.get(cid, ClientLost("no reply")))
        events += attempt.events
        traffic.add(sent, attempt.uplinks)
        try:
            result = server.aggregate(state, attempt.uplinks, rnd, attempt.senders)
        except MessageError as err:  # not a single valid update
            result, valid, why = None, 0, f": {err}"
        else:
            valid, why = int(result.metrics["clients_ok"]), ""
            for rejection in result.rejected:  # which upload: its position among the senders'
                events.append(f"client {attempt.senders[rejection.uplink]}: upload rejected: {rejection.reason}")
                why = f"; the last refusal: {rejection.reason}"
        if result is not None and valid >= fed.min_clients:
            check_finite(result.state, rnd + 1)
            return Round(result, traffic, attempt, retries, events)
        events.append(f"attempt {retries + 1}: {valid} valid client updates, fewer than federation.min_clients = "
                      f"{fed.min_clients}{why}")
        if fed.on_too_few == "stop":
            break
    raise TooFewClientsError(f"round {rnd + 1}: fewer than federation.min_clients = {fed.min_clients} valid client "
                             f"updates after {retries + 1} attempt(s)", events, retries + 1)


def downlinks(server: ServerAlgorithm, state: State, rnd: int) -> dict[int, bytes]:
    """The selected clients' downlinks of an attempt at round ``rnd``; PoisonedStateError when the state cannot be
    sent."""
    participants = server.select_clients(rnd)
    try:
        return server.downlinks(state, rnd, participants)
    except CodecError as err:
        raise PoisonedStateError(
            f"round {rnd + 1}: the server state of round {rnd} cannot be sent ({err}); its checkpoint cannot "
            f"be continued with --resume: start again into a fresh --out") from None



def check_finite(state: dict[str, Any], round_no: int) -> None:
    """Refuse to go on (and to checkpoint) with a NaN / Inf anywhere in the server state."""
    bad = [k for k, v in state.items() if np.asarray(v).dtype.kind == "f" and not np.all(np.isfinite(v))]
    if bad:
        kept = f"round {round_no - 1}'s is intact" if round_no > 1 else "no round was saved yet"
        raise PoisonedStateError(f"round {round_no}: the server state holds NaN/Inf in {', '.join(bad[:5])}; "
                                 f"stopping before the checkpoint is written ({kept})")
