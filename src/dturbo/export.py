"""Export a run's global model as a compact inference model, and load it back (issue 4).

``dturbo export RUN --out MODEL`` reads ``RUN/config.toml`` and ``RUN/model.safetensors`` and writes
``MODEL/model.safetensors`` (tensors) and ``MODEL/model.json`` (the layer list, shapes, statistics): no pickle
and no training code. :func:`load` turns them into an ordinary :class:`torch.nn.Module` in eval mode made of
``torch.nn`` layers (plus the sparse kernels of :mod:`dturbo.kernels` where they are faster).

What export does to the weights (the effective weight is ``weight_mu * mask``; exact zeros count as pruned):

* **Compaction across layers.** Between two layers joined only by channel-wise operations (activation,
  max-pooling, adaptive average pooling, flatten), a unit (conv channel or dense neuron) is removed from both
  when

  - the next layer does not use it (its input columns, or the ``H*W`` columns of a flattened channel, or its
    conv input channel, are all zero): removing it changes nothing; or
  - its own weights are all zero: it is then the constant ``act(bias)`` everywhere (max-pooling or average
    pooling a constant gives that constant), and its contribution is folded into the next layer: into its
    bias for a dense layer or an unpadded convolution; for a padded convolution the contribution is not
    uniform at the borders, so it goes into a per-position bias map ``(out, H, W)`` of that layer (stored as
    ``<op>.bias_map``, added after the convolution; exact as well).

  This is repeated until nothing changes, so removals travel forward and backward through the network. Input
  features (or channels) that the first layer never uses are dropped by an index selection at the input.
  The logits (last layer's rows) are never removed. Grouped convolutions and normalisation layers stop the
  propagation (a channel feeds a group statistic there), so e.g. MobileNet is exported dense apart from this.
* **In-layer sparsity** that remains in a dense layer is handled at :func:`load` time: per layer, a short
  timing at the batch size in use picks a block-sparse, "panel" or CSR kernel where it beats dense
  (:func:`dturbo.kernels.choose_linear_kernel`). Convolutions stay dense (im2col + sparse matmul never wins on
  CPU), but each is run by oneDNN or by PyTorch's native kernels, whichever a timing on its real input finds
  faster (oneDNN is slow for thin layers, e.g. a first layer on one-channel images or a layer cut down to
  a few channels). Max-pooling layers run PyTorch's kernel or strided elementwise maxima (the same values),
  whichever a timing on the real input finds faster (PyTorch's is slow for few channels). ``channels_last`` and
  ``torch.compile`` are used where a timing shows they help, and can be forced on or off. Every choice is
  recorded in the loaded model (``kernels``, ``pools``, ``info``).

The exported model computes the masked dense model's function: outputs agree to float rounding.

Any other model (one's own, with residual additions, concatenations, BatchNorm, ...) is exported by
:func:`export_model` as a graph (:mod:`dturbo.export_graph`, format version 4), with this module's compaction
mechanics on the links of the graph that allow it; :func:`load` reads both formats.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_tensors
from torch import nn

from .checkpoint import atomic_write_bytes
from .kernels import (
    CONV_KERNELS,
    KERNELS,
    POOL_KERNELS,
    as_pair,
    choose_conv_kernel,
    choose_linear_kernel,
    choose_pool_kernel,
    conv_as,
    dense_linear,
    make_linear,
    pool_as,
    separable_supported,
    time_call,
)
from .rundir import RunDir, RunDirError, classifier_rows

FORMAT = "dturbo-export"
# 2: conv2d ops may carry a ``bias_map``; 3: ``input_norm`` (the dataset's input normalisation, or null).
# Older files are read as well (they take normalised inputs only). The built-in models are written as 3.
# 4: any model, as a graph of ops (:mod:`dturbo.export_graph`, written by ``export_model``).
VERSION = 3
GRAPH_VERSION = 4
READS_VERSIONS = (1, 2, 3, GRAPH_VERSION)
INPUTS = ("normalised", "raw")
WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "model.json"
# Drop unused input features only when that removes at least this fraction (the gather costs a copy).
MIN_INPUT_DROP = 0.05

_PARAM_TYPES = ("conv2d", "linear")
# Elementwise activations, called as ``fn(x, **attrs)``: a unit that is constant before one is constant after it
# (the value :func:`_constant` computes), so compaction carries units across them.
ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "relu": F.relu, "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh, "elu": F.elu, "gelu": F.gelu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
}
# Ops between two layers that act on each unit (channel) alone and keep a constant unit constant.
_CHANNELWISE = (*ACTIVATIONS, "maxpool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "flatten")
# The ops of the built-in (version 1-3) format.
_OP_TYPES = (*_PARAM_TYPES, "leaky_relu", "relu", "maxpool2d", "adaptive_avg_pool2d", "flatten", "group_norm",
             "input_select")


class ExportError(ValueError):
    """A run directory or an exported model cannot be read or has a layout export does not know."""


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
            if op.type in _PARAM_TYPES:
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


# ----------------------------------------------------------------------------------------------- reading a run
def read_run(run_dir: str | Path) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """(config, model tensors, metadata) of a run directory; :class:`ExportError` naming the problem."""
    run = RunDir(run_dir)
    try:
        cfg = run.config()
        state, meta = run.read_model()
    except RunDirError as err:
        raise ExportError(str(err)) from None
    return cfg, state, meta


def _read_safetensors(path: Path, *, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise ExportError(f"{what} {path} is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ExportError(f"{what} {path} is corrupt or not a safetensors file: {err}") from None
    return state, meta


# ------------------------------------------------------------------------------------------- model -> ops
def _layout(model_name: str, input_shape: tuple[int, ...], num_classes: int, *,
            hidden: list[int] | tuple[int, ...], width: float) -> nn.Module:
    """The built-in model ``model_name``'s architecture (its initial weights are not used; the caller's torch RNG
    is left as it was)."""
    from .nn import models

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
    model = _layout(model_name, tuple(input_shape), num_classes, hidden=hidden, width=width)
    return ops_from_model(model, state, model_name, input_shape=tuple(input_shape))


def ops_from_model(model: nn.Module, state: dict[str, torch.Tensor], model_name: str = "", *,
                   input_shape: tuple[int, ...] | None = None) -> list[Op]:
    """The operations of the built-in model ``model`` (an ``nn.Sequential``, as :func:`dturbo.nn.models.build_model`
    makes it, for samples of ``input_shape``, by default the one it records) with effective weights
    ``weight_mu * mask`` from ``state``: every Bayesian layer's ``weight_mu`` (and ``bias``) must be in ``state``
    with its shape; a missing ``mask`` counts as all ones. The model's own weights are not used."""
    from .nn.bayes import BayesConv2d, BayesLinear

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


