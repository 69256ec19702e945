"""Local training on one client: minibatch SGD/Adam over the client's data (shared by all algorithms)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, TrainConfig
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


def round_lr(cfg: Config, round_idx: int) -> float:
    """The learning rate of round ``round_idx`` (0-based) of R = ``cfg.experiment.rounds``: ``train.lr``, or with
    ``train.lr_schedule = "cosine"`` lr for the first s = ``train.lr_decay_start`` rounds, then
    ``lr * (f + (1 - f) * (1 + cos(pi * (t - s) / (R - 1 - s))) / 2)`` with f = ``train.lr_final``: f * lr in the
    last round; times ``(t + 1) / (w + 1)`` in the first w = ``train.lr_warmup_rounds`` rounds. A function of the
    round alone, so a resumed run and a Flower client (which learns the round from its downlink) train at the same
    rate."""
    lr = _lr(cfg.train)
    w = cfg.train.lr_warmup_rounds
    warm = (round_idx + 1) / (w + 1) if round_idx < w else 1.0
    rounds, start = cfg.experiment.rounds, cfg.train.lr_decay_start
    if cfg.train.lr_schedule == "constant" or round_idx <= start or start >= rounds - 1:
        return lr * warm
    f = cfg.train.lr_final
    t = (min(round_idx, rounds - 1) - start) / (rounds - 1 - start)
    return lr * warm * (f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * t)))


def _lr(train: TrainConfig) -> float:
    if train.lr is None:  # a TrainConfig built alone; a Config fills its algorithm's default
        raise ValueError("train.lr is unset: build the whole config (dturbo.load_config) to get the algorithm's "
                         "default learning rate, or set it")
    return train.lr


def make_optimizer(train: TrainConfig, params: list[nn.Parameter], lr: float | None = None) -> torch.optim.Optimizer:
    """Adam, or SGD with momentum 0.9, at ``lr`` (None: ``train.lr``; a round's rate comes from :func:`round_lr`)."""
    lr = _lr(train) if lr is None else lr
    if train.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def train_local(
    model: nn.Module,
    data: ClientData,
    train: TrainConfig,
    generator: torch.Generator,
    penalty: Callable[[], torch.Tensor] | None = None,
    device: torch.device = CPU,
    lr: float | None = None,
) -> LocalResult:
    """Run the local steps at ``lr`` (None: ``train.lr``; the algorithms pass :func:`round_lr`): loss = mean
    cross-entropy of the minibatch (+ ``penalty()``).

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
            return _steps(model, data, train, generator, penalty, device, steps, min(train.batch_size, n), lr)
    finally:
        model.to(CPU)


def _steps(model: nn.Module, data: ClientData, train: TrainConfig, generator: torch.Generator,
           penalty: Callable[[], torch.Tensor] | None, device: torch.device, steps: int, bs: int,
           lr: float | None) -> LocalResult:
    n = len(data)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(train, params, lr)
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
