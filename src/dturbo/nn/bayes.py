"""Bayesian layers with the local reparameterisation trick (docs/algorithm.md §3, 6).

q(w_n) = N(mu_n, sigma^2): sigma is one scalar per layer by default (``sigma_mode="layer"``) or one per
weight (``sigma_mode="weight"``), always through softplus. The support mask S is a buffer: weights off
the support are exactly zero in every forward pass, so they get no gradient from the likelihood, and they
are left out of the KL term (E6); the server also stores them as exact zeros.

During training a layer samples *pre-activations*, not weights (local reparameterisation): for input x,
mean = layer(x; mu * S) and variance = layer(x^2; sigma^2 * S) (for a shared sigma,
sigma^2 * layer(x^2; S)), and the layer's :class:`Sampling` draws mean + sqrt(variance) * noise
(``[dturbo] sampling``). Evaluation (``model.eval()``) uses the mean weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

SigmaMode = Literal["layer", "weight"]

# Floor for the pre-activation variance: keeps sqrt differentiable where an input is all zeros.
_VAR_FLOOR = 1e-16


def softplus_inverse(y: float) -> float:
    """x with softplus(x) = y (y > 0), stable for small and large y."""
    if y <= 0:
        raise ValueError(f"softplus_inverse needs y > 0, got {y}")
    return y + math.log(-math.expm1(-y))


def softplus_inverse_tensor(y: torch.Tensor) -> torch.Tensor:
    """Elementwise :func:`softplus_inverse`; values that arrive as 0 (a sigma that underflowed in 16-bit
    transmission) are clamped to 1e-12 instead of raising."""
    y = y.clamp_min(1e-12)
    return y + torch.log(-torch.expm1(-y))


@dataclass
class SupportView:
    """The part of a layer a training pass computes: its output channels ``rows`` and input channels ``cols`` (None:
    all), and the mask on them."""

    rows: torch.Tensor | None
    cols: torch.Tensor | None
    mask: torch.Tensor
    grouped: bool = False  # a grouped convolution: its output channels cannot be computed apart

    @cached_property
    def distinct(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(a mask of one output channel for each distinct row of the mask, which of them each output channel reads):
        the mask itself and None when its rows are all distinct (or cannot be computed apart); one row and None
        when they are all one."""
        if self.grouped:
            return self.mask, None
        patterns, inverse = torch.unique(self.mask.flatten(1), dim=0, return_inverse=True)
        if patterns.shape[0] == self.mask.shape[0]:
            return self.mask, None
        return patterns.view(-1, *self.mask.shape[1:]), None if patterns.shape[0] == 1 else inverse

    def part(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` (a weight grid, or a bias: its rows only) on the view's rows and columns."""
        if t is None or t.dim() == 0:
            return t
        if self.rows is not None:
            t = t[self.rows]
        return t if self.cols is None or t.dim() == 1 else t[:, self.cols]


class Sampling:
    """How a training forward pass samples a layer's pre-activations (one sample of E6's expectation): the local
    reparameterisation trick, mean + sqrt(variance) * noise, with an independent draw per pre-activation."""

    name = "local"
    detach = False  # whether the variance path takes the layer's input as a constant

    def view(self, layer: BayesianLayer) -> SupportView:
        """The part of the layer computed: here all of it."""
        return layer.whole_view()

    def noise_shape(self, layer: BayesianLayer, mean: torch.Tensor) -> torch.Size:
        return mean.shape

    def sample(self, mean: torch.Tensor, var: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return mean + torch.sqrt(var.clamp_min(_VAR_FLOOR)) * noise

    def draw(self, layer: BayesianLayer, x: torch.Tensor) -> torch.Tensor:
        view = self.view(layer)
        rows, cols = view.rows, view.cols
        if cols is not None:
            x = x.index_select(layer.channel_axis(x), cols)
        mean = layer._op(x, view.part(layer.weight_mu) * view.mask, view.part(layer.bias))
        if self.detach and layer.sigma_mode == "layer":
            # sigma^2 * layer(x^2; S) with x held constant: sigma leaves the square root, and what is left of the draw
            # is a constant of the step, computed without a graph; output channels whose support reads the same inputs
            # share it, computed once
            patterns, which = view.distinct
            with torch.no_grad():
                spread = torch.sqrt(layer._op(x * x, patterns, None).clamp_min(_VAR_FLOOR))
                if which is not None:
                    spread = spread.index_select(layer.channel_axis(spread), which)
                spread = spread * layer.noise(self.noise_shape(layer, mean), mean)
            out = mean + layer.sigma * spread
        else:
            var = layer.variance(x.detach() if self.detach else x, view)
            out = self.sample(mean, var, layer.noise(self.noise_shape(layer, mean), mean))
        if rows is None:
            return out
        axis = layer.channel_axis(out)
        shape = list(out.shape)
        shape[axis] = layer.weight_mu.shape[0]
        if layer.bias is None:
            full = out.new_zeros(shape)
        else:
            full = layer.bias.view(-1, *(1,) * (out.dim() - axis - 1)).expand(shape)
        return torch.index_copy(full, axis, rows, out)


class SupportSampling(Sampling):
    """The local reparameterisation on the channels with weights on the support only: a convolution computes only
    those output channels, and a channel without is its bias, exactly (what export makes of it); a layer reads only
    the input channels (a dense layer's input features) its support reads, the others meeting zero weights; the
    channels computed are drawn as by :class:`Sampling`, one draw per pre-activation."""

    name = "support"

    def view(self, layer: BayesianLayer) -> SupportView:
        return layer.support_view()


class DetachedSampling(SupportSampling):
    """:class:`SupportSampling` whose variance path takes the layer's input as a constant: its gradient reaches
    sigma, not the input, so the backward pass skips the variance convolution; one draw per pre-activation still.
    With one sigma per layer, sigma * sqrt(layer(x^2; S)) * noise leaves only sigma in the graph, and the output
    channels whose rows of S are alike share one variance convolution."""

    name = "detached"
    detach = True


class ChannelSampling(DetachedSampling):
    """:class:`DetachedSampling` with one draw per sample and output channel for all the channel's positions (they
    share the channel's weights, so their pre-activations are correlated under q anyway); a dense layer's draws are
    per unit, as before."""

    name = "channel"

    def noise_shape(self, layer: BayesianLayer, mean: torch.Tensor) -> torch.Size:
        return layer.channel_shape(mean)

    def sample(self, mean: torch.Tensor, var: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(mean, torch.sqrt(var + _VAR_FLOOR), noise)


LOCAL = Sampling()
SAMPLINGS: dict[str, Sampling] = {s.name: s for s in (LOCAL, SupportSampling(), DetachedSampling(), ChannelSampling())}


class BayesianLayer(nn.Module):
    """Common part of the Bayesian Linear and Conv2d layers: mu, sigma, support mask, prior std."""

    weight_mu: nn.Parameter
    bias: nn.Parameter | None
    mask: torch.Tensor
    prior_std: torch.Tensor

    def _init_bayes(self, weight_shape: tuple[int, ...], bias: bool, sigma_mode: SigmaMode, sigma_init: float) -> None:
        if sigma_mode not in ("layer", "weight"):
            raise ValueError(f"sigma_mode must be 'layer' or 'weight', got {sigma_mode!r}")
        self.sigma_mode = sigma_mode
        self.weight_mu = nn.Parameter(torch.empty(weight_shape))
        # Same initialisation as torch.nn.Linear / Conv2d, so the layer scale s_l is the usual one.
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        fan_in = int(self.weight_mu[0].numel())
        if bias:
            bound = 1.0 / math.sqrt(fan_in)
            self.bias = nn.Parameter(torch.empty(weight_shape[0]).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)
        sigma_shape = () if sigma_mode == "layer" else weight_shape
        self.sigma_param = nn.Parameter(torch.full(sigma_shape, softplus_inverse(sigma_init)))
        self.register_buffer("mask", torch.ones(weight_shape))
        self.register_buffer("prior_std", torch.ones(weight_shape))
        # The generator for the reparameterisation noise is set by the client before training,
        # so that every client's round is reproducible (resume equality).
        self.generator: torch.Generator | None = None
        # Baselines train the same architectures as ordinary (point-estimate) networks.
        self.stochastic = True
        self.sampling: Sampling = LOCAL
        self._view_of: tuple[torch.Tensor, int, SupportView] | None = None  # the mask and version it is derived from

    @property
    def sigma(self) -> torch.Tensor:
        return F.softplus(self.sigma_param)

    def masked_weight(self) -> torch.Tensor:
        return self.weight_mu * self.mask

    def _op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.stochastic):
            return self._op(x, self.masked_weight(), self.bias)
        return self.sampling.draw(self, x)

    def variance(self, x: torch.Tensor, view: SupportView | None = None) -> torch.Tensor:
        """The pre-activations' variance for input x: layer(x^2; sigma^2 * S), of ``view``'s part of the layer only
        (x then holds its input channels only)."""
        view = self.whole_view() if view is None else view
        sigma2 = self.sigma**2
        if self.sigma_mode == "layer":
            return sigma2 * self._op(x * x, view.mask, None)
        return self._op(x * x, view.part(sigma2) * view.mask, None)

    @property
    def grouped(self) -> bool:
        """Whether the layer is a grouped convolution: its output channels read their own group's inputs, so neither
        its output nor its input channels can be computed apart."""
        return False

    def whole_view(self) -> SupportView:
        return SupportView(None, None, self.mask)

    def support_view(self) -> SupportView:
        """The output channels with weights on the support and the input channels it reads
        (:meth:`rows_on_support`, :meth:`columns_on_support`), with the mask on them; derived from the mask again
        only when the mask has changed (it is fixed while a client trains)."""
        seen = self._view_of
        if seen is None or seen[0] is not self.mask or seen[1] != self.mask._version:
            rows, cols = self.rows_on_support(), self.columns_on_support()
            with torch.no_grad():
                view = SupportView(rows, cols, SupportView(rows, cols, self.mask).part(self.mask), self.grouped)
            self._view_of = seen = (self.mask, self.mask._version, view)
        return seen[2]

    def channel_axis(self, x: torch.Tensor) -> int:
        """The axis of ``x`` (the layer's input or output) that holds the channels (a dense layer's features: the
        last)."""
        return x.dim() - 1

    def rows_on_support(self) -> torch.Tensor | None:
        """The output channels with weights on the support, where some have none (None: all, none, or a layer whose
        channels cannot be computed apart)."""
        return None

    def columns_on_support(self) -> torch.Tensor | None:
        """The input channels (a dense layer's input features) the support reads, where it leaves some unread (None:
        all, none, or a grouped convolution, whose channels are read by their own group)."""
        if self.grouped:
            return None
        read = self.mask.transpose(0, 1).flatten(1).any(1)
        return None if bool(read.all()) or not bool(read.any()) else read.nonzero().flatten()

    def noise(self, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """Standard normal draws from the client's generator. They are drawn where the generator lives (the CPU,
        also when the model trains on a GPU): the same noise on every device."""
        where = self.generator.device if self.generator is not None else like.device
        return torch.randn(shape, generator=self.generator, dtype=like.dtype, device=where).to(like.device)

    def channel_shape(self, out: torch.Tensor) -> torch.Size:
        """The shape of one draw per output channel of ``out``: a dense layer's units are its channels."""
        return out.shape

    def kl(self) -> torch.Tensor:
        """Sum over the support of KL(N(mu, sigma^2) || N(0, sigma_prior^2)) (the KL of E6)."""
        sigma = self.sigma.expand_as(self.weight_mu)
        sp = self.prior_std
        kl = torch.log(sp / sigma) + (sigma**2 + self.weight_mu**2) / (2.0 * sp**2) - 0.5
        return (kl * self.mask).sum()

    def density(self) -> float:
        return float(self.mask.mean())


class BayesLinear(BayesianLayer):
    """Bayesian fully connected layer; its grid is (out_features x in_features)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, sigma_mode: SigmaMode = "layer",
        sigma_init: float = 1e-3,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_bayes((out_features, in_features), bias, sigma_mode, sigma_init)

    def _op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, sigma_mode={self.sigma_mode}"


class _BayesConvNd(BayesianLayer):
    """Bayesian N-d convolution (N = ``dims``); its grid is (out_channels x in_channels/groups * prod(kernel))
    (docs/algorithm.md §2).

    Takes what ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` take: ``kernel_size``, ``stride``, ``padding`` (an int, a
    tuple or ``"same"`` / ``"valid"``) and ``dilation`` as an int or a tuple, ``groups`` (depthwise: ``groups =
    in_channels``) and ``padding_mode`` (``"zeros"``, ``"reflect"``, ``"replicate"``, ``"circular"``). The attributes
    keep the values as given (an int stays an int)."""

    dims = 2

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, ...], *,
        stride: int | tuple[int, ...] = 1, padding: int | tuple[int, ...] | str = 0,
        dilation: int | tuple[int, ...] = 1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
        sigma_mode: SigmaMode = "layer", sigma_init: float = 1e-3,
    ) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError("in_channels and out_channels must be divisible by groups")
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {', '.join(_PADDING_MODES)}, got {padding_mode!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.groups = kernel_size, stride, padding, groups
        self.dilation, self.padding_mode = dilation, padding_mode
        shape = (out_channels, in_channels // groups, *_ntuple(kernel_size, self.dims))
        self._init_bayes(shape, bias, sigma_mode, sigma_init)
        if padding_mode != "zeros":
            if isinstance(padding, str):
                raise ValueError(f"padding {padding!r} needs padding_mode 'zeros' (as torch's convolutions)")
            # F.pad's order: last dimension first, each as (before, after)
            self._pad = tuple(q for d in reversed(_ntuple(padding, self.dims)) for q in (d, d))
        self._conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]

    def _op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The variance path calls this with x * x: reflect / replicate / circular padding of x * x is the square of
        # the padding of x, so the local reparameterisation stays exact.
        if self.padding_mode != "zeros":
            return self._conv(F.pad(x, self._pad, mode=self.padding_mode), weight, bias, self.stride, 0,
                              self.dilation, self.groups)
        return self._conv(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    @property
    def grouped(self) -> bool:
        return self.groups != 1

    def channel_axis(self, x: torch.Tensor) -> int:
        return x.dim() - self.dims - 1  # the channel axis comes before the spatial ones, batched or not

    def channel_shape(self, out: torch.Tensor) -> torch.Size:
        return out.shape[: self.channel_axis(out) + 1] + (1,) * self.dims

    def rows_on_support(self) -> torch.Tensor | None:
        if self.grouped:
            return None
        on = self.mask.flatten(1).any(1)
        return None if bool(on.all()) or not bool(on.any()) else on.nonzero().flatten()

    def extra_repr(self) -> str:
        extra = "" if self.dilation in (1, (1,) * self.dims) else f", dilation={self.dilation}"
        extra += "" if self.padding_mode == "zeros" else f", padding_mode={self.padding_mode}"
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}{extra}, groups={self.groups}, sigma_mode={self.sigma_mode}"
        )


class BayesConv1d(_BayesConvNd):
    """Bayesian 1-D convolution (sequences, audio); grid (out_channels x in_channels/groups * k)."""

    dims = 1


class BayesConv2d(_BayesConvNd):
    """Bayesian 2-D convolution; its grid is (out_channels x in_channels/groups * kh * kw)."""

    dims = 2


class BayesConv3d(_BayesConvNd):
    """Bayesian 3-D convolution (volumes, video); grid (out_channels x in_channels/groups * kd * kh * kw)."""

    dims = 3


def _ntuple(v: int | tuple[int, ...] | list[int], n: int) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    out = tuple(int(a) for a in v)
    if len(out) != n:
        raise ValueError(f"expected {n} values, got {out}")
    return out


_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def bayesian_layers(model: nn.Module) -> list[tuple[str, BayesianLayer]]:
    """The model's Bayesian layers in definition order (the order of every message's fields)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, BayesianLayer)]

