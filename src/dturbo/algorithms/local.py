"""Local training on one client: minibatch SGD/Adam over the client's data (shared by all algorithms)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TrainConfig
from ..device import CPU
from .base import ClientData, ClientError

_GLOBAL_RNG_TAG = 0x6C6F63616C  # keeps the global stream apart from the generator's own


@dataclass
class LocalResult:
    steps: int
    nll: float  # mean minibatch negative log-likelihood over the local steps
    penalty: float  # mean of the extra loss term (e.g. beta * KL / n), 0 if none


def num_local_steps(train: TrainConfig, num_samples: int) -> int:
    if train.local_steps > 0:
        return train.local_steps
    return max(1, math.ceil(train.local_epochs * num_samples / train.batch_size))


def make_optimizer(train: TrainConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if train.lr is None:  # a TrainConfig built alone; a Config fills its algorithm's default
        raise ValueError("train.lr is unset: build the whole config (dturbo.load_config) to get the algorithm's "
                         "default learning rate, or set it")
    if train.optimizer == "adam":
        return torch.optim.Adam(params, lr=train.lr)
    return torch.optim.SGD(params, lr=train.lr, momentum=0.9)


def train_local(
    model: nn.Module,
    data: ClientData,
    train: TrainConfig,
    generator: torch.Generator,
    penalty: Callable[[], torch.Tensor] | None = None,
    device: torch.device = CPU,
) -> LocalResult:
    """Run the local steps: loss = mean cross-entropy of the minibatch (+ ``penalty()``).

    Minibatches are drawn by reshuffling the local data each epoch with ``generator``, so a round is a
    pure function of the downlink, the data and the generator's seed.
    The model trains on ``device`` (``experiment.device``) and is back on the CPU when this returns, where the
    client encodes its upload; the minibatch order and the noise are still drawn on the CPU with ``generator``.
    On the CPU nothing moves.
    Raises ClientError as soon as the loss stops being finite (a diverged client must not be averaged in).
    """
    n = len(data)
    if n == 0:
        raise ClientError("client has no data")
    steps = num_local_steps(train, n)
    model.to(device)
    # Draws a model makes from torch's global RNG (dropout in a model of one's own) come from a stream seeded by
    # this client's generator, and leave the global RNG as it was: the round stays a pure function of its inputs.
    # (dturbo's layers and the baselines draw from ``generator`` itself; this draws nothing from it.)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(generator.initial_seed() ^ _GLOBAL_RNG_TAG)
            return _steps(model, data, train, generator, penalty, device, steps, min(train.batch_size, n))
    finally:
        model.to(CPU)


def _steps(model: nn.Module, data: ClientData, train: TrainConfig, generator: torch.Generator,
           penalty: Callable[[], torch.Tensor] | None, device: torch.device, steps: int, bs: int) -> LocalResult:
    n = len(data)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(train, params)
    model.train()
    order = torch.randperm(n, generator=generator)
    pos = 0
    nll_sum = pen_sum = 0.0
    for step in range(steps):
        if pos + bs > n:
            order = torch.randperm(n, generator=generator)
            pos = 0
        idx = order[pos : pos + bs]
        pos += bs
        logits = model(data.x[idx].to(device))
        nll = F.cross_entropy(logits, data.y[idx].to(device))
        loss = nll
        pen = penalty() if penalty is not None else None
        if pen is not None:
            loss = loss + pen
        if not torch.isfinite(loss):
            raise ClientError(f"local training diverged: non-finite loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        nll_sum += float(nll.detach())
        pen_sum += float(pen.detach()) if pen is not None else 0.0
    return LocalResult(steps=steps, nll=nll_sum / steps, penalty=pen_sum / steps)
