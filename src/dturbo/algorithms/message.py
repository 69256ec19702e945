"""A message kind defined once: its fields and how the ledger books each (docs/algorithm.md §9).

A :class:`MessageSpec` names a message kind (``"dturbo/up"``) and maps each field's name suffix (``dense1.mu`` ->
``mu``) to the codec layout that encodes it (``codec.PAYLOAD_LAYOUTS``). The same spec frames the message (it
refuses a field the ledger could not book), opens it (with the size bound) and gives the ledger its table
(:func:`dturbo.ledger.message_bits`), so the three cannot drift apart.

Every upload opens with the same header, read by :meth:`MessageSpec.open_upload`: ``meta`` (round, client id, n_t)
and ``metrics`` (the client's training figures); the algorithm's decoder reads the rest into its typed record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import MessageError, fields_dict, frame, need, unpack_scalars, upload_meta
from .plain import LAYOUT as PLAIN_LAYOUT

Layouts = dict[str, dict[str, str]]


@dataclass(frozen=True)
class MessageSpec:
    """One message kind and the layout of each of its fields (by name suffix); the state outside the Bayesian
    layers (:mod:`~dturbo.algorithms.plain`) is part of every message."""

    kind: str
    fields: dict[str, str]

    @property
    def layouts(self) -> dict[str, str]:
        return self.fields | PLAIN_LAYOUT

    def frame(self, fields: dict[str, bytes]) -> bytes:
        """The framed message; every field must be one this spec books (else the ledger could not count it)."""
        unknown = [name for name in fields if name.rsplit(".", 1)[-1] not in self.layouts]
        if unknown:
            raise ValueError(f"{self.kind}: fields {unknown} are not in the message spec")
        return frame(self.kind, fields)

    def open(self, data: bytes, max_bytes: int | None = None) -> dict[str, bytes]:
        """The fields of a message of this kind (CodecError / MessageError when it does not frame, is another kind,
        exceeds ``max_bytes`` or repeats a field)."""
        return fields_dict(data, self.kind, max_bytes=max_bytes)

    def open_upload(self, data: bytes, round_idx: int | None, total_samples: int, max_bytes: int
                    ) -> tuple[dict[str, bytes], int, int]:
        """An upload's fields, its n_t and the client id it claims, checked from ``meta``
        (:func:`~dturbo.algorithms.base.upload_meta`). The ``metrics`` field is read last by :func:`upload_metrics`,
        after the layers (the order of the reasons)."""
        fields = self.open(data, max_bytes=max_bytes)
        return fields, *upload_meta(fields, round_idx, total_samples)


def upload_metrics(fields: dict[str, bytes], count: int) -> np.ndarray:
    """The client's ``count`` training figures (the NLL first)."""
    return unpack_scalars(need(fields, "metrics"), count)


def ledger(*specs: MessageSpec) -> Layouts:
    """The ledger's table (``ServerAlgorithm.layouts``) of an algorithm's messages."""
    return {s.kind: s.layouts for s in specs}


def finite(name: str, values: np.ndarray) -> np.ndarray:
    """``values`` when all are finite, else MessageError naming the field."""
    if not np.all(np.isfinite(values)):
        raise MessageError(f"{name} contains NaN or Inf")
    return values
