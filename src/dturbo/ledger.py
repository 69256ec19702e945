"""The bit ledger of a round (docs/algorithm.md §9): 8 x the bytes of the messages really exchanged, the downlink
once per receiving client and every uplink once, by direction and part (headers, positions, values)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .algorithms.base import LEDGER_PARTS, message_bits

# metrics.csv's ledger columns: up and down apart, each split into headers, positions and values.
LEDGER_COLUMNS = [f"{d}_{part}_bits" for d in ("up", "down") for part in LEDGER_PARTS]


@dataclass
class Traffic:
    """The bits of one round, summed over its attempts (a retried attempt's bits count: they were sent)."""

    layouts: dict[str, dict[str, str]]  # the server's message layouts (ServerAlgorithm.layouts)
    up_bits: int = 0
    down_bits: int = 0
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEDGER_COLUMNS, 0))

    def add(self, downlink: bytes, receivers: int, uplinks: list[bytes]) -> None:
        """One attempt: ``downlink`` sent to ``receivers`` clients, ``uplinks`` received. An uplink that does not
        even frame counts as headers: the server rejects it, its bytes still crossed the wire."""
        for part, bits in message_bits(downlink, self.layouts).items():
            self.parts[f"down_{part}_bits"] += bits * receivers
        for data in uplinks:
            try:
                parts = message_bits(data, self.layouts)
            except ValueError:
                parts = {"headers": 8 * len(data)}
            for part, bits in parts.items():
                self.parts[f"up_{part}_bits"] += bits
        self.up_bits += 8 * sum(len(u) for u in uplinks)
        self.down_bits += 8 * len(downlink) * receivers
