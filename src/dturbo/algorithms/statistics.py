"""BatchNorm's running statistics measured on the global model itself (docs/models.md, "BatchNorm").

A client's running statistics belong to the weights it trained. The server's model is not those weights: it is
their average, and with a sparsifying method also pruned to the round's new support, so averaged statistics
normalise the wrong activations and the evaluated model loses accuracy each time the support shrinks. With
``[federation] batchnorm = "calibrated"`` the statistics come from the model they serve: after an evaluated round
the runner sends the next round's clients the next round's downlink in a ``calibrate`` message; each client loads
it exactly as for training (:meth:`dturbo.protocol.ClientAlgorithm.receive`), passes its local data through it once
in training mode without training, and answers with each BatchNorm layer's per-channel mean and variance of its
input over all its samples (:func:`measure`). The server pools them, weighted by the partition sizes it knows,
into the statistics of the union of the clients' data (:meth:`Statistics.pool`: between-client spread included)
and puts them into the global model's running statistics before it is evaluated and saved. Both messages are
counted in the ledger. A model without BatchNorm adds nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..codec import MAGIC, CodecError, decode_dense, decode_message, encode_dense, encode_message
from ..device import CPU
from ..protocol import ClientAlgorithm, ClientData, MessageError, ServerAlgorithm, State
from .bounds import VALUE_CAP
from .plain import SUFFIX
from .robust import Mean, Rule

if TYPE_CHECKING:
    from ..ledger import Traffic

REQUEST = "calibrate"
REPLY = "statistics"
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class Norm:
    name: str  # the module's name in the model
    channels: int

    @property
    def fields(self) -> tuple[str, str]:
        """The server state entries of its running mean and variance (:mod:`dturbo.algorithms.plain`)."""
        return f"{self.name}.running_mean.{SUFFIX}", f"{self.name}.running_var.{SUFFIX}"


def batchnorms(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """The BatchNorm modules of ``model`` that keep running statistics, by name, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BATCHNORM) and m.track_running_stats]


class Statistics:
    """The BatchNorm layers of one architecture, and how their statistics are measured, sent and pooled."""

    def __init__(self, model: nn.Module) -> None:
        self.norms = [Norm(n, m.num_features) for n, m in batchnorms(model)]

    def __bool__(self) -> bool:
        return bool(self.norms)

    # ------------------------------------------------------------------ client
    @torch.no_grad()
    def measure(self, model: nn.Module, data: ClientData, batch_size: int, device: torch.device) -> bytes:
        """The reply to a calibration: every BatchNorm layer's per-channel mean and (biased) variance of its input
        over all of ``data``, the model in training mode (each batch normalised by its own statistics, as in local
        training) with dropout and the like off; float32 fields ``<name>.mean`` / ``<name>.var``. The model is measured
        on ``device`` and is back on the CPU when this returns."""
        model.to(device).eval()
        # per layer: the sum and the sum of squares of each channel, and the count of values
        sums = {n.name: [torch.zeros(n.channels, dtype=torch.float64), torch.zeros(n.channels, dtype=torch.float64),
                         torch.zeros(())] for n in self.norms}
        hooks = []
        for name, module in batchnorms(model):
            module.train()

            def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0].double().transpose(0, 1).reshape(args[0].shape[1], -1)
                acc = sums[name]
                acc[0] += x.sum(1).cpu()
                acc[1] += (x * x).sum(1).cpu()
                acc[2] += x.shape[1]

            hooks.append(module.register_forward_pre_hook(hook))
        try:
            for i in range(0, len(data), batch_size):
                model(data.x[i : i + batch_size].to(device))
        finally:
            for h in hooks:
                h.remove()
            model.eval().to(CPU)  # back where the client loads its next downlink, as after local training
        fields = []
        for norm in self.norms:
            s, s2, count = sums[norm.name]
            mean = s / count
            var = (s2 / count - mean * mean).clamp_min(0.0)
            fields += [(f"{norm.name}.mean", encode_dense(mean.numpy(), dtype="float32")),
                       (f"{norm.name}.var", encode_dense(var.numpy(), dtype="float32"))]
        return encode_message(REPLY, fields)

    # ------------------------------------------------------------------ server
    def decode(self, reply: bytes) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """A client's statistics by layer; MessageError (CodecError) when anything is missing, of another size,
        not finite, or a variance is negative."""
        _, fields = decode_message(reply, expected_kind=REPLY, max_bytes=self.max_reply_bytes())
        got = dict(fields)
        if len(got) != len(fields) or set(got) != {f"{n.name}.{k}" for n in self.norms for k in ("mean", "var")}:
            raise MessageError("statistics reply does not hold exactly one mean and one var per BatchNorm layer")
        out = {}
        for norm in self.norms:
            mean, var = (decode_dense(got[f"{norm.name}.{k}"], max_elements=norm.channels) for k in ("mean", "var"))
            if mean.shape != (norm.channels,) or var.shape != (norm.channels,):
                raise MessageError(f"{norm.name}: statistics of shape {mean.shape}/{var.shape}, the layer has "
                                   f"{norm.channels} channels")
            if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(var))) or np.any(var < 0):
                raise MessageError(f"{norm.name}: statistics not finite or a negative variance")
            top = max(float(np.abs(mean).max(initial=0.0)), float(var.max(initial=0.0)))
            if top > VALUE_CAP:  # what the float16 downlink must carry, pooled: inside the cap, far inside float16
                raise MessageError(f"{norm.name}: a statistic of magnitude {top:.4g}, beyond the bound {VALUE_CAP:g}")
            out[norm.name] = (mean.astype(np.float64), var.astype(np.float64))
        return out

    def max_reply_bytes(self) -> int:
        return sum(2 * (4 * n.channels + len(n.name) + 32) for n in self.norms) + 64

    def pool(self, state: State, weights: list[float], decoded: list[dict[str, tuple[np.ndarray, np.ndarray]]],
             rule: Rule | None = None) -> State:
        """``state`` with every BatchNorm's running statistics those of the pooled data: with p_c the clients'
        weights normalised, mean = sum p_c m_c and var = sum p_c (v_c + (m_c - mean)^2); a robust ``rule``
        (``[robust]``) takes the place of each weighted sum, so that a few clients cannot move them far."""
        p = np.asarray(weights, dtype=np.float64)
        p = p / p.sum()
        combine = (rule or Mean()).combine
        new = dict(state)
        for norm in self.norms:
            means = np.stack([d[norm.name][0] for d in decoded])
            vars_ = np.stack([d[norm.name][1] for d in decoded])
            mean = combine(means, p)
            var = combine(vars_ + (means - mean) ** 2, p)
            key_mean, key_var = norm.fields
            new[key_mean], new[key_var] = mean.astype(np.float32), var.astype(np.float32)
        return new


