"""Any ``torch.nn.Module`` as a D-Turbo-VBI model: :func:`bayesianize` (docs/models.md, "Your model").

Every ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` of the module graph, wherever it sits (nested
modules, residual blocks, concatenations: the graph itself is not touched, only its leaves), is replaced by
dturbo's Bayesian layer of the same geometry, whose means start at the layer's weights and bias. Each layer's
support grid is its weight as its GEMM uses it (docs/algorithm.md §2): Linear (out x in), ConvNd (out x
in/groups * prod(kernel)), so a depthwise convolution (groups = channels) has a grid of (channels x kh * kw).

Everything else (BatchNorm, LayerNorm, embeddings, any other parameter or buffer) stays as it is: it is trained
as an ordinary parameter and travels dense (:mod:`dturbo.algorithms.plain`). Layer kinds that have a weight
matrix dturbo cannot grid (transposed convolutions, Bilinear, subclasses of Linear / ConvNd that may compute
something else, uninitialised lazy layers) are refused with :class:`UnsupportedLayerError` naming
each one: left dense they would silently escape the compression. The projections inside ``nn.MultiheadAttention``
(which reads their weights directly) are the exception: they are left as they are and travel dense.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.lazy import LazyModuleMixin

from .bayes import BayesConv1d, BayesConv2d, BayesConv3d, BayesianLayer, BayesLinear, bayesian_layers
from .models import init_sigmas, record_input_shape

SIGMA_MODES = ("layer", "weight", "client")
# torch's layer -> dturbo's Bayesian layer of the same geometry
_CONVERTED: dict[type, type] = {nn.Linear: BayesLinear, nn.Conv1d: BayesConv1d, nn.Conv2d: BayesConv2d,
                                nn.Conv3d: BayesConv3d}


class BayesianizeError(ValueError):
    """A module cannot be made a D-Turbo-VBI model (no Linear or Conv2d layer, a bad argument)."""


class UnsupportedLayerError(BayesianizeError):
    """The module has layers with a weight that dturbo cannot grid; the message names each and its type."""


def _unsupported(module: nn.Module) -> bool:
    """A weighted layer that is not exactly nn.Linear / nn.Conv2d (nor already Bayesian)."""
    if isinstance(module, BayesianLayer):
        return False
    if isinstance(module, LazyModuleMixin):
        return True
    if isinstance(module, nn.Linear | nn.Bilinear | _ConvNd):
        return type(module) not in _CONVERTED
    return False


def _plain_regions(model: nn.Module) -> set[int]:
    """ids of the modules inside an nn.MultiheadAttention (left as they are: it reads their weights directly)."""
    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            out.update(id(sub) for sub in m.modules() if sub is not m)
    return out


def _shared_weights(model: nn.Module, targets: list[nn.Module]) -> list[str]:
    """The tensors of ``targets`` (weight, bias) that another module of ``model`` holds too (weight tying), each as
    "a.weight = b.weight": a Bayesian layer owns its mean, support and precision, so a tied pair cannot stay tied."""
    owners: dict[int, dict[tuple[int, str], str]] = {}  # tensor -> (module, its attribute) -> a name of it
    for name, m in model.named_modules(remove_duplicate=False):  # a module used at two places is one owner
        for pname, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), {}).setdefault((id(m), pname), f"{name}.{pname}" if name else pname)
    wanted = {id(t) for t in targets}
    out = []
    for m in model.modules():
        if id(m) not in wanted:
            continue
        for pname in ("weight", "bias"):
            p = getattr(m, pname, None)
            holders = list(owners.get(id(p), {}).values()) if p is not None else []
            if len(holders) > 1:
                out.append(" = ".join(holders))
    return sorted(set(out))


def _bayes_layer(layer: nn.Module, sigma_mode: str) -> BayesianLayer:
    """The Bayesian layer of ``layer``'s geometry with its weights as means (float32, on the CPU)."""
    mode = "layer" if sigma_mode == "client" else sigma_mode
    new: BayesianLayer
    # Built outside the caller's RNG: a layer draws its own initial weights, which are overwritten at once.
    with torch.random.fork_rng(devices=[]):
        if isinstance(layer, nn.Linear):
            new = BayesLinear(layer.in_features, layer.out_features, bias=layer.bias is not None, sigma_mode=mode)
        else:
            assert isinstance(layer, _ConvNd)
            new = _CONVERTED[type(layer)](
                layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None,
                padding_mode=layer.padding_mode, sigma_mode=mode)
    with torch.no_grad():
        new.weight_mu.copy_(layer.weight.detach().to("cpu", torch.float32))
        if layer.bias is not None and new.bias is not None:
            new.bias.copy_(layer.bias.detach().to("cpu", torch.float32))
    return new.train(layer.training)


