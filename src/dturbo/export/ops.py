"""The ops of an exported network: the vocabulary of the built-in format (versions 1-3), a built-in model as a
list of :class:`Op` with its effective weights ``weight_mu * mask``, and a list of ops as ``torch.nn`` modules again
(the network :func:`dturbo.export.load` runs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import as_pair, dense_linear
from .format import FORMAT, SPEC_FILE, VERSION, ExportError, stored_tensor

PARAM_TYPES = ("conv2d", "linear")
# Elementwise activations, called as ``fn(x, **attrs)``: a unit that is constant before one is constant after it
# (the value compaction computes for it), so compaction carries units across them.
ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "relu": F.relu, "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh, "elu": F.elu, "gelu": F.gelu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
}
# Ops between two layers that act on each unit (channel) alone and keep a constant unit constant.
CHANNELWISE = (*ACTIVATIONS, "maxpool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "flatten")
# The ops of the built-in (version 1-3) format.
OP_TYPES = (*PARAM_TYPES, "leaky_relu", "relu", "maxpool2d", "adaptive_avg_pool2d", "flatten", "group_norm",
             "input_select")



@dataclass
class Op:
    """One operation of the exported network: its JSON attributes and (for conv/linear) its tensors."""

    type: str
    name: str
    attrs: dict[str, Any] = field(default_factory=dict)
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    index: torch.Tensor | None = None  # input_select: kept input positions (int64)
    bias_map: torch.Tensor | None = None  # conv2d: per-position bias (out, H_out, W_out) of folded channels


@dataclass
class Exported:
    """An exported network in memory: its operations plus statistics per parametric layer."""

    ops: list[Op]
    input_shape: tuple[int, ...]
    num_classes: int
    layers: list[dict[str, Any]]
    source: dict[str, Any] = field(default_factory=dict)
    # The reader's normalisation (dturbo.data.Dataset.input_norm), so load(..., inputs="raw") can apply it;
    # None when unknown.
    input_norm: dict[str, Any] | None = None

    def spec(self) -> dict[str, Any]:
        """The JSON description (everything but the tensors)."""
        ops = []
        for op in self.ops:
            entry = {"type": op.type, "name": op.name, **op.attrs}
            if op.type in PARAM_TYPES:
                entry["bias"] = op.bias is not None
            if op.bias_map is not None:
                entry["bias_map"] = True
            ops.append(entry)
        total_before = sum(r["params_before"] for r in self.layers)
        total_after = sum(r["params_after"] for r in self.layers)
        nonzeros = sum(r["nonzeros"] for r in self.layers)
        return {
            "format": FORMAT, "version": VERSION, "source": self.source, "input_shape": list(self.input_shape),
            "num_classes": self.num_classes, "input_norm": self.input_norm, "ops": ops, "layers": self.layers,
            "totals": {"weights_before": total_before, "weights_after": total_after, "nonzeros": nonzeros,
                       "density_before": nonzeros / max(total_before, 1),
                       "density_after": nonzeros / max(total_after, 1)},
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to store, named ``<op>.weight``, ``<op>.bias``, ``<op>.index``, ``<op>.bias_map``."""
        out: dict[str, torch.Tensor] = {}
        for op in self.ops:
            for key in ("weight", "bias", "index", "bias_map"):
                t = getattr(op, key)
                if t is not None:
                    out[f"{op.name}.{key}"] = t.detach().contiguous().clone()
        return out


# ------------------------------------------------------------------------------------------- model -> ops
def built_in_layout(model_name: str, input_shape: tuple[int, ...], num_classes: int, *,
            hidden: list[int] | tuple[int, ...], width: float) -> nn.Module:
    """The built-in model ``model_name``'s architecture (its initial weights are not used; the caller's torch RNG
    is left as it was)."""
    from ..nn import models

    try:
        with torch.random.fork_rng(devices=[]):
            return models.build_model(model_name, input_shape, num_classes, hidden=hidden, width=width)
    except ValueError as err:
        raise ExportError(f"unknown model layout: {err}") from None


def ops_from_state(
    model_name: str, state: dict[str, torch.Tensor], input_shape: tuple[int, ...], num_classes: int, *,
    hidden: list[int] | tuple[int, ...] = (200, 100), width: float = 1.0,
) -> list[Op]:
    """The operations of model ``model_name`` with effective weights ``weight_mu * mask`` from ``state``: see
    :func:`ops_from_model` (the architecture comes from :func:`dturbo.nn.models.build_model`)."""
    model = built_in_layout(model_name, tuple(input_shape), num_classes, hidden=hidden, width=width)
    return ops_from_model(model, state, model_name, input_shape=tuple(input_shape))


