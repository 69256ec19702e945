"""Supports a client holds between rounds, on both sides, so that a downlink can send a support as the positions that
flipped since the one the client holds, or not at all when it holds it already (docs/communication.md, "Positions").

Server side (:class:`HeldSupports`): per client, the round of the last downlink the server knows the client decoded
(its upload of that round was valid) and that downlink's supports, packed 8 to a byte, as arrays of the server state
(``held_round``, ``held.<layer>``), so that a resumed run codes the same differences. A client selected in a round
without a valid upload (dropped, late, failed, refused) may or may not have decoded the downlink: the server then
assumes it holds nothing and sends its next support whole.

Client side (:class:`ClientSupports`): per client id (one client object serves every id in process), the supports of
the last two downlinks it decoded, by round: the server codes against the last round it knows the client decoded,
and a round run again (a retry, or a resumed run whose client decoded the round before the stop) must still find that
one after the client decoded the round's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import State

NO_BASE = -1  # no support known: the downlink carries it whole


def packed_size(grid: tuple[int, int]) -> int:
    """Bytes of a grid's support packed 8 to a byte."""
    return -(-int(np.prod(grid)) // 8)


def pack(mask: np.ndarray) -> np.ndarray:
    """A support (boolean grid) as bits packed 8 to a byte, row-major."""
    return np.packbits(np.asarray(mask, dtype=bool).reshape(-1))


def unpack(packed: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Inverse of :func:`pack`."""
    return np.unpackbits(packed, count=int(np.prod(grid))).astype(bool).reshape(grid)


class HeldSupports:
    """The server's record of the support each client holds (module docstring), over layers ``names`` of ``grids``."""

    def __init__(self, names: Sequence[str], grids: Sequence[tuple[int, int]], clients: int) -> None:
        self.names, self.grids, self.clients = list(names), list(grids), int(clients)

    def init(self) -> State:
        state: State = {"held_round": np.full(self.clients, NO_BASE, dtype=np.int64)}
        for name, grid in zip(self.names, self.grids, strict=True):
            state[f"held.{name}"] = np.zeros((self.clients, packed_size(grid)), dtype=np.uint8)
        return state

    def base(self, state: State, client: int) -> int:
        """The round whose support ``client`` holds (``NO_BASE``: none known)."""
        return int(state["held_round"][client])

    def supports(self, state: State, client: int) -> list[np.ndarray] | None:
        """The supports ``client`` holds, one per layer (None: none known)."""
        if self.base(state, client) == NO_BASE:
            return None
        return [unpack(state[f"held.{n}"][client], g) for n, g in zip(self.names, self.grids, strict=True)]

    def after_round(self, state: State, round_idx: int, selected: Sequence[int], confirmed: Sequence[int],
                    supports: Sequence[np.ndarray]) -> State:
        """The entries after a round whose downlinks carried ``supports``: the ``confirmed`` clients (selected,
        with a valid upload) hold them; the other ``selected`` ones nothing known; the rest what they held."""
        sel = np.zeros(self.clients, dtype=bool)
        sel[[c for c in selected if 0 <= c < self.clients]] = True
        ok = np.zeros(self.clients, dtype=bool)
        ok[[c for c in confirmed if 0 <= c < self.clients]] = True
        ok &= sel
        rounds = state["held_round"].copy()
        rounds[sel] = NO_BASE
        rounds[ok] = round_idx
        out: State = {"held_round": rounds}
        for name, mask in zip(self.names, supports, strict=True):
            held = state[f"held.{name}"].copy()
            held[sel] = 0
            held[ok] = pack(mask)
            out[f"held.{name}"] = held
        return out


class ClientSupports:
    """The supports each client id holds, by round (module docstring), over layers ``names`` of ``grids``."""

    def __init__(self, names: Sequence[str], grids: Sequence[tuple[int, int]]) -> None:
        self.names, self.grids = list(names), list(grids)
        self.held: dict[int, dict[int, list[np.ndarray]]] = {}

    def get(self, client: int, round_idx: int) -> list[np.ndarray] | None:
        return self.held.get(client, {}).get(round_idx)

    def keep(self, client: int, round_idx: int, supports: list[np.ndarray]) -> None:
        """Hold the supports just decoded, and of the others only the newest."""
        mine = self.held.get(client, {})
        older = [r for r in mine if r != round_idx]
        self.held[client] = ({max(older): mine[max(older)]} if older else {}) | {round_idx: supports}

    def export_state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for cid, mine in sorted(self.held.items()):
            rounds = sorted(mine)
            out[f"support_rounds/{cid}"] = np.array(rounds, dtype=np.int64)
            for slot, r in enumerate(rounds):
                for name, support in zip(self.names, mine[r], strict=True):
                    out[f"{name}.support{slot}/{cid}"] = pack(support)
        return out

    def import_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`export_state`; ValueError when the arrays do not fit the layers."""
        self.held = {}
        try:
            for key, rounds in arrays.items():
                if not key.startswith("support_rounds/"):
                    continue
                cid = int(key.split("/", 1)[1])
                mine = {}
                for slot, r in enumerate(np.asarray(rounds, dtype=np.int64).reshape(-1).tolist()):
                    supports = []
                    for name, grid in zip(self.names, self.grids, strict=True):
                        packed = np.asarray(arrays[f"{name}.support{slot}/{cid}"], dtype=np.uint8)
                        if packed.shape != (packed_size(grid),):
                            raise ValueError(f"the support of {name} held by client {cid} has {packed.size} bytes, "
                                             f"the model's grid needs {packed_size(grid)}")
                        supports.append(unpack(packed, grid))
                    mine[r] = supports
                self.held[cid] = mine
        except (KeyError, TypeError) as err:
            raise ValueError(f"checkpointed client supports are incomplete ({err})") from None