# ------------------------------------------------------------------------------------------------ compaction
def _units_view(op: Op, units: int) -> torch.Tensor:
    """The consumer's weight as (out, units, per-unit) for its input units."""
    w = op.weight
    assert w is not None
    return w.reshape(w.shape[0], units, -1)


def _constant(bias: torch.Tensor | None, between: list[Op], units: int) -> torch.Tensor:
    """The value a unit with all-zero weights takes after the channel-wise ops ``between``."""
    c = torch.zeros(units) if bias is None else bias.clone()
    for op in between:
        if op.type in ACTIVATIONS:
            c = ACTIVATIONS[op.type](c, **op.attrs)
    return c


def _link_units(prod: Op, cons: Op, between: list[Op]) -> int | None:
    """How many units join producer and consumer, or None when units cannot be carried across."""
    if any(op.type not in _CHANNELWISE for op in between):
        return None
    if prod.type == "conv2d" and prod.attrs["groups"] != 1:
        return None
    if cons.type == "conv2d" and cons.attrs["groups"] != 1:
        return None
    assert prod.weight is not None and cons.weight is not None
    units = int(prod.weight.shape[0])
    flatten = any(op.type == "flatten" for op in between)
    if cons.type == "conv2d":
        if prod.type != "conv2d" or flatten or cons.weight.shape[1] != units:
            return None
    elif prod.type == "conv2d" and not flatten:
        return None
    elif cons.weight.shape[1] % units:
        return None
    return units


def _absorbs_constants(cons: Op) -> bool:
    """Whether a constant input unit adds the same to every output position of ``cons`` (no padding)."""
    if cons.type == "linear":
        return True
    pad = cons.attrs["padding"]
    return pad == "valid" or pad == 0 or (isinstance(pad, list | tuple) and not any(pad))