def ops_from_model(model: nn.Module, state: dict[str, torch.Tensor], model_name: str = "", *,
                   input_shape: tuple[int, ...] | None = None) -> list[Op]:
    """The operations of the built-in model ``model`` (an ``nn.Sequential``, as :func:`dturbo.nn.models.build_model`
    makes it, for samples of ``input_shape``, by default the one it records) with effective weights
    ``weight_mu * mask`` from ``state``: every Bayesian layer's ``weight_mu`` (and ``bias``) must be in ``state``
    with its shape; a missing ``mask`` counts as all ones. The model's own weights are not used."""
    from ..nn.bayes import BayesConv2d, BayesLinear

    model_name = model_name or type(model).__name__
    ops: list[Op] = []
    model.eval()
    shape = input_shape if input_shape is not None else model.input_shape
    x = torch.zeros(1, *shape)  # traced for the spatial size at each convolution's input
    for name, m in model.named_children():
        h_w = [int(s) for s in x.shape[-2:]]
        with torch.no_grad():
            x = m(x)
        if isinstance(m, BayesConv2d | BayesLinear):
            w, b = _effective(name, m, state)
            if isinstance(m, BayesConv2d):
                attrs = {"in_channels": m.in_channels, "out_channels": m.out_channels,
                         "kernel_size": m.kernel_size, "stride": m.stride, "padding": m.padding,
                         "groups": m.groups, "input_hw": h_w}
                ops.append(Op("conv2d", name, attrs, w, b))
            else:
                ops.append(Op("linear", name, {"in_features": m.in_features, "out_features": m.out_features}, w, b))
        elif isinstance(m, nn.LeakyReLU):
            ops.append(Op("leaky_relu", name, {"negative_slope": float(m.negative_slope)}))
        elif isinstance(m, nn.ReLU):
            ops.append(Op("relu", name))
        elif isinstance(m, nn.MaxPool2d):
            ops.append(Op("maxpool2d", name, {"kernel_size": m.kernel_size, "stride": m.stride,
                                             "padding": m.padding, "dilation": m.dilation,
                                             "ceil_mode": bool(m.ceil_mode)}))
        elif isinstance(m, nn.AdaptiveAvgPool2d):
            ops.append(Op("adaptive_avg_pool2d", name, {"output_size": m.output_size}))
        elif isinstance(m, nn.Flatten) and m.start_dim == 1 and m.end_dim == -1:
            ops.append(Op("flatten", name))
        elif isinstance(m, nn.GroupNorm) and not m.affine:
            ops.append(Op("group_norm", name, {"num_groups": m.num_groups, "num_channels": m.num_channels,
                                              "eps": float(m.eps)}))
        else:
            raise ExportError(f"unknown model layout: layer {name!r} of model {model_name!r} is a "
                              f"{type(m).__name__}, which export does not support")
    return ops


