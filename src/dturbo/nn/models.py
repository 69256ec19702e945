"""The networks of the experiments, built from Bayesian layers (SPEC 10).

Every model is an ``nn.Sequential``; its Bayesian layers carry names that figures and configs use
(``conv1``..``conv4``, ``dense1``..``dense3`` for the downsized AlexNet). "Dense_2" of the paper's
Fig. 3 is our ``dense2`` (120 -> 84, grid 84 x 120).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from .bayes import BayesConv2d, BayesianLayer, BayesLinear, SigmaMode, bayesian_layers, softplus_inverse

MODEL_NAMES = ("alexnet-small", "lenet5", "mlp")


def _act() -> nn.Module:
    return nn.LeakyReLU(0.1)


def _flat_size(features: nn.Module, input_shape: Sequence[int]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).numel())


def alexnet_small(input_shape: Sequence[int], num_classes: int, sigma_mode: SigmaMode) -> nn.Sequential:
    """The reference demo's "downsized AlexNet", channels-first: 'same' convolutions, 3/2 max-pooling
    without padding (as TF's default 'valid' pooling), leaky ReLU(0.1) after every layer but the last.
    32x32x3 input gives the paper's 576 -> 120 dense layer; 28x28x1 gives 256 -> 120."""
    c = int(input_shape[0])
    kw = {"sigma_mode": sigma_mode}
    feats = OrderedDict(
        conv1=BayesConv2d(c, 6, 7, padding=3, **kw), act1=_act(), pool1=nn.MaxPool2d(3, 2),
        conv2=BayesConv2d(6, 16, 5, padding=2, **kw), act2=_act(), pool2=nn.MaxPool2d(3, 2),
        conv3=BayesConv2d(16, 32, 3, padding=1, **kw), act3=_act(),
        conv4=BayesConv2d(32, 64, 3, padding=1, **kw), act4=_act(), pool4=nn.MaxPool2d(3, 2),
        flatten=nn.Flatten(),
    )
    flat = _flat_size(nn.Sequential(feats), input_shape)
    feats.update(
        dense1=BayesLinear(flat, 120, **kw), act5=_act(),
        dense2=BayesLinear(120, 84, **kw), act6=_act(),
        dense3=BayesLinear(84, num_classes, **kw),
    )
    return nn.Sequential(feats)


def lenet5(input_shape: Sequence[int], num_classes: int, sigma_mode: SigmaMode) -> nn.Sequential:
    """LeNet-5 (5x5 convolutions 6 and 16 channels, 2x2 max-pooling, dense 120-84-classes)."""
    c = int(input_shape[0])
    kw = {"sigma_mode": sigma_mode}
    feats = OrderedDict(
        conv1=BayesConv2d(c, 6, 5, padding=2, **kw), act1=_act(), pool1=nn.MaxPool2d(2),
        conv2=BayesConv2d(6, 16, 5, **kw), act2=_act(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(),
    )
    flat = _flat_size(nn.Sequential(feats), input_shape)
    feats.update(
        dense1=BayesLinear(flat, 120, **kw), act3=_act(),
        dense2=BayesLinear(120, 84, **kw), act4=_act(),
        dense3=BayesLinear(84, num_classes, **kw),
    )
    return nn.Sequential(feats)


def mlp(input_shape: Sequence[int], num_classes: int, sigma_mode: SigmaMode, hidden: Sequence[int]) -> nn.Sequential:
    """Multi-layer perceptron on the flattened input, leaky ReLU(0.1) between layers."""
    sizes = [int(torch.tensor(input_shape).prod()), *map(int, hidden), num_classes]
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True), start=1):
        layers[f"dense{i}"] = BayesLinear(fan_in, fan_out, sigma_mode=sigma_mode)
        if i < len(sizes) - 1:
            layers[f"act{i}"] = _act()
    return nn.Sequential(layers)


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    sigma_mode: str = "layer",
    sigma_init_ratio: float = 0.1,
    hidden: Sequence[int] = (200, 100),
    seed: int = 0,
) -> nn.Sequential:
    """Build a model with seeded initialisation. Each layer's sigma starts at
    ``sigma_init_ratio`` times the layer's initial weight std.

    ``sigma_mode``: "layer" (one sigma per layer, the default), "weight" (one per weight), or "client"
    (the paper's single sigma shared by every layer: one Parameter tied across layers, started at
    ``sigma_init_ratio`` times the mean of the layers' weight std)."""
    if name != "mlp" and len(input_shape) != 3:
        raise ValueError(f"model {name!r} needs image input (C, H, W), got input shape {tuple(input_shape)}")
    torch.manual_seed(seed)
    layer_mode: SigmaMode = "layer" if sigma_mode == "client" else sigma_mode
    if name == "alexnet-small":
        model = alexnet_small(input_shape, num_classes, layer_mode)
    elif name == "lenet5":
        model = lenet5(input_shape, num_classes, layer_mode)
    elif name == "mlp":
        model = mlp(input_shape, num_classes, layer_mode, hidden)
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    layers = [layer for _, layer in bayesian_layers(model)]
    with torch.no_grad():
        for layer in layers:
            layer.sigma_param.fill_(softplus_inverse(sigma_init_ratio * layer_scale(layer)))
    if sigma_mode == "client":
        shared = nn.Parameter(torch.tensor(softplus_inverse(
            sigma_init_ratio * sum(layer_scale(la) for la in layers) / len(layers))))
        for layer in layers:
            layer.sigma_param = shared  # one Parameter object: one gradient, one value for every layer
    return model


def layer_scale(layer: BayesianLayer) -> float:
    """s_l of SPEC 2: the std of the layer's initial mean weights.

    Summed exactly (math.fsum): a torch or numpy reduction depends on the thread count and memory
    alignment in its last bit, and s_l sets the prior, so a resumed run must get the very same value."""
    w = layer.weight_mu.detach().double().reshape(-1).tolist()
    mean = math.fsum(w) / len(w)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in w) / max(len(w) - 1, 1))
