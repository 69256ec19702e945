"""The networks of the experiments, built from Bayesian layers (docs/algorithm.md §10).

Every model is an ``nn.Sequential``; its Bayesian layers carry names that figures and configs use
(``conv1``..``conv4``, ``dense1``..``dense3`` for the downsized AlexNet). "Dense_2" of the paper's
Fig. 3 is our ``dense2`` (120 -> 84, grid 84 x 120).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ..config import ALEXNET_WIDTHS, ConfigError
from .bayes import BayesConv1d, BayesConv2d, BayesianLayer, BayesLinear, SigmaMode, bayesian_layers, softplus_inverse

MODEL_NAMES = ("alexnet-small", "lenet5", "mlp", "mobilenet-v1")


def _act() -> nn.Module:
    return nn.LeakyReLU(0.1)


class ModelInputError(ValueError):
    """The dataset's samples do not fit the model (e.g. images too small for its convolutions and poolings)."""


def _failing_layer(net: nn.Module, input_shape: Sequence[int]) -> tuple[str, str]:
    """(name, reason) of the first child of ``net`` that cannot take a zero sample of ``input_shape``."""
    x = torch.zeros(1, *input_shape)
    for name, m in net.named_children():
        shape = tuple(x.shape[1:])
        try:
            x = m(x)
        except RuntimeError as err:
            return name, f"{type(m).__name__} got a {'x'.join(map(str, shape))} input: {str(err).splitlines()[0]}"
    return "", ""


def _smallest_square(net: nn.Module, channels: int, limit: int = 512) -> int | None:
    """The smallest H = W that passes through ``net``, or None up to ``limit``."""
    for s in range(1, limit + 1):
        try:
            net(torch.zeros(1, channels, s, s))
        except RuntimeError:
            continue
        return s
    return None


def _input_error(model_name: str, net: nn.Module, input_shape: Sequence[int]) -> ModelInputError:
    """A message naming the model, the input size, the layer that failed and the smallest size that works."""
    training = net.training
    # Outside the seeded draws: a stochastic layer in training mode would draw noise from the global RNG.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        net.eval()
        layer, why = _failing_layer(net, input_shape)
        smallest = _smallest_square(net, int(input_shape[0])) if len(input_shape) == 3 else None
        net.train(training)
    size = "x".join(map(str, input_shape))
    msg = f"model {model_name!r} cannot take the dataset's {size} (C x H x W) inputs: they are too small"
    if layer:
        msg += f"; layer {layer!r} fails ({why})"
    if smallest is not None:
        msg += f". The smallest {input_shape[0]}-channel square input it takes is {smallest}x{smallest}"
    if model_name in MODEL_NAMES:
        return ModelInputError(msg + "; use larger images or a model for small inputs (model.name = 'mlp', "
                                     "or 'mobilenet-v1')")
    return ModelInputError(msg + "; use larger inputs, or a model whose layers fit them")


def _flat_size(features: nn.Module, input_shape: Sequence[int], model_name: str) -> int:
    with torch.no_grad():
        try:
            return int(features(torch.zeros(1, *input_shape)).numel())
        except RuntimeError:
            raise _input_error(model_name, features, input_shape) from None


class ModelOutputError(ValueError):
    """The model's output does not fit the data: not one logit per class."""


class ModelSizeError(ConfigError):
    """The configured model cannot fit in this machine's memory."""


# What a run holds per parameter of its model, at most, over the methods: the server's state in float64 (mu, sigma,
# the support's log-odds, the precision's two factors, the field) and the clients' float32 model, gradients and
# optimizer moments.
BYTES_PER_PARAMETER = 80


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(factory: Callable[[], nn.Module], model_name: str, available: int | None = None) -> None:
    """A ModelSizeError when the model ``factory`` builds cannot fit in memory: its parameters are counted on
    PyTorch's meta device (nothing is allocated) and a run needs about :data:`BYTES_PER_PARAMETER` bytes each.
    ``available``: the bytes there are (default :func:`available_memory`; unknown: no check). A model that cannot
    be built on the meta device is not checked here."""
    available = available_memory() if available is None else available
    if available is None:
        return
    try:
        with torch.device("meta"):
            probe = factory()
    except Exception:  # noqa: BLE001 -- a model of one's own may not build without real tensors; checked later
        return
    n = sum(p.numel() for p in probe.parameters())
    need = n * BYTES_PER_PARAMETER
    if need > available:
        raise ModelSizeError(
            f"model {model_name!r} has {n:,} parameters: a run needs about {need / 2**30:.1f} GiB "
            f"({BYTES_PER_PARAMETER} bytes a parameter), and {available / 2**30:.1f} GiB of memory is available; "
            f"make the model smaller (model.hidden, model.width)")