def _effective(name: str, layer: nn.Module, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = tuple(layer.weight_mu.shape)
    mu = state.get(f"{name}.weight_mu")
    if mu is None:
        raise ExportError(f"the model file has no tensor '{name}.weight_mu': it does not match the model layout")
    if tuple(mu.shape) != shape:
        raise ExportError(f"'{name}.weight_mu' has shape {tuple(mu.shape)}, the model layout needs {shape}")
    mask = state.get(f"{name}.mask")
    if mask is not None and tuple(mask.shape) != shape:
        raise ExportError(f"'{name}.mask' has shape {tuple(mask.shape)}, the model layout needs {shape}")
    bias = None
    if layer.bias is not None:
        bias = state.get(f"{name}.bias")
        if bias is None:
            raise ExportError(f"the model file has no tensor '{name}.bias': it does not match the model layout")
        if tuple(bias.shape) != (shape[0],):
            raise ExportError(f"'{name}.bias' has shape {tuple(bias.shape)}, the model layout needs {(shape[0],)}")
    return masked_weights(name, mu, mask, bias)


def masked_weights(name: str, mu: torch.Tensor, mask: torch.Tensor | None,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The effective float32 weight ``mu * mask`` (no mask: ``mu``; -0.0 made 0.0) and a copy of the bias;
    :class:`ExportError` when either holds NaN or Inf."""
    w = mu.detach().float() if mask is None else mu.detach().float() * mask.detach().float()
    w = torch.where(w == 0, torch.zeros_like(w), w)  # -0.0 -> 0.0
    if bias is not None:
        bias = bias.detach().float().clone()
    for t, what in ((w, "weight_mu * mask"), (bias, "bias")):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ExportError(f"layer {name!r}: {what} holds NaN or Inf values")
    return w.contiguous(), bias


# ------------------------------------------------------------------------------------------- ops -> modules
class IndexSelect(nn.Module):
    """Keep positions ``index`` of dimension ``dim`` of the input."""

    def __init__(self, index: torch.Tensor, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("index", index.to(torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(self.dim, self.index)


class BiasMap(nn.Module):
    """Add a per-position bias ``(C, H, W)``: the exact contribution of constant channels folded into a padded
    convolution (see the module docstring).

    It adds in place: its input is always the fresh output of the convolution before it (nothing else holds it,
    and a convolution's backward does not read its output), and a new batch-sized tensor costs more than the add
    itself. The map is held as ``(1, C, H, W)`` in the input's memory format (:meth:`set_memory_format`): a
    channels_last input plus a map in the other layout is several times slower."""

    def __init__(self, bias_map: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("bias_map", bias_map.float().unsqueeze(0))

    def set_memory_format(self, fmt: torch.memory_format) -> None:
        self.bias_map = self.bias_map.contiguous(memory_format=fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.bias_map)


def conv_output_shape(entry: dict[str, Any]) -> tuple[int, int, int]:
    """(out_channels, H_out, W_out) of a conv2d entry with ``input_hw`` (dilation 1)."""
    (h, w), (kh, kw), (sh, sw), (ph, pw) = (as_pair(entry[k]) for k in ("input_hw", "kernel_size", "stride", "padding"))
    return int(entry["out_channels"]), (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1



def build_net(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[nn.Sequential, list[tuple]]:
    """The eager network with dense linear layers, and (name, weight, bias) of each linear layer."""
    mods: dict[str, nn.Module] = {}
    linears = []
    if not isinstance(spec["ops"], list) or not all(isinstance(e, dict) for e in spec["ops"]):
        raise ExportError(f"{SPEC_FILE}: 'ops' must be a list of objects")
    for entry in spec["ops"]:
        t, name = entry.get("type"), entry.get("name")
        if t not in OP_TYPES or not isinstance(name, str) or name in mods:
            raise ExportError(f"{SPEC_FILE}: unknown or duplicate operation {t!r} named {name!r}")
        try:
            if t == "conv2d":
                cin, cout, k, g = entry["in_channels"], entry["out_channels"], entry["kernel_size"], entry["groups"]
                ks = tuple(k) if isinstance(k, list) else (k, k)
                w = stored_tensor(tensors, f"{name}.weight", (cout, cin // g, *ks))
                conv = nn.Conv2d(cin, cout, ks, stride=entry["stride"], padding=entry["padding"], groups=g,
                                 bias=entry["bias"])
                with torch.no_grad():
                    conv.weight.copy_(w)
                    if entry["bias"]:
                        conv.bias.copy_(stored_tensor(tensors, f"{name}.bias", (cout,)))
                mods[name] = conv
                if entry.get("bias_map"):
                    map_name = f"{name}_bias_map"
                    if map_name in mods:
                        raise ExportError(f"{SPEC_FILE}: duplicate operation named {map_name!r}")
                    mods[map_name] = BiasMap(stored_tensor(tensors, f"{name}.bias_map", conv_output_shape(entry)))
            elif t == "linear":
                fi, fo = entry["in_features"], entry["out_features"]
                w = stored_tensor(tensors, f"{name}.weight", (fo, fi)).float()
                b = stored_tensor(tensors, f"{name}.bias", (fo,)).float() if entry["bias"] else None
                mods[name] = dense_linear(w, b)
                linears.append((name, w, b))
            elif t == "leaky_relu":
                mods[name] = nn.LeakyReLU(entry["negative_slope"])
            elif t == "relu":
                mods[name] = nn.ReLU()
            elif t == "maxpool2d":
                mods[name] = nn.MaxPool2d(entry["kernel_size"], entry["stride"], entry["padding"], entry["dilation"],
                                          ceil_mode=entry["ceil_mode"])
            elif t == "adaptive_avg_pool2d":
                mods[name] = nn.AdaptiveAvgPool2d(entry["output_size"])
            elif t == "flatten":
                mods[name] = nn.Flatten()
            elif t == "group_norm":
                mods[name] = nn.GroupNorm(entry["num_groups"], entry["num_channels"], eps=entry["eps"], affine=False)
            elif t == "input_select":
                mods[name] = IndexSelect(stored_tensor(tensors, f"{name}.index", None), entry["dim"])
        except ExportError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError, ArithmeticError, IndexError, AttributeError) as err:
            raise ExportError(f"{SPEC_FILE}: operation {name!r} ({t}) is malformed: {err!r}") from None
    return nn.Sequential(OrderedDict(mods)), linears


