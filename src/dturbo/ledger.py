"""The bit ledger of a round (docs/algorithm.md §9): 8 x the bytes of the messages really exchanged, each selected
client's own downlink and every uplink once, by direction and part (headers, positions, values).

An uplink is sized from its framing, after the server's size bound: one longer than the bound is refused unread
(:meth:`dturbo.algorithms.message.MessageSpec.open`) and booked as the bound's bytes, all headers (the server reads no
further); one within it is split into parts reading only headers, in memory bounded whatever its headers claim
(:func:`dturbo.codec.payload_bits`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .codec import decode_message, payload_bits
from .protocol import MessageError

LEDGER_PARTS = ("headers", "positions", "values")


def message_bits(data: bytes, layouts: dict[str, dict[str, str]]) -> dict[str, int]:
    """Bits of one framed message by part (docs/algorithm.md §9): ``headers`` (framing, field names, types, shapes,
    counters), ``positions`` and ``values``; they sum to ``8 * len(data)``. ``layouts`` maps the message kind
    and each field's name suffix (``dense1.mu`` -> ``mu``) to the encoder that made the payload."""
    kind, fields = decode_message(data)
    table = layouts.get(kind)
    if table is None:
        raise MessageError(f"no ledger layout for message kind {kind!r}")
    out = dict.fromkeys(LEDGER_PARTS, 0)
    out["headers"] = 8 * (len(data) - sum(len(p) for _, p in fields))  # framing
    for name, payload in fields:
        suffix = name.rsplit(".", 1)[-1]
        if suffix not in table:
            raise MessageError(f"no ledger layout for field {name!r} of {kind!r}")
        for part, bits in payload_bits(payload, table[suffix]).items():
            out[part] += bits
    return out


# metrics.csv's ledger columns: up and down apart, each split into headers, positions and values.
LEDGER_COLUMNS = [f"{d}_{part}_bits" for d in ("up", "down") for part in LEDGER_PARTS]
STATISTICS_LAYOUT = {"statistics": {"mean": "dense", "var": "dense"}}  # a calibration reply's fields


@dataclass
class Traffic:
    """The bits of one round, summed over its attempts (a retried attempt's bits count: they were sent)."""

    layouts: dict[str, dict[str, str]]  # the server's message layouts (ServerAlgorithm.layouts)
    max_uplink_bytes: int | None = None  # the server's size bound of an upload (None: none)
    up_bits: int = 0
    down_bits: int = 0
    calibration_bits: int = 0  # of up_bits + down_bits: BatchNorm calibration's (add_calibration)
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEDGER_COLUMNS, 0))

    def add(self, downlinks: list[bytes], uplinks: list[bytes]) -> None:
        """One attempt: ``downlinks`` sent (one per selected client: a broadcast is the same bytes object for each),
        ``uplinks`` received. An uplink that does not even frame counts as headers: the server rejects it, its
        bytes still crossed the wire."""
        split: dict[int, dict[str, int]] = {}  # a broadcast is split into parts once, not once per client
        for data in downlinks:
            if id(data) not in split:
                split[id(data)] = message_bits(data, self.layouts)
            self.down_bits += self._book("down", split[id(data)])
        for data in uplinks:
            self.up_bits += self._book("up", _received(data, self.layouts, self.max_uplink_bytes))

    def add_calibration(self, requests: list[tuple[bytes, bytes]], replies: list[bytes], bound: int | None = None
                        ) -> None:
        """A BatchNorm calibration (:mod:`dturbo.algorithms.statistics`): each request as (the ``calibrate``
        message, the downlink it frames), booked as that downlink plus its frame in headers; each reply by part,
        one longer than ``bound`` bytes as the bound's bytes."""
        split: dict[int, dict[str, int]] = {}
        for wrapped, inner in requests:
            if id(wrapped) not in split:
                split[id(wrapped)] = message_bits(inner, self.layouts)
                split[id(wrapped)]["headers"] += 8 * (len(wrapped) - len(inner))
            bits = self._book("down", split[id(wrapped)])
            self.down_bits += bits
            self.calibration_bits += bits
        for data in replies:
            bits = self._book("up", _received(data, STATISTICS_LAYOUT, bound))
            self.up_bits += bits
            self.calibration_bits += bits

    def _book(self, direction: str, parts: dict[str, int]) -> int:
        """One message's bits into the ``direction`` columns by part; its total."""
        for part, bits in parts.items():
            self.parts[f"{direction}_{part}_bits"] += bits
        return sum(parts.values())


def _received(data: bytes, layouts: dict[str, dict[str, str]], bound: int | None = None) -> dict[str, int]:
    """A received message's bits by part: one longer than ``bound`` is refused unread and booked as the bound's
    bytes, all headers; one that does not frame is all headers."""
    if bound is not None and len(data) > bound:
        return {"headers": 8 * bound}
    try:
        return message_bits(data, layouts)
    except ValueError:
        return {"headers": 8 * len(data)}
