"""The model's state outside its Bayesian layers, the same way for every algorithm (docs/models.md).

A model made by :func:`dturbo.nn.bayesianize` may hold state that is not a weight of a Bayesian layer: BatchNorm's
affine weights and running statistics, LayerNorm's, an embedding, any other parameter or persistent buffer. It is
trained locally as an ordinary parameter (buffers as their modules update them) and travels with every algorithm
in the same way, which :class:`PlainState` implements once:

* down: the server's values, dense float16 (``<state_dict key>.plain`` fields, codec ``encode_dense``; the ledger
  books them under the ``plain`` layout ``dense``: shape in headers, values in values);
* up: the client's values after its local steps, dense float16;
* server: the mean weighted by n_t over the uploads that decode and validate (p_t = n_t / sum n_t, whatever
  weighting the algorithm uses for its own weights), kept in float32 in the server state (key = field name).

Tensors that are not floating point (BatchNorm's ``num_batches_tracked``) do not travel: every client sets them back
to the model factory's value before it trains, and the global model keeps that value. A round then stays a pure
function of the downlink (resume is exact); BatchNorm with its default momentum does not read the counter, and with
``momentum=None`` its running statistics become the mean over the round's local steps, which the server averages.

A model without such state (every built-in model) adds no field, no state key and no byte to its messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..codec import decode_dense, encode_dense
from ..nn.bayes import bayesian_layers
from .base import MessageError, State, need
from .bounds import VALUE_CAP, magnitude

SUFFIX = "plain"
LAYOUT = {SUFFIX: "dense"}  # merged into an algorithm's message layouts (dturbo.ledger.message_bits)


@dataclass(frozen=True)
class PlainTensor:
    key: str  # the model's state_dict key
    shape: tuple[int, ...]
    parameter: bool = False  # trained by the optimizer (BatchNorm's affine weights), not a buffer its module sets

    @property
    def field(self) -> str:
        return f"{self.key}.{SUFFIX}"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def limit(self, global_values: np.ndarray) -> float:
        """The largest magnitude an upload of this tensor may hold: a trained parameter's within the growth of the
        weights' limits (local steps move it little; a large BatchNorm weight scales the next layer's statistics by
        its square, beyond what the clients' float16 uploads carry), a running statistic's within the cap that keeps
        every aggregate far inside float16 (it follows the data, not the global state)."""
        return magnitude(global_values) if self.parameter else VALUE_CAP


def _plain_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict entries (parameters and persistent buffers) outside the Bayesian layers, each tensor once."""
    inside = tuple(f"{name}." for name, _ in bayesian_layers(model))
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if key.startswith(inside) or id(value) in seen:
            continue
        seen.add(id(value))
        out[key] = value
    return out


class DenseStateWarning(UserWarning):
    """A model's state outside its Bayesian layers travels dense every round and is outside the supports."""


