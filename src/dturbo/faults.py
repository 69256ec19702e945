"""Injected faults (``[faults]``, docs/robustness.md): a transport wrapper that drops, delays or corrupts replies,
and rewrites the uploads of hostile clients (:mod:`dturbo.attacks`).

Which client suffers which fault is a pure function of (seed, round, attempt), so a resumed run injects exactly the
same faults as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .algorithms.statistics import is_request
from .attacks import ATTACKS, RoundView, hostile_clients
from .codec import decode_message, encode_message
from .config import Config
from .transport import ClientLate, ClientLost, Downlinks, Reply, Transport

CORRUPTIONS = ("truncate", "garbage", "header_flip", "oversize", "wrong_kind")


class Corrupted(bytes):
    """Upload bytes the injection corrupted. Still bytes: they cross the wire and reach the server like any
    others; the type only lets the runner count them (``clients_corrupted``)."""


def injects(cfg: Config) -> bool:
    """Whether ``[faults]`` injects anything (a straggler only matters with a deadline)."""
    f = cfg.faults
    return bool(f.drop_prob or f.corrupt_prob or (f.deadline is not None and f.straggler_sigma) or f.attackers)


def draw_faults(cfg: Config, rnd: int, attempt: int, participants: list[int]) -> dict[int, str]:
    """Injected faults of one round attempt (``[faults]``), a pure function of (seed, round, attempt): client id
    -> "drop" | "late" | "corrupt:<how>"; clients without a fault are absent."""
    f = cfg.faults
    if not (f.drop_prob or f.corrupt_prob or (f.deadline is not None and f.straggler_sigma)):
        return {}
    rng = np.random.default_rng([cfg.experiment.seed, rnd, attempt, 0xFA17])
    n = len(participants)
    u_drop, u_corrupt, how = rng.random(n), rng.random(n), rng.integers(0, len(CORRUPTIONS), n)
    slowdown = np.exp(f.straggler_sigma * rng.standard_normal(n))
    out = {}
    for i, cid in enumerate(participants):
        if u_drop[i] < f.drop_prob:
            out[cid] = "drop"
        elif f.deadline is not None and slowdown[i] > f.deadline:
            out[cid] = "late"
        elif u_corrupt[i] < f.corrupt_prob:
            out[cid] = f"corrupt:{CORRUPTIONS[how[i]]}"
    return out


def corrupt(data: bytes, how: str, rnd: int, cid: int) -> bytes:
    """A hostile or broken client's bytes, derived from a valid upload (seeded by round and client)."""
    rng = np.random.default_rng([rnd, cid, 0xBAD])
    if how == "truncate":
        return data[: int(rng.integers(0, len(data)))]
    if how == "garbage":
        return rng.integers(0, 256, len(data), dtype=np.uint8).tobytes()
    if how == "header_flip":
        buf = bytearray(data)
        buf[int(rng.integers(0, min(4, len(buf))))] ^= 1 << int(rng.integers(0, 8))  # magic, version, kind
        return bytes(buf)
    if how == "oversize":
        return data + bytes(4 * len(data))
    if how == "wrong_kind":
        kind, fields = decode_message(data)
        return encode_message("evil/" + kind, fields)
    raise ValueError(f"unknown corruption {how!r}")


class FaultyTransport:
    """``inner`` with the faults of ``[faults]``: a dropped client is never sent the round (ClientLost), a
    straggler's upload arrives after the deadline (ClientLate), a corrupted one arrives as :class:`Corrupted`
    bytes, a hostile client's upload arrives rewritten by its attack (``server``: the run's server algorithm, whose
    messages the attacker reads and writes). A client whose own reply is already an error keeps it. Replies come in
    the order: the dropped clients, then ``inner``'s replies in its order."""

    def __init__(self, inner: Transport, cfg: Config, server: Any = None) -> None:
        self.inner = inner
        self.cfg = cfg
        self.server = server
        self.hostile = set(hostile_clients(cfg)) if server is not None else set()
        self.attack = ATTACKS[cfg.faults.attack]()
        self._attempts: dict[int, int] = {}  # round -> attempts so far: a call for the same round is a retry

    def __call__(self, downlinks: Downlinks, round_idx: int) -> dict[int, Reply]:
        if downlinks and all(is_request(down) for down in downlinks.values()):
            return self._calibration(downlinks, round_idx)
        attempt = self._attempts[round_idx] = self._attempts.get(round_idx, -1) + 1
        faults = draw_faults(self.cfg, round_idx, attempt, list(downlinks))
        replies: dict[int, Reply] = {cid: ClientLost("injected drop") for cid in downlinks if faults.get(cid) == "drop"}
        sent = {cid: down for cid, down in downlinks.items() if cid not in replies}
        for cid, reply in self.inner(sent, round_idx).items():
            fault = faults.get(cid)
            if isinstance(reply, bytes) and fault == "late":
                reply = ClientLate("injected straggler")
            elif isinstance(reply, bytes) and fault is not None:  # "corrupt:<how>"
                reply = Corrupted(corrupt(reply, fault.split(":", 1)[1], round_idx, cid))
            replies[cid] = reply
        honest = {c: r for c, r in replies.items() if isinstance(r, bytes) and c not in self.hostile}
        hostile = [c for c in sorted(self.hostile & set(replies))
                   if isinstance(replies[c], bytes) and not isinstance(replies[c], Corrupted)]
        for cid in hostile:
            ctx = RoundView(self.server, self.cfg, round_idx, cid, downlinks[cid], honest, len(hostile))
            replies[cid] = self.attack.rewrite(replies[cid], ctx)
        return replies

    def _calibration(self, requests: Downlinks, round_idx: int) -> dict[int, Reply]:
        """BatchNorm calibration (:mod:`dturbo.algorithms.statistics`): no drop, corruption or delay is injected
        (the round's faults are the training messages'), and a hostile client answers as its attack does."""
        replies = dict(self.inner(requests, round_idx))
        for cid in self.hostile & set(replies):
            reply = replies[cid]
            if isinstance(reply, bytes):
                replies[cid] = self.attack.statistics(reply)
        return replies


def with_faults(transport: Transport, cfg: Config, server: Any = None) -> Transport:
    """``transport`` wrapped in :class:`FaultyTransport` when ``[faults]`` injects anything, else itself;
    ``server``: the run's server algorithm (hostile clients need it to rewrite their uploads)."""
    return FaultyTransport(transport, cfg, server) if injects(cfg) else transport