def bayesianize(
    module: nn.Module, *, sigma_mode: str = "layer", sigma_init_ratio: float = 0.1, seed: int | None = None,
    example_input: torch.Tensor | None = None, input_shape: Sequence[int] | None = None,
) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` and ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` of ``module`` by a
    Bayesian layer (:class:`~dturbo.nn.bayes.BayesLinear`, :class:`~dturbo.nn.bayes.BayesConv2d`, ...) of the same
    geometry (groups,
    kernel, stride, padding, dilation, padding mode, bias) whose means are the layer's weights; returns the module
    (the new layer when ``module`` itself is a Linear or Conv2d). A layer used at two places of the graph stays one
    layer. Layers that are Bayesian already are kept.

    ``sigma_mode`` and ``sigma_init_ratio``: as ``[dturbo]`` sets them (docs/algorithm.md §3): each layer's sigma
    starts at ``sigma_init_ratio`` times the std of its weights. ``seed``: None keeps the module's weights; an
    integer first draws them again, each submodule's ``reset_parameters()`` in definition order after
    ``torch.manual_seed(seed)``, so that one architecture always starts from the same weights. torch's global
    RNG is left as it was either way. ``example_input`` (a batch) or ``input_shape`` (one sample's shape) is
    recorded as ``input_shape``, as the built-in models record it (the compute of a layer, ``sparsity.budget =
    "flops"``, is counted on it).

    Raises :class:`UnsupportedLayerError` for weighted layers dturbo cannot grid (each named, with its type) and
    :class:`BayesianizeError` when there is no Linear or Conv2d layer at all, or when a layer to make Bayesian shares
    its weight or bias with another module (weight tying: it would be silently untied).
    """
    if sigma_mode not in SIGMA_MODES:
        raise BayesianizeError(f"sigma_mode must be one of {', '.join(SIGMA_MODES)}, got {sigma_mode!r}")
    if not sigma_init_ratio > 0:
        raise BayesianizeError(f"sigma_init_ratio must be > 0, got {sigma_init_ratio}")
    if example_input is not None and input_shape is not None:
        raise BayesianizeError("pass example_input or input_shape, not both")
    if not isinstance(module, nn.Module):
        raise BayesianizeError(f"bayesianize takes a torch.nn.Module, got {type(module).__name__}")
    skip = _plain_regions(module)
    bad = [f"{name or '(the module itself)'} ({type(m).__name__})" for name, m in module.named_modules()
           if id(m) not in skip and _unsupported(m)]
    if bad:
        raise UnsupportedLayerError(
            f"dturbo cannot give these layers a support grid (only nn.Linear and nn.Conv1d/2d/3d, docs/algorithm.md "
            f"§2): {', '.join(bad)}; replace them or keep them out of the model (lazy layers: run the model once on "
            f"an example input first)")
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in module.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
    targets = [m for m in module.modules() if id(m) not in skip and type(m) in _CONVERTED]
    if not targets and not bayesian_layers(module):
        raise BayesianizeError(
            f"{type(module).__name__} has no nn.Linear or nn.Conv1d/2d/3d layer: D-Turbo-VBI compresses the weights of "
            f"those (docs/algorithm.md §2), so there is nothing to federate as a Bayesian model")
    tied = _shared_weights(module, targets)
    if tied:
        raise BayesianizeError(
            f"these layers share a tensor (weight tying): {'; '.join(tied)}. A Bayesian layer has its own mean, "
            f"support and precision, so bayesianize would silently untie them: untie them in the model (give each "
            f"layer its own weight) before bayesianize")
    new = {id(m): _bayes_layer(m, sigma_mode) for m in targets}
    root = new.get(id(module), module)
    for parent in list(root.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new:
                setattr(parent, name, new[id(child)])
    if new:
        init_sigmas(root, sigma_mode, sigma_init_ratio)
    if example_input is not None:
        input_shape = tuple(example_input.shape[1:])
    if input_shape is not None:
        root.input_shape = tuple(int(d) for d in input_shape)
    return root


ModelSource = nn.Module | Callable[[], nn.Module]


def user_model_factory(
    source: ModelSource, *, sigma_mode: str, sigma_init_ratio: float, seed: int, input_shape: Sequence[int],
) -> Callable[[], nn.Module]:
    """The model factory of a run on a model of one's own (``dturbo.Experiment(model=...)``): every call returns a
    new model with the same initial weights, as the algorithms need (FedPM rebuilds its frozen weights from it, the
    server its initial state).

    ``source``: an ``nn.Module``, copied now (later changes to it do not reach the run; each call returns a copy of
    that snapshot), or a zero-argument function returning one, called with torch's global RNG seeded by ``seed``
    (``experiment.seed``; the caller's RNG is left as it was), so that randomly initialised weights are the same
    at every call. A model without Bayesian layers goes through :func:`bayesianize` (``sigma_mode``,
    ``sigma_init_ratio`` from ``[dturbo]``); one that has them is used as it is. ``input_shape`` (one sample's
    shape, from the data) is recorded unless the model records one."""
    if isinstance(source, nn.Module):
        snapshot = copy.deepcopy(source)

        def make() -> nn.Module:
            return copy.deepcopy(snapshot)
    elif callable(source):
        make = source
    else:
        raise BayesianizeError(f"model must be a torch.nn.Module or a function that returns one, got "
                               f"{type(source).__name__}")

    def factory() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make()
        if not isinstance(model, nn.Module):
            raise BayesianizeError(f"the model function returned a {type(model).__name__}, not a torch.nn.Module")
        if not bayesian_layers(model):
            model = bayesianize(model, sigma_mode=sigma_mode, sigma_init_ratio=sigma_init_ratio)
        record_input_shape(model, input_shape)
        return model.cpu().float()

    return factory