_FIRST = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.RNNBase, BayesianLayer)
ID_LAYERS = (nn.Embedding, nn.EmbeddingBag)  # a first layer of these takes integer ids
SERIES_LAYERS = (nn.Conv1d, BayesConv1d)  # a first layer of these takes N, C, L series


def first_layer(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the first layer with weights that ``model`` registers (the layer its inputs meet first in
    a model written in order), or None."""
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, _FIRST)), None)


def input_cause(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype) -> str | None:
    """What makes a model's first layer refuse the data, and the fix, when it is not their size: integer ids for a
    layer that takes floats or the reverse, or N, C, H, W images for a Conv1d; None otherwise."""
    first = first_layer(model)
    if first is None:
        return None
    name, layer = first
    kind = type(layer).__name__
    ids = not dtype.is_floating_point
    if isinstance(layer, ID_LAYERS) and not ids:
        return (f"its first layer {name!r} is an {kind}, which takes integer ids, and the inputs are {dtype} values: "
                f"give the ids as integers (int64)")
    if ids and not isinstance(layer, ID_LAYERS):
        return (f"the inputs are integers, read as ids ({dtype}), and its first layer {name!r} ({kind}) takes "
                f"floats: store the features as float32 (uint8 arrays are read as pixels)")
    if isinstance(layer, SERIES_LAYERS) and len(input_shape) == 3:
        size = "x".join(map(str, input_shape))
        return (f"its first layer {name!r} is a Conv1d, which takes N, C, L series, and the data were read as "
                f"N, C, H, W images of {size}: set data.layout = 'channels_first' to take the arrays as given")
    return None


def check_input_shape(model: nn.Module, input_shape: Sequence[int], model_name: str,
                      num_classes: int | None = None, dtype: torch.dtype = torch.float32) -> None:
    """A dry forward pass of one zero sample (of ``dtype``: int64 for ids) through ``model`` (in eval mode, no RNG
    draws, mode restored); raises :class:`ModelInputError` naming the model, the input size and the failing layer,
    and with ``num_classes`` :class:`ModelOutputError` when the output is not one logit per class."""
    training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            out = model(torch.zeros(1, *input_shape, dtype=dtype))
    except (RuntimeError, IndexError, TypeError) as err:
        cause = input_cause(model, input_shape, dtype)
        if cause is not None:
            raise ModelInputError(f"model {model_name!r} cannot take the dataset's inputs: {cause}") from None
        if not isinstance(err, RuntimeError):
            raise
        raise _input_error(model_name, model, input_shape) from None
    finally:
        model.train(training)
    if num_classes is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ModelOutputError(f"model {model_name!r} returns a {type(out).__name__}; dturbo needs a tensor of "
                               f"logits, one row per sample and one column per class ({num_classes})")
    if tuple(out.shape) != (1, num_classes):
        raise ModelOutputError(
            f"model {model_name!r} gives {int(out[0].numel()) if out.dim() else 1} output values per sample "
            f"(output shape {tuple(out.shape[1:])} for one sample), but the data has {num_classes} classes: its last "
            f"layer must have {num_classes} outputs")


def alexnet_small(input_shape: Sequence[int], num_classes: int, sigma_mode: SigmaMode,
                  widths: Sequence[int] = ALEXNET_WIDTHS) -> nn.Sequential:
    """The reference demo's "downsized AlexNet", channels-first: 'same' convolutions, 3/2 max-pooling
    without padding (as TF's default 'valid' pooling), leaky ReLU(0.1) after every layer but the last.
    32x32x3 input gives the paper's 576 -> 120 dense layer; 28x28x1 gives 256 -> 120. ``widths``: conv1-4's
    channels and dense1-2's units."""
    c = int(input_shape[0])
    c1, c2, c3, c4, d1, d2 = (int(w) for w in widths)
    kw = {"sigma_mode": sigma_mode}
    feats = OrderedDict(
        conv1=BayesConv2d(c, c1, 7, padding=3, **kw), act1=_act(), pool1=nn.MaxPool2d(3, 2),
        conv2=BayesConv2d(c1, c2, 5, padding=2, **kw), act2=_act(), pool2=nn.MaxPool2d(3, 2),
        conv3=BayesConv2d(c2, c3, 3, padding=1, **kw), act3=_act(),
        conv4=BayesConv2d(c3, c4, 3, padding=1, **kw), act4=_act(), pool4=nn.MaxPool2d(3, 2),
        flatten=nn.Flatten(),
    )
    flat = _flat_size(nn.Sequential(feats), input_shape, "alexnet-small")
    feats.update(
        dense1=BayesLinear(flat, d1, **kw), act5=_act(),
        dense2=BayesLinear(d1, d2, **kw), act6=_act(),
        dense3=BayesLinear(d2, num_classes, **kw),
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
    flat = _flat_size(nn.Sequential(feats), input_shape, "lenet5")
    feats.update(
        dense1=BayesLinear(flat, 120, **kw), act3=_act(),
        dense2=BayesLinear(120, 84, **kw), act4=_act(),
        dense3=BayesLinear(84, num_classes, **kw),
    )
    return nn.Sequential(feats)


# MobileNetV1 (Howard et al. 2017) for 32x32 inputs: (output channels, stride) of the 13 depthwise-separable
# blocks; the first convolution has stride 1 (CIFAR variant) instead of 2 (ImageNet).
MOBILENET_BLOCKS = ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
                    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1))


def _norm(channels: int) -> nn.Module:
    # Normalisation without parameters or running statistics: every trained parameter is then a weight or a
    # bias of a Bayesian layer and travels in the messages (BatchNorm's statistics would need an aggregation
    # rule of their own in federated training).
    return nn.GroupNorm(min(32, channels), channels, affine=False)


def mobilenet_v1(
    input_shape: Sequence[int], num_classes: int, sigma_mode: SigmaMode, width: float = 1.0
) -> nn.Sequential:
    """MobileNetV1 with width multiplier ``width``: conv 3x3, 13 blocks of depthwise 3x3 (grid C x 9, §2)
    + pointwise 1x1 convolutions, each followed by GroupNorm and ReLU, global average pooling, one dense layer.
    Layer names: ``conv1``, ``dw1``/``pw1`` .. ``dw13``/``pw13``, ``dense1``."""
    kw = {"sigma_mode": sigma_mode}

    def ch(c: int) -> int:
        return max(8, int(round(c * width)))

    c_in = ch(32)
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=BayesConv2d(int(input_shape[0]), c_in, 3, padding=1, **kw), norm1=_norm(c_in), act1=nn.ReLU(),
    )
    for i, (c, stride) in enumerate(MOBILENET_BLOCKS, start=1):
        c_out = ch(c)
        layers[f"dw{i}"] = BayesConv2d(c_in, c_in, 3, stride=stride, padding=1, groups=c_in, **kw)
        layers[f"dw{i}_norm"], layers[f"dw{i}_act"] = _norm(c_in), nn.ReLU()
        layers[f"pw{i}"] = BayesConv2d(c_in, c_out, 1, **kw)
        layers[f"pw{i}_norm"], layers[f"pw{i}_act"] = _norm(c_out), nn.ReLU()
        c_in = c_out
    layers.update(pool=nn.AdaptiveAvgPool2d(1), flatten=nn.Flatten(), dense1=BayesLinear(c_in, num_classes, **kw))
    return nn.Sequential(layers)


