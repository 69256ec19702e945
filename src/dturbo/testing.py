"""Helpers shared by the test suite and the benchmarks: hostile message variants (they need ``hypothesis``, a test
extra) and a residual block with BatchNorm, a model of one's own that dturbo does not build."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Residual(nn.Module):
    """conv-BN-ReLU-conv-BN on ``c`` channels, added to its input, then ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def mutate(base: bytes, data: Any) -> bytes:
    """A hostile variant of the valid message ``base``, drawn from the hypothesis ``data`` object: random
    bytes, a valid first byte (dtype / flags / magic) then anything, 1-4 bit flips, insertions/deletions, or
    a truncation with flips."""
    import hypothesis.strategies as st

    blob = bytearray(base)
    how = data.draw(st.sampled_from(["random", "flip", "insert-delete", "truncate-flip", "head"]))
    if how == "random":
        return data.draw(st.binary(max_size=80))
    if how == "head":
        return bytes(blob[:1]) + data.draw(st.binary(max_size=40))
    if how == "truncate-flip":
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    for _ in range(data.draw(st.integers(1, 4))):
        if how == "insert-delete" and data.draw(st.booleans()):
            at = data.draw(st.integers(0, len(blob)))
            if data.draw(st.booleans()) and at < len(blob):
                del blob[at]
            else:
                blob.insert(at, data.draw(st.integers(0, 255)))
        elif blob:
            blob[data.draw(st.integers(0, len(blob) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    return bytes(blob)