def calibrate(statistics: Statistics, server: ServerAlgorithm, state: State, next_round: int,
              send: Callable[[dict[int, bytes]], Mapping[int, object]], traffic: Traffic, events: list[str]) -> State:
    """``state`` with its BatchNorm statistics measured by the clients of ``next_round`` (module docstring).
    ``send`` delivers each client's ``calibrate`` message and returns the replies of those it sent (bytes, or the
    reason there is none); both directions are booked in ``traffic``; a refused or missing reply is an event, and
    with no valid reply the averaged statistics stay."""
    downlinks = server.downlinks(state, next_round, server.select_clients(next_round))
    framed: dict[int, bytes] = {}
    requests = {cid: framed.setdefault(id(down), request(down)) for cid, down in downlinks.items()}
    replies = {}
    for cid, reply in send(requests).items():
        if cid in requests:
            replies[cid] = reply
        else:  # only the clients asked answer: another's reply is neither read nor booked
            events.append(f"client {cid}: BatchNorm statistics refused: it was not asked this round")
    good, weights = [], []
    for cid, reply in replies.items():
        if not isinstance(reply, bytes):
            events.append(f"client {cid}: no BatchNorm statistics ({reply})")
            continue
        try:
            good.append(statistics.decode(reply))
        except (MessageError, CodecError) as err:
            events.append(f"client {cid}: BatchNorm statistics rejected: {err}")
            continue
        weights.append(server.partitions[cid] if server.partitions else 1)
    traffic.add_calibration([(requests[c], downlinks[c]) for c in replies],
                            [r for r in replies.values() if isinstance(r, bytes)], statistics.max_reply_bytes())
    if not good:
        events.append("BatchNorm calibration: no valid statistics, the averaged ones are kept")
        return state
    robust = getattr(server, "robust", None)
    rule = None if robust is None or robust.plain else robust.rule.for_state()
    pooled = statistics.pool(state, weights, good, rule)
    # each reply is inside the bound, but their spread enters the pooled variance: a pool beyond it would be a
    # state the float16 downlink cannot carry, so it is never stored
    top = max(float(np.abs(pooled[k]).max(initial=0.0)) for n in statistics.norms for k in n.fields)
    if not np.isfinite(top) or top > VALUE_CAP:
        events.append(f"BatchNorm calibration: pooled statistics of magnitude {top:.4g}, beyond the bound "
                      f"{VALUE_CAP:g}; the averaged ones are kept")
        return state
    return pooled


def request(downlink: bytes) -> bytes:
    """The calibration message: the downlink the client loads, framed under the kind ``calibrate``."""
    return encode_message(REQUEST, [("downlink", downlink)])


def answer(client: ClientAlgorithm, message: bytes, data: ClientData, client_id: int) -> bytes:
    """What a client sends back for ``message``: its statistics for a calibration, else its training upload."""
    if is_request(message):
        _, fields = decode_message(message, expected_kind=REQUEST)
        if len(fields) != 1 or fields[0][0] != "downlink":
            raise MessageError("a calibrate message holds exactly one field, 'downlink'")
        model = client.receive(fields[0][1], client_id)
        return Statistics(model).measure(model, data, client.cfg.train.batch_size, client.device)
    return client.fit(message, data, client_id)


def is_request(message: bytes) -> bool:
    """Whether ``message`` is a calibration (else a training downlink)."""
    return _kind(message) == REQUEST


def _kind(message: bytes) -> str:
    """The kind a framed message declares (codec.encode_message: magic, version, kind length, kind), read without
    decoding its fields; "" when it is too short to say."""
    head = bytes(message[:4])
    if len(head) < 4 or head[:2] != MAGIC:
        return ""
    return bytes(message[4 : 4 + head[3]]).decode(errors="replace")