def mlp(input_shape: Sequence[int], num_classes: int, sigma_mode: SigmaMode, hidden: Sequence[int]) -> nn.Sequential:
    """Multi-layer perceptron on the flattened input, leaky ReLU(0.1) between layers."""
    sizes = [math.prod(int(d) for d in input_shape), *map(int, hidden), num_classes]
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
    width: float = 1.0,
    widths: Sequence[int] | None = None,
    seed: int = 0,
) -> nn.Sequential:
    """Build a model with seeded initialisation. Each layer's sigma starts at
    ``sigma_init_ratio`` times the layer's initial weight std.

    ``sigma_mode``: "layer" (one sigma per layer, the default), "weight" (one per weight), or "client"
    (the paper's single sigma shared by every layer: one Parameter tied across layers, started at
    ``sigma_init_ratio`` times the mean of the layers' weight std). ``width``: MobileNet's width multiplier;
    ``widths``: alexnet-small's layer widths."""
    if name != "mlp" and len(input_shape) != 3:
        raise ValueError(f"model {name!r} needs image input (C, H, W), got input shape {tuple(input_shape)}")
    torch.manual_seed(seed)
    layer_mode: SigmaMode = "layer" if sigma_mode == "client" else sigma_mode
    if name == "alexnet-small":
        model = alexnet_small(input_shape, num_classes, layer_mode, widths or ALEXNET_WIDTHS)
    elif name == "lenet5":
        model = lenet5(input_shape, num_classes, layer_mode)
    elif name == "mlp":
        model = mlp(input_shape, num_classes, layer_mode, hidden)
    elif name == "mobilenet-v1":
        model = mobilenet_v1(input_shape, num_classes, layer_mode, width)
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    init_sigmas(model, sigma_mode, sigma_init_ratio)
    model.input_shape = tuple(int(d) for d in input_shape)  # one sample's shape: what layer costs are counted on
    return model


