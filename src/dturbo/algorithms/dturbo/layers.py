"""D-Turbo-VBI's view of a model's Bayesian layers: their infos (grid, prior, kind), loading a downlink's values into
one, and sigma and the rebuilt prior std on a support."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...config import Config
from ...nn.bayes import BayesianLayer, bayesian_layers, softplus_inverse_tensor
from ...nn.models import layer_scale, weight_uses
from ...nn.shapes import grid_shape, layer_kind
from ..statistics import batchnorms
from . import vbi
from .config import PriorConfig
from .prior import resolve_prior
from .turbo import LayerInfo

# f(c x) = c f(x) for c > 0, channel by channel
_HOMOGENEOUS = (nn.ReLU, nn.LeakyReLU, nn.Dropout, nn.Identity, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
                nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)


def layer_infos(model: nn.Module, cfg: Config) -> list[LayerInfo]:
    """Every Bayesian layer of ``model`` with its grid and its prior from the config's section of its kind; the
    multiply-adds a weight does only when the sparsity budget counts them (they need the model's input shape)."""
    uses = weight_uses(model) if cfg.dturbo.sparsity.budget == "flops" else {}
    with_batchnorm = bool(batchnorms(model))
    followed = followed_by_batchnorm(model)
    infos = []
    for name, layer in bayesian_layers(model):
        kind = layer_kind(layer)
        pc: PriorConfig = getattr(cfg.dturbo.prior, kind)
        prior = resolve_prior(pc, layer_scale(layer), normalised=name in followed)
        one_channel = kind == "conv" and layer.weight_mu.shape[1] == 1
        infos.append(LayerInfo(name, grid_shape(layer), prior, uses.get(name, 1), kind,
                               keep_dense=with_batchnorm and one_channel, normalised=name in followed,
                               shape=tuple(layer.weight_mu.shape)))
    return infos


def followed_by_batchnorm(model: nn.Module) -> set[str]:
    """The Bayesian layers whose output channels BatchNorm normalises next, in the order the model defines its
    modules (``Sequential(conv, bn)``, ``self.conv, self.bn``), directly or, for a layer without bias, through
    modules that commute with a positive scale (ReLU, pooling, dropout): BatchNorm makes those layers' scale
    arbitrary (:attr:`dturbo.algorithms.dturbo.turbo.LayerInfo.normalised`)."""
    leaves = [(n, m) for n, m in model.named_modules() if isinstance(m, BayesianLayer) or not any(m.children())]
    out = set()
    for i, (name, layer) in enumerate(leaves):
        if not isinstance(layer, BayesianLayer):
            continue
        after: Iterator[nn.Module] = (leaves[j][1] for j in range(i + 1, len(leaves)))
        if layer.bias is None:  # a scale passes through these only without a bias
            after = itertools.dropwhile(lambda m: isinstance(m, _HOMOGENEOUS), after)
        norm = next(after, None)
        if isinstance(norm, _BatchNorm) and norm.num_features == layer.weight_mu.shape[0]:
            out.add(name)
    return out


def load_layer(layer: BayesianLayer, mu: np.ndarray, mask: np.ndarray, sigma: np.ndarray,
                bias: np.ndarray | None, prior_std: np.ndarray | None) -> None:
    with torch.no_grad():
        shape = layer.weight_mu.shape
        layer.mask.copy_(torch.from_numpy(mask.reshape(shape).astype(np.float32)))
        layer.weight_mu.copy_(torch.from_numpy(mu.reshape(shape).astype(np.float32)) * layer.mask)
        if layer.sigma_mode == "layer":
            layer.sigma_param.copy_(softplus_inverse_tensor(torch.tensor(float(sigma.reshape(-1)[0]))))
        else:
            # per-weight sigma: either the full grid (server) or the values on the support (client)
            full = np.full(mask.size, 1e-3)
            flat_mask = mask.reshape(-1)
            full[flat_mask] = sigma.reshape(-1)[flat_mask] if sigma.size == mask.size else sigma.reshape(-1)
            layer.sigma_param.copy_(softplus_inverse_tensor(torch.from_numpy(full.reshape(shape)).float()))
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(torch.from_numpy(bias.astype(np.float32)))
        if prior_std is not None:
            layer.prior_std.copy_(torch.from_numpy(prior_std.reshape(shape).astype(np.float32)))


def sigma_grid_on(sigma: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sigma as a grid from a layer's scalar or its values on the support ``mask`` (1 elsewhere)."""
    if sigma.size == 1:
        return np.full(mask.shape, float(sigma.reshape(-1)[0]))
    out = np.ones(mask.shape)
    out[mask] = sigma.reshape(-1)
    return out


def rebuilt_prior_std(info: LayerInfo, mu: np.ndarray, sigma: np.ndarray, form: str) -> np.ndarray:
    """sigma_prior as a client rebuilds it (``transmission.prior_std = "rebuilt"``): E4 then E5 with pi~ = 1, i.e.
    q(rho) = Gamma(a + 1/2, b + (mu^2 + sigma^2) / 2) from the downloaded mu_G and sigma_G. The server's E4 used its
    own pi~ (>= the support threshold on S) and the unrounded mu: docs/communication.md states how far they differ."""
    a_tilde, b_tilde = vbi.precision_posterior(1.0, mu, sigma, **info.prior.gamma_kwargs(), form=form)
    return vbi.prior_std(a_tilde, b_tilde)


def sigma_options(cfg: Config) -> dict[str, Any]:
    return {"sigma_mode": cfg.dturbo.sigma_mode, "sigma_init_ratio": cfg.dturbo.sigma_init_ratio}