class PlainState:
    """The floating-point state outside the Bayesian layers of one architecture, and how it travels (module
    docstring). Built from a fresh model of the algorithm's factory, so the fixed (non-float) tensors hold the
    factory's values."""

    def __init__(self, model: nn.Module) -> None:
        entries = _plain_entries(model)
        trained = {id(p) for p in model.parameters()}
        self.tensors = [PlainTensor(k, tuple(v.shape), id(v) in trained)
                        for k, v in entries.items() if v.is_floating_point()]
        self.fixed = {k: v.detach().clone() for k, v in entries.items() if not v.is_floating_point()}
        too_long = [t.key for t in self.tensors if len(t.field.encode()) > 255]
        if too_long:
            raise ValueError(f"state names longer than {255 - len(SUFFIX) - 1} bytes cannot be message fields: "
                             f"{', '.join(too_long)}")

    def __bool__(self) -> bool:
        return bool(self.tensors)

    @property
    def size(self) -> int:
        """The values that travel dense each way every round."""
        return sum(t.size for t in self.tensors)

    def by_module(self) -> dict[str, int]:
        """Values that travel dense, by the module that holds them (``""``: the model itself), in model order."""
        out: dict[str, int] = {}
        for t in self.tensors:
            module = t.key.rpartition(".")[0]
            out[module] = out.get(module, 0) + t.size
        return out

    def max_bytes(self) -> int:
        """A bound on the bytes of this state in one message (float16 values, shapes, names, framing)."""
        return sum(2 * t.size + len(t.shape) * 10 + len(t.field) + 32 for t in self.tensors)

    # ------------------------------------------------------------------ server
    def init(self, model: nn.Module) -> State:
        """Server state entries: the initial values of ``model`` (a fresh one of the factory), float32."""
        sd = model.state_dict()
        return {t.field: sd[t.key].detach().cpu().numpy().astype(np.float32).reshape(t.shape) for t in self.tensors}

    def encode_state(self, state: State) -> dict[str, bytes]:
        """Downlink fields: the server's values, dense float16."""
        return {t.field: encode_dense(state[t.field], dtype="float16") for t in self.tensors}

    def decode(self, fields: dict[str, bytes]) -> dict[str, np.ndarray]:
        """This state from a message's fields, float64; MessageError when a tensor is missing, of another shape,
        or not finite (CodecError when its payload is malformed)."""
        out = {}
        for t in self.tensors:
            v = decode_dense(need(fields, t.field), max_elements=max(t.size, 1))
            if v.shape != t.shape:
                raise MessageError(f"{t.field} has shape {v.shape}, the model's {t.key} has {t.shape}")
            if not np.all(np.isfinite(v)):
                raise MessageError(f"{t.field} contains NaN or Inf")
            out[t.field] = v.astype(np.float64)
        return out

    def aggregate(self, n_t: list[int], decoded: list[dict[str, np.ndarray]]) -> State:
        """Server state entries: the n_t-weighted mean of the clients' values (float32)."""
        if not self.tensors:
            return {}
        p = np.asarray(n_t, dtype=np.float64)
        p = p / p.sum()
        return {t.field: sum(pt * d[t.field] for pt, d in zip(p, decoded, strict=True)).astype(np.float32)
                for t in self.tensors}

    def flatten(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """This state's values (by field) as one float64 vector, in tensor order."""
        return np.concatenate([np.asarray(values[t.field], np.float64).reshape(-1) for t in self.tensors])

    def unflatten(self, vector: np.ndarray) -> State:
        """Server state entries (float32) from a vector of :meth:`flatten`."""
        ends = np.cumsum([0] + [t.size for t in self.tensors])
        return {t.field: np.asarray(vector[a:b], np.float32).reshape(t.shape)
                for t, a, b in zip(self.tensors, ends[:-1], ends[1:], strict=True)}

    def load_state(self, model: nn.Module, state: State) -> None:
        """Put the server's values into ``model`` (the global model)."""
        self._load(model, {t.field: state[t.field] for t in self.tensors})

    # ------------------------------------------------------------------ client
    def load_fields(self, model: nn.Module, fields: dict[str, bytes]) -> None:
        """Put a downlink's values into the client's ``model`` and the fixed tensors back to the factory's."""
        self.load_values(model, self.decode(fields))

    def load_values(self, model: nn.Module, values: dict[str, np.ndarray]) -> None:
        """Put decoded values (:meth:`decode`) into the client's ``model`` and the fixed tensors back to the
        factory's."""
        self._load(model, values)

    def encode_model(self, model: nn.Module) -> dict[str, bytes]:
        """Upload fields: the client's values after training, dense float16."""
        sd = model.state_dict()
        return {t.field: encode_dense(sd[t.key].detach().cpu().numpy(), dtype="float16") for t in self.tensors}

    def _load(self, model: nn.Module, values: dict[str, np.ndarray]) -> None:
        if not self.tensors and not self.fixed:
            return
        sd = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for t in self.tensors:
                target = sd[t.key]
                target.copy_(torch.from_numpy(np.asarray(values[t.field])).to(target.dtype).reshape(t.shape))
            for key, value in self.fixed.items():
                sd[key].copy_(value)