def init_sigmas(model: nn.Module, sigma_mode: str, sigma_init_ratio: float) -> None:
    """Start every Bayesian layer's sigma at ``sigma_init_ratio`` times the layer's initial weight std s_l
    (:func:`layer_scale`). ``sigma_mode = "client"``: the paper's single sigma, one Parameter tied across the layers,
    started at ``sigma_init_ratio`` times the mean of their s_l (docs/algorithm.md §3)."""
    layers = [layer for _, layer in bayesian_layers(model)]
    if any(layer.weight_mu.is_meta for layer in layers):
        return  # built on the meta device to count its parameters (check_memory): no values to scale
    with torch.no_grad():
        for layer in layers:
            layer.sigma_param.fill_(softplus_inverse(sigma_init_ratio * layer_scale(layer)))
    if sigma_mode == "client":
        shared = nn.Parameter(torch.tensor(softplus_inverse(
            sigma_init_ratio * sum(layer_scale(la) for la in layers) / len(layers))))
        for layer in layers:
            layer.sigma_param = shared  # one Parameter object: one gradient, one value for every layer


def record_input_shape(model: nn.Module, input_shape: Sequence[int]) -> None:
    """Record one sample's shape on ``model`` where it records none (no ``input_shape``, ``None`` or an empty shape):
    what a layer's compute and the graph that ``dead_units = "cut"`` reads are taken on. A shape the model records
    is kept: the user's own."""
    if not getattr(model, "input_shape", None):
        model.input_shape = tuple(int(d) for d in input_shape)


def weight_uses(model: nn.Module, input_shape: Sequence[int] | None = None) -> dict[str, int]:
    """Multiply-adds each weight of every Bayesian layer does for one sample: the output positions of a
    convolution (H_out x W_out), 1 for a dense layer. A layer's share of the model's compute is its weight count
    times this (the cost that ``sparsity.budget = "flops"`` counts). ``input_shape`` defaults to the shape
    :func:`build_model` recorded on the model."""
    shape = input_shape if input_shape is not None else getattr(model, "input_shape", None)
    if not shape:
        raise ValueError("the model's input shape is unknown: pass input_shape (one sample's shape, e.g. (1, 28, 28))")
    uses: dict[str, int] = {}
    hooks = []
    for name, layer in bayesian_layers(model):
        def record(module: nn.Module, args: tuple, out: torch.Tensor, name: str = name) -> None:
            uses[name] = int(out[0, 0].numel())  # positions of one output channel (1 for a dense layer)
        hooks.append(layer.register_forward_hook(record))
    try:
        with torch.no_grad():
            was_training = model.training
            model.eval()
            model(torch.zeros(1, *shape))
            model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    return uses


def layer_scale(layer: BayesianLayer) -> float:
    """s_l of docs/algorithm.md §2: the std of the layer's initial mean weights.

    Summed exactly (math.fsum): a torch or numpy reduction depends on the thread count and memory
    alignment in its last bit, and s_l sets the prior, so a resumed run must get the very same value."""
    w = layer.weight_mu.detach().double().reshape(-1).tolist()
    mean = math.fsum(w) / len(w)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in w) / max(len(w) - 1, 1))