def _constant_contribution(cons: Op, weight: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
    """What input channels holding the constants ``const`` add to padded convolution ``cons``'s output, per
    position: (out, H_out, W_out). ``weight`` is ``cons``'s weight restricted to those channels."""
    h, w = cons.attrs["input_hw"]
    image = const.reshape(1, -1, 1, 1).expand(1, const.numel(), h, w)
    out = F.conv2d(image.double(), weight.double(), stride=cons.attrs["stride"], padding=cons.attrs["padding"])
    return out[0].float()


def _compact_link(prod: Op, cons: Op, between: list[Op], units: int) -> bool:
    """Remove the removable units between ``prod`` and ``cons``; True if any was removed."""
    assert prod.weight is not None and cons.weight is not None
    cview = _units_view(cons, units)
    unused = ~(cview != 0).any(2).any(0)
    zero_rows = ~(prod.weight.reshape(units, -1) != 0).any(1)
    if prod.bias_map is not None:  # such a unit is constant only where its bias map is zero
        zero_rows &= ~(prod.bias_map.reshape(units, -1) != 0).any(1)
    const = _constant(prod.bias, between, units)
    remove = unused | zero_rows  # a constant unit is folded into cons: its bias, or a padded conv's bias map
    if bool(remove.all()):  # keep one unit: zero-width layers are not worth the special cases
        remove[0] = False
    if not bool(remove.any()):
        return False
    fold = remove & ~unused & (const != 0)
    if bool(fold.any()):
        if _absorbs_constants(cons):
            contrib = (cview[:, fold].sum(2) * const[fold]).sum(1)
            cons.bias = contrib if cons.bias is None else cons.bias + contrib
        else:
            contrib = _constant_contribution(cons, cons.weight[:, fold], const[fold])
            cons.bias_map = contrib if cons.bias_map is None else cons.bias_map + contrib
    keep = ~remove
    prod.weight = prod.weight[keep].contiguous()
    if prod.bias is not None:
        prod.bias = prod.bias[keep].contiguous()
    if prod.bias_map is not None:
        prod.bias_map = prod.bias_map[keep].contiguous()
    new = cview[:, keep]
    cons.weight = (new.reshape(cons.weight.shape[0], -1) if cons.type == "linear"
                   else new.reshape(cons.weight.shape[0], int(keep.sum()), *cons.weight.shape[2:])).contiguous()
    return True


def compact(ops: list[Op]) -> list[Op]:
    """Remove units across layers until nothing changes (see the module docstring); returns the new ops
    (the given ones are modified in place), with an ``input_select`` op where the first layer's unused
    inputs are dropped, and each op's shape attributes updated."""
    params = [i for i, op in enumerate(ops) if op.type in _PARAM_TYPES]
    compact_links([(ops[a], ops[b], ops[a + 1 : b]) for a, b in zip(params[:-1], params[1:], strict=True)])
    out = _select_inputs(ops, params[0]) if params else ops
    update_shapes(out)
    return out


def compact_links(links: list[tuple[Op, Op, list[Op]]]) -> None:
    """Remove units across the links (producer, consumer, the ops between them) until nothing changes; a link
    whose ops between are not all channel-wise (or whose layers cannot carry units) is left alone."""
    links = [link for link in links if _link_units(*link) is not None]
    changed = True
    while changed:
        changed = False
        for prod, cons, between in links:
            units = _link_units(prod, cons, between)
            if units is not None and _compact_link(prod, cons, between, units):
                changed = True


def update_shapes(ops: list[Op]) -> None:
    """Set each conv2d / linear op's shape attributes from its (compacted) weight."""
    for op in ops:
        if op.type == "conv2d":
            assert op.weight is not None
            op.attrs["out_channels"] = int(op.weight.shape[0])
            op.attrs["in_channels"] = int(op.weight.shape[1]) * op.attrs["groups"]
        elif op.type == "linear":
            assert op.weight is not None
            op.attrs["out_features"], op.attrs["in_features"] = (int(s) for s in op.weight.shape)


def layer_stats(ops: list[Op], before: dict[str, tuple[tuple[int, ...], int]]) -> list[dict[str, Any]]:
    """Per conv2d / linear op: shape and size before (``before[name]``) and after compaction, nonzeros, density."""
    layers = []
    for op in ops:
        if op.weight is None:
            continue
        shape0, numel0 = before[op.name]
        nnz = int((op.weight != 0).sum())
        layers.append({
            "name": op.name, "type": op.type, "shape_before": list(shape0), "shape_after": list(op.weight.shape),
            "params_before": numel0, "params_after": int(op.weight.numel()), "nonzeros": nnz,
            "density_before": nnz / max(numel0, 1), "density_after": nnz / max(int(op.weight.numel()), 1),
        })
    return layers


def _select_inputs(ops: list[Op], first: int) -> list[Op]:
    """Drop input features (flat input) or channels (image input) that the first layer never uses."""
    op = ops[first]
    before = ops[:first]
    assert op.weight is not None
    if op.type == "conv2d":
        if before or op.attrs["groups"] != 1:
            return ops
        used = (op.weight != 0).any(0).any(-1).any(-1)
    else:
        if [o.type for o in before] not in ([], ["flatten"]):
            return ops
        used = (op.weight != 0).any(0)
    if not bool(used.any()):
        used[0] = True
    if float((~used).float().mean()) < MIN_INPUT_DROP:
        return ops
    index = torch.nonzero(used).flatten().to(torch.int64)
    op.weight = op.weight[:, used].contiguous()
    sel = Op("input_select", f"{op.name}_input", {"dim": 1, "size": int(used.numel())}, index=index)
    return [*before, sel, *ops[first:]]


# --------------------------------------------------------------------------------------------------- export
def export_state(
    model_name: str, state: dict[str, torch.Tensor], input_shape: tuple[int, ...], *, num_classes: int | None = None,
    hidden: list[int] | tuple[int, ...] = (200, 100), width: float = 1.0, compaction: bool = True,
    source: dict[str, Any] | None = None,
) -> Exported:
    """Export a model state (the keys of a run's ``model.safetensors``) of the built-in model ``model_name`` in
    memory; ``num_classes`` by default the rows of its classifier in ``state``.

    ``compaction=False`` keeps every unit (the masked dense network in the same module types, for
    comparisons)."""
    input_shape = tuple(int(s) for s in input_shape)
    if num_classes is None:
        probe = _layout(model_name, input_shape, 1, hidden=hidden, width=width)
        try:
            num_classes = classifier_rows(probe, state)
        except RunDirError as err:
            raise ExportError(str(err)) from None
    model = _layout(model_name, input_shape, num_classes, hidden=hidden, width=width)
    return export_ops(ops_from_model(model, state, model_name), input_shape, num_classes, compaction=compaction,
                      source=source)


def export_ops(ops: list[Op], input_shape: tuple[int, ...], num_classes: int, *, compaction: bool = True,
               source: dict[str, Any] | None = None) -> Exported:
    """The export of a built-in model's ``ops``: compacted (unless ``compaction=False``), with per-layer
    statistics."""
    before = {op.name: (tuple(op.weight.shape), int(op.weight.numel())) for op in ops if op.weight is not None}
    if compaction:
        ops = compact(ops)
    layers = layer_stats(ops, before)
    return Exported(ops, tuple(int(s) for s in input_shape), num_classes, layers, dict(source or {}))


def export_run(run_dir: str | Path, out_dir: str | Path | None = None, *, compaction: bool = True) -> Exported:
    """Export run ``run_dir``'s global model; write it to ``out_dir`` when given (see :func:`save`). The
    architecture is the run's own (:meth:`dturbo.rundir.RunDir.build_model`)."""
    cfg, state, meta = read_run(run_dir)
    model_name = meta.get("model", cfg.model.name)
    if model_name == "custom":
        raise ExportError(f"{run_dir} ran a model of one's own (dturbo.Experiment(model=...)), which export cannot "
                          f"rebuild from the run directory (it holds no code); export the model itself: "
                          f"result.export(OUT) on the ExperimentResult, or dturbo.export.export_model(model, OUT, "
                          f"example_input=...) (docs/library.md, 'Exporting your own model')")
    if model_name != cfg.model.name:
        raise ExportError(f"{run_dir}: model.safetensors holds a {model_name!r} but config.toml says "
                          f"{cfg.model.name!r}")
    source = {"run_dir": str(Path(run_dir).resolve()), "model": model_name,
              "dataset": meta.get("dataset", cfg.data.name), "algorithm": meta.get("algorithm", "")}
    run = RunDir(run_dir)
    try:
        model = run.build_model(cfg)
        input_shape, num_classes = run.architecture(cfg)
    except RunDirError as err:
        raise ExportError(str(err)) from None
    except ValueError as err:  # the builder's: the run's data does not fit its model
        raise ExportError(f"unknown model layout: {err}") from None
    exported = export_ops(ops_from_model(model, state, model_name), input_shape, num_classes,
                          compaction=compaction, source=source)
    exported.input_norm = _run_input_norm(run_dir, cfg, meta, input_shape)
    if out_dir is not None:
        save(exported, out_dir)
    return exported


def export_model(
    model: nn.Module, out_dir: str | Path | None = None, *, example_input: torch.Tensor, compaction: bool = True,
    input_norm: dict[str, Any] | None = None, source: dict[str, Any] | None = None,
) -> Any:
    """Export any model (a bayesianized model of one's own, a built-in one) as a graph, format version 4: see
    :func:`dturbo.export_graph.export_model` (this is it; it lives there to keep this module to the built-in
    format). Returns its :class:`dturbo.export_graph.ExportedGraph`."""
    from .export_graph import export_model as export_graph_model

    return export_graph_model(model, out_dir, example_input=example_input, compaction=compaction,
                              input_norm=input_norm, source=source)


def check_input_norm(norm: Any, input_shape: tuple[int, ...], where: str) -> dict[str, Any]:
    """``norm`` as :attr:`dturbo.data.Dataset.input_norm` describes it, for inputs of ``input_shape``."""
    n = int(input_shape[0])
    ok = (isinstance(norm, dict) and isinstance(norm.get("scale"), int | float) and norm["scale"] > 0
          and all(isinstance(norm.get(k), list) and len(norm[k]) == n
                  and all(isinstance(v, int | float) for v in norm[k]) for k in ("mean", "std"))
          and all(v > 0 for v in norm["std"]))
    if not ok:
        raise ExportError(f"{where}: input_norm must be {{scale > 0, mean: [{n} numbers], std: [{n} numbers > 0]}} "
                          f"for inputs of shape {list(input_shape)}, got {norm!r}")
    return {"raw_dtype": str(norm.get("raw_dtype", "")), "scale": float(norm["scale"]),
            "mean": [float(v) for v in norm["mean"]], "std": [float(v) for v in norm["std"]]}


def _run_input_norm(run_dir: str | Path, cfg: Any, meta: dict[str, str],
                    input_shape: tuple[int, ...]) -> dict[str, Any] | None:
    """The input normalisation of a run: stored by ``dturbo run`` in model.safetensors, else (older runs)
    computed again from the data as the run did (same reader, ``limit_train`` and seed); None when the data
    cannot be read."""
    if "input_norm" in meta:
        try:
            norm = json.loads(meta["input_norm"])
        except json.JSONDecodeError as err:
            raise ExportError(f"{run_dir}/model.safetensors: input_norm is not JSON ({err})") from None
        return check_input_norm(norm, input_shape, f"{run_dir}/model.safetensors")
    import warnings

    from .data import DataError, load_dataset

    try:
        with warnings.catch_warnings():  # label remarks were made when the run started
            warnings.simplefilter("ignore")
            ds = load_dataset(cfg.data.name, cfg.data.path, limit_train=cfg.data.limit_train, limit_test=1,
                              seed=cfg.experiment.seed)
    except (DataError, ValueError, OSError):
        return None
    if ds.input_shape != tuple(input_shape) or ds.input_norm is None:
        return None
    return check_input_norm(ds.input_norm, input_shape, f"data {cfg.data.name!r}")


def save(exported: Exported | Any, out_dir: str | Path) -> Path:
    """Write ``model.safetensors`` and ``model.json`` into ``out_dir`` (created; each file atomically). Any export
    with ``tensors()`` and ``spec()``: an :class:`Exported` or a :class:`dturbo.export_graph.ExportedGraph`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} names a file; --out must be a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / WEIGHTS_FILE, save_tensors(exported.tensors(), metadata={"format": FORMAT}))
    atomic_write_bytes(out / SPEC_FILE, (json.dumps(exported.spec(), indent=1) + "\n").encode())
    return out


# ----------------------------------------------------------------------------------------------------- load
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
    convolution (see the module docstring)."""

    def __init__(self, bias_map: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("bias_map", bias_map.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias_map


def _conv_output_shape(entry: dict[str, Any]) -> tuple[int, int, int]:
    """(out_channels, H_out, W_out) of a conv2d entry with ``input_hw`` (dilation 1)."""
    (h, w), (kh, kw), (sh, sw), (ph, pw) = (as_pair(entry[k]) for k in ("input_hw", "kernel_size", "stride", "padding"))
    return int(entry["out_channels"]), (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1


class InferenceModel(nn.Module):
    """An exported network: ``net`` (an :class:`torch.nn.Sequential` of torch layers, or for a graph export a
    :class:`dturbo.export_graph.GraphNet`) plus the execution
    settings chosen at load: ``kernels`` (per linear/conv layer), ``channels_last``, ``compiled``, and
    ``info`` (timings and reasons)."""

    def __init__(self, net: nn.Module, spec: dict[str, Any]) -> None:
        super().__init__()
        self.net = net
        self.spec = spec
        self.input_shape = tuple(spec["input_shape"])
        self.inputs = "normalised"  # what forward() takes: see set_inputs
        self.norm_mean: torch.Tensor | None
        self.norm_std: torch.Tensor | None
        self.register_buffer("norm_mean", None, persistent=False)  # set by set_inputs when the export has them
        self.register_buffer("norm_std", None, persistent=False)
        self.kernels: dict[str, str] = {}
        self.pools: dict[str, str] = {}  # max-pooling layer -> kernel (dturbo.kernels.POOL_KERNELS)
        self.channels_last = False
        self.compiled = False
        self.info: dict[str, Any] = {}
        self._compiled_fn: Any = None
        self._compiled_cache: Any = None
        self._conv_variants: dict[str, dict[str, nn.Module]] = {}

    def set_inputs(self, inputs: str) -> None:
        """``"normalised"``: the model takes inputs normalised as the dataset reader does (float32, what
        ``dturbo.data.load_dataset`` returns); ``"raw"``: it takes the data as stored and applies the stored
        normalisation itself (see :func:`load`)."""
        if inputs not in INPUTS:
            raise ValueError(f"inputs must be one of {', '.join(INPUTS)}, got {inputs!r}")
        norm = self.spec.get("input_norm")
        if inputs == "raw" and norm is None:
            raise ExportError(
                f"this export (format version {self.spec.get('version')}) does not store the input normalisation, "
                f"so it takes normalised inputs only (load it with inputs='normalised'); export the run again with "
                f"this dturbo, with its data readable, to store it")
        if norm is not None:
            # float64 as the reader computes it, so raw inputs give bit for bit the reader's float32 values
            view = (-1, 1, 1) if len(self.input_shape) == 3 else (-1,)
            mean = torch.tensor(norm["mean"], dtype=torch.float64).reshape(view)
            std = torch.tensor(norm["std"], dtype=torch.float64).reshape(view)
            device = next(iter(self.net.buffers()), next(iter(self.net.parameters()), mean)).device
            self.register_buffer("norm_mean", mean.to(device), persistent=False)
            self.register_buffer("norm_std", std.to(device), persistent=False)
        self.inputs = inputs

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """Raw inputs (``(N, *input_shape)``, or ``(N, H, W)`` for one-channel images; any numeric dtype) ->
        the normalised float32 inputs the network was trained on: ``(x / scale - mean[c]) / std[c]``."""
        if self.norm_mean is None:
            raise ExportError("this export does not store the input normalisation; feed normalised inputs")
        if x.dim() == len(self.input_shape) and len(self.input_shape) == 3 and self.input_shape[0] == 1:
            x = x.unsqueeze(1)  # N, H, W: one-channel images as IDX files and .npz files hold them
        self._check_shape(x)
        scale = float(self.spec["input_norm"]["scale"])
        return ((x.to(torch.float64) / scale - self.norm_mean) / self.norm_std).to(torch.float32)

    def _check_shape(self, x: torch.Tensor) -> None:
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"the model takes inputs of shape (N, {', '.join(map(str, self.input_shape))}), "
                             f"got {tuple(x.shape)}")

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The input in the memory format the network runs in."""
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inputs == "raw":
            x = self.normalise(x)
        elif not x.is_floating_point():
            raise TypeError(f"got {x.dtype} inputs, but this model was loaded with inputs='normalised' (float "
                            f"inputs normalised as the dataset reader does); for raw data (e.g. uint8 pixels) load "
                            f"it with dturbo.export.load(..., inputs='raw')")
        x = self.prepare(x)
        if self._compiled_fn is not None:
            return self._compiled_fn(x)
        return self.net(x)

    def set_channels_last(self, on: bool) -> None:
        """Convert the conv weights (and the inputs at each call) to channels_last, or back."""
        fmt = torch.channels_last if on else torch.contiguous_format
        for m in self.net.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.data = m.weight.data.contiguous(memory_format=fmt)
        self.channels_last = on

    def set_conv_kernels(self, kinds: dict[str, str]) -> None:
        """Run convolution ``name`` with kernel ``kinds[name]`` (see :data:`dturbo.kernels.CONV_KERNELS`); the
        module of each kind is kept, so switching back needs no recompilation."""
        for name, kind in kinds.items():
            variants = self._conv_variants.setdefault(name, {})
            current = getattr(self.net, name)
            variants.setdefault(self.kernels.get(name, "default"), current)
            if kind not in variants:
                variants[kind] = conv_as(kind, current)
            setattr(self.net, name, variants[kind])
            self.kernels[name] = kind

    def set_compiled(self, on: bool) -> None:
        """Run ``net`` through ``torch.compile`` (compiled lazily at the first call; kept when switched off
        and on again), or eagerly."""
        if on and self._compiled_cache is None:
            # object.__setattr__: not registered as a submodule (it wraps ``net``, already one)
            object.__setattr__(self, "_compiled_cache", torch.compile(self.net))
        object.__setattr__(self, "_compiled_fn", self._compiled_cache if on else None)
        self.compiled = on


def _read_spec(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not model_dir.is_dir():
        raise ExportError(f"exported model directory {model_dir} does not exist")
    spec_path = model_dir / SPEC_FILE
    if not spec_path.is_file():
        raise ExportError(f"{model_dir} holds no exported model: {SPEC_FILE} is missing")
    try:
        spec = json.loads(spec_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"{spec_path} is corrupt (not JSON): {err}") from None
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise ExportError(f"{spec_path} is not a dturbo export (format {FORMAT!r} expected)")
    if spec.get("version") not in READS_VERSIONS:
        raise ExportError(f"{spec_path} has format version {spec.get('version')!r}; this dturbo reads "
                          f"{', '.join(map(str, READS_VERSIONS))}")
    for key in ("ops", "input_shape", "num_classes"):
        if key not in spec:
            raise ExportError(f"{spec_path} lacks the key {key!r}")
    if spec.get("input_norm") is not None:  # version 3; older files have none (normalised inputs only)
        if not isinstance(spec["input_shape"], list) or not spec["input_shape"]:
            raise ExportError(f"{spec_path}: input_shape must be a non-empty list")
        spec["input_norm"] = check_input_norm(spec["input_norm"], tuple(spec["input_shape"]), str(spec_path))
    tensors, _ = _read_safetensors(model_dir / WEIGHTS_FILE, what="the exported weights file")
    return spec, tensors


def _tensor(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    t = tensors.get(key)
    if t is None:
        raise ExportError(f"the exported weights file has no tensor {key!r}")
    if shape is not None and tuple(t.shape) != shape:
        raise ExportError(f"tensor {key!r} has shape {tuple(t.shape)}, {SPEC_FILE} says {shape}")
    return t


def _build_net(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[nn.Sequential, list[tuple]]:
    """The eager network with dense linear layers, and (name, weight, bias) of each linear layer."""
    mods: dict[str, nn.Module] = {}
    linears = []
    if not isinstance(spec["ops"], list) or not all(isinstance(e, dict) for e in spec["ops"]):
        raise ExportError(f"{SPEC_FILE}: 'ops' must be a list of objects")
    for entry in spec["ops"]:
        t, name = entry.get("type"), entry.get("name")
        if t not in _OP_TYPES or not isinstance(name, str) or name in mods:
            raise ExportError(f"{SPEC_FILE}: unknown or duplicate operation {t!r} named {name!r}")
        try:
            if t == "conv2d":
                cin, cout, k, g = entry["in_channels"], entry["out_channels"], entry["kernel_size"], entry["groups"]
                ks = tuple(k) if isinstance(k, list) else (k, k)
                w = _tensor(tensors, f"{name}.weight", (cout, cin // g, *ks))
                conv = nn.Conv2d(cin, cout, ks, stride=entry["stride"], padding=entry["padding"], groups=g,
                                 bias=entry["bias"])
                with torch.no_grad():
                    conv.weight.copy_(w)
                    if entry["bias"]:
                        conv.bias.copy_(_tensor(tensors, f"{name}.bias", (cout,)))
                mods[name] = conv
                if entry.get("bias_map"):
                    map_name = f"{name}_bias_map"
                    if map_name in mods:
                        raise ExportError(f"{SPEC_FILE}: duplicate operation named {map_name!r}")
                    mods[map_name] = BiasMap(_tensor(tensors, f"{name}.bias_map", _conv_output_shape(entry)))
            elif t == "linear":
                fi, fo = entry["in_features"], entry["out_features"]
                w = _tensor(tensors, f"{name}.weight", (fo, fi)).float()
                b = _tensor(tensors, f"{name}.bias", (fo,)).float() if entry["bias"] else None
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
                mods[name] = IndexSelect(_tensor(tensors, f"{name}.index", None), entry["dim"])
        except (KeyError, TypeError, ValueError) as err:
            raise ExportError(f"{SPEC_FILE}: operation {name!r} ({t}) is malformed: {err!r}") from None
    return nn.Sequential(OrderedDict(mods)), linears


def load(
    model_dir: str | Path, *, batch_size: int = 256, kernels: str = "auto", channels_last: bool | None = None,
    compile: bool | None = None, conv: str = "auto", pool: str = "auto", device: str | torch.device = "cpu",
    inputs: str = "normalised",
) -> InferenceModel:
    """Load an exported model as an :class:`InferenceModel` (a ``torch.nn.Module``) in eval mode.

    Args:
        model_dir: the folder written by ``dturbo export``.
        batch_size: the batch size the model will mostly run at; the kernel and setting timings use it.
        kernels: ``"auto"`` (time the candidate kernels per linear layer, keep the fastest: sparse only where
            it beats dense) or one of ``dense``/``panel``/``bsr``/``csr`` for every linear layer.
        channels_last: ``None`` (auto: for networks with convolutions, time both memory formats and keep the
            faster), ``True`` or ``False``.
        compile: ``None`` (auto: for networks with convolutions, compile with ``torch.compile`` and keep it if a
            timing shows it faster; falls back to eager when compilation fails), ``True`` or ``False``.
        conv: ``"auto"`` (per convolution, time oneDNN against PyTorch's native CPU kernels on the layer's
            real input, keep native only where faster: it is for thin layers), ``"default"`` (oneDNN on a
            CPU) or ``"native"``.
        pool: ``"auto"`` (per max-pooling layer, time PyTorch's kernel against strided elementwise maxima on
            its real input, keep the faster; the values are identical), ``"default"`` or ``"separable"``
            (where the layer allows it: no padding, dilation or ceil mode).
        device: where the model runs (``"cpu"`` or ``"cuda"``).
        inputs: what the model takes. ``"normalised"``: float32 ``(N, *input_shape)`` inputs normalised as
            ``dturbo.data.load_dataset`` returns them (per channel, with the training set's mean and std).
            ``"raw"``: the data in its original scale, as the files hold it: pixel values 0..255 (uint8 or
            any numeric dtype) for the IDX and CIFAR datasets and uint8 .npz arrays, the stored values for
            float .npz arrays; shape ``(N, *input_shape)`` (channels first; ``(N, H, W)`` is taken for
            one-channel images); the model applies the normalisation stored at export (format version 3,
            ``input_norm`` in model.json). Older exports store none and take normalised inputs only.

    The choices are in the returned model's ``kernels``, ``pools``, ``channels_last``, ``compiled`` and
    ``info``.

    Raises:
        ExportError: the folder, its JSON or its tensors are missing, corrupt or inconsistent.
    """
    model_dir = Path(model_dir)
    if kernels != "auto" and kernels not in KERNELS:
        raise ValueError(f"kernels must be 'auto' or one of {', '.join(KERNELS)}, got {kernels!r}")
    if conv != "auto" and conv not in CONV_KERNELS:
        raise ValueError(f"conv must be 'auto' or one of {', '.join(CONV_KERNELS)}, got {conv!r}")
    if pool != "auto" and pool not in POOL_KERNELS:
        raise ValueError(f"pool must be 'auto' or one of {', '.join(POOL_KERNELS)}, got {pool!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    dev = torch.device(device)
    spec, tensors = _read_spec(model_dir)
    if spec["version"] == GRAPH_VERSION:
        from .export_graph import build_graph_net

        net, linears = build_graph_net(spec, tensors)
    else:
        net, linears = _build_net(spec, tensors)
    model = InferenceModel(net, spec)
    model.set_inputs(inputs)
    layer_info: dict[str, dict[str, Any]] = {}
    for name, w, b in linears:
        if kernels == "auto":
            layer, kind, times = choose_linear_kernel(w.to(dev), None if b is None else b.to(dev), batch_size,
                                                      device=dev)
        else:
            layer = make_linear(kernels, w.to(dev), None if b is None else b.to(dev), batch_size)
            kind, times = kernels, {}
        setattr(net, name, layer)
        model.kernels[name] = kind
        layer_info[name] = {"kernel": kind, "times_ms": times}
    model.to(dev).eval()
    model.requires_grad_(False)
    model.info = {"batch_size": batch_size, "device": str(dev), "layers": layer_info}
    has_conv = any(isinstance(m, nn.Conv2d) for m in net.modules())
    x = _example_input(model, batch_size, dev)
    if channels_last is None:
        channels_last = _channels_last_faster(model, x) if has_conv else False
    model.set_channels_last(bool(channels_last))
    _choose_layer_kernels(model, x, conv, pool)
    if compile or (compile is None and has_conv):
        _settle_compile(model, x, auto=compile is None, conv=conv)
    return model


@torch.no_grad()
def _settle_compile(model: InferenceModel, x: torch.Tensor, *, auto: bool, conv: str) -> None:
    """Compile, or (``auto``) time eager against compiled and keep the faster. Inductor fuses oneDNN convolutions
    with what follows while a native one breaks the graph, so where the per-layer choice picked native kernels
    the compiled model is also timed with oneDNN everywhere."""
    convs = {n: k for n, k in model.kernels.items() if k in CONV_KERNELS}
    variants: list[tuple[str, dict[str, str], bool]] = [("compiled", convs, True)]
    if conv == "auto" and "native" in convs.values():
        variants.append(("compiled-default-convs", dict.fromkeys(convs, "default"), True))
    if auto:
        variants.insert(0, ("eager", convs, False))
    timings: dict[str, float] = {}
    for label, kinds, comp in variants:
        model.set_conv_kernels(kinds)
        model.set_compiled(comp)
        try:
            if len(variants) == 1:
                model(x)  # compile now, not at the user's first call
            else:
                timings[label] = 1000 * time_call(lambda: model(x), x.device, repeats=5, warmup=1)
        except Exception as err:  # noqa: BLE001 (inductor raises many kinds; any means: run eagerly)
            model.info["compile_error"] = f"{type(err).__name__}: {err}"
            model.set_compiled(False)
            model.set_conv_kernels(convs)
            return
    if timings:
        best = min(timings, key=lambda k: timings[k])
        _, kinds, comp = next(v for v in variants if v[0] == best)
        model.set_conv_kernels(kinds)
        model.set_compiled(comp)
        model.info["compile"] = {"times_ms": timings, "chosen": best}


@torch.no_grad()
def _choose_layer_kernels(model: InferenceModel, x: torch.Tensor, conv: str, pool: str) -> None:
    """Set each convolution's and max-pooling's kernel: ``conv`` / ``pool`` for all, or (``"auto"``) per layer
    by timing on its real input (recorded in one pass through ``net``; any layout of children: a sequence or
    a graph)."""
    inputs: dict[str, torch.Tensor] = {}
    layers = [(name, m) for name, m in model.net.named_children() if isinstance(m, nn.Conv2d | nn.MaxPool2d)]
    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: inputs.setdefault(name, args[0]))
             for name, m in layers]
    try:
        model.net(model.prepare(x))
    finally:
        for hook in hooks:
            hook.remove()
    for name, m in layers:
        h = inputs.get(name)
        if h is None:  # not reached by the example input: default kernels
            continue
        if isinstance(m, nn.Conv2d):
            if conv == "auto":
                _, kind, times = choose_conv_kernel(m, h)
                model.info["layers"][name] = {"kernel": kind, "times_ms": times}
            else:
                kind = conv
            model.set_conv_kernels({name: kind})
        else:
            if pool == "auto":
                m, kind, times = choose_pool_kernel(m, h)
                model.info["layers"][name] = {"kernel": kind, "times_ms": times}
            else:
                kind = pool if separable_supported(m) else "default"
                m = pool_as(kind, m)
            setattr(model.net, name, m)
            model.pools[name] = kind


def _example_input(model: InferenceModel, batch_size: int, dev: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, *model.input_shape, generator=gen).to(dev)


def _channels_last_faster(model: InferenceModel, x: torch.Tensor) -> bool:
    """Time the model with channels_last off and on (at ``x``'s batch size); leave it on iff faster."""
    timings: dict[str, float] = {}
    with torch.no_grad():
        for on in (False, True):
            model.set_channels_last(on)
            timings["on" if on else "off"] = 1000 * time_call(lambda: model(x), x.device, repeats=5, warmup=1)
    chosen = timings["on"] < timings["off"]
    model.info["channels_last"] = {"times_ms": timings, "chosen": chosen}
    model.set_channels_last(chosen)
    return chosen

