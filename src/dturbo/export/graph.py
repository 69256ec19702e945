"""Export any model as a graph of a fixed vocabulary of ops, and build it back without the model's code.

:func:`export_model` captures the model's graph with ``torch.fx`` (``symbolic_trace``; dturbo's Bayesian layers are
leaves), in eval mode, and writes it as ``model.json`` (format version 4: every node an op of :data:`VOCABULARY`,
its arguments by name, its attributes as JSON values) and ``model.safetensors`` (its tensors). No pickle, and no
code of the model is needed to load it: :func:`dturbo.export.load` builds a :class:`GraphNet` of ``torch.nn`` layers
and ``torch`` functions from the two files. Nothing is approximated:

* a Bayesian layer is a convolution or linear layer with weight ``weight_mu * mask`` (the pruned model, as the
  run's global model computes); plain ``nn.Conv2d`` / ``nn.Linear`` keep their weights;
* BatchNorm (eval mode: running statistics) directly after a convolution or linear layer whose only user it is
  is folded into that layer (``w * gamma / sqrt(var + eps)``, computed in float64); elsewhere it stays an op;
* dropout (module or function with ``training=False``) and ``nn.Identity`` / ``contiguous`` are removed.

Compaction (:func:`dturbo.export.compact_links`, the mechanics of the built-in export) runs on every link of the
graph where a conv / linear layer's output feeds only channel-wise ops (elementwise activations, max / adaptive
pooling, unpadded average pooling, flatten, a mean over the spatial dimensions) into exactly one next conv / linear
layer: units with all-zero weights or unused by the next layer are removed from both (constants folded, exactly,
into the next layer's bias or bias map). Everything else (residual additions, concatenations, grouped convolutions,
normalisation in between) keeps the layer's units: there the export is the masked dense layer.

Every export runs the written graph on ``example_input`` and compares it with the model (:data:`CHECK_TOL`): an
export that computes something else is refused rather than written.
"""

from __future__ import annotations

import builtins
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..kernels import as_pair, dense_linear
from ..nn.bayes import BayesConv1d, BayesConv2d, BayesianLayer, BayesLinear
from .compaction import compact_links, layer_stats, update_shapes
from .format import FORMAT, GRAPH_VERSION, SPEC_FILE, ExportError, check_input_norm, save, stored_tensor
from .ops import ACTIVATIONS, BiasMap, Op, masked_weights

# Largest allowed |exported - model| on example_input, relative to max(1, max |model output|).
CHECK_TOL = 1e-4

# ops built as modules (children of GraphNet, named as the op): their tensors are ``<op>.<key>`` in the weights file
_MODULE_OPS = ("conv2d", "linear", "batch_norm", "layer_norm", "group_norm", "maxpool2d", "const")


def _size(x: torch.Tensor, dim: int | None = None) -> Any:
    return x.size() if dim is None else x.size(dim)


# ops run as functions: ``fn(*args, **attrs)``
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    **ACTIVATIONS,
    "softmax": F.softmax, "log_softmax": F.log_softmax,
    "avg_pool2d": F.avg_pool2d, "adaptive_avg_pool2d": F.adaptive_avg_pool2d,
    "adaptive_max_pool2d": F.adaptive_max_pool2d,
    "flatten": torch.flatten, "reshape": torch.reshape, "permute": torch.permute, "transpose": torch.transpose,
    "mean": torch.mean,
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "cat": torch.cat, "getitem": operator.getitem, "size": _size,
}
# Every op type model.json may hold (besides "input" and "output"); docs/export.md lists their arguments.
VOCABULARY = (*_MODULE_OPS, *_FUNCTIONS)

_REQ = object()  # a required argument
_P = tuple[tuple[str, Any], ...]
_ACT_P: _P = (("input", _REQ), ("inplace", False))
# call_function targets: (op type, parameters in order with defaults). "input" / "inplace" / "_stacklevel" are
# not attributes; a "dtype" must be None; "return_indices" must be False.
_CALL_FUNCTIONS: dict[Any, tuple[str, _P]] = {
    F.relu: ("relu", _ACT_P), torch.relu: ("relu", (("input", _REQ),)),
    F.leaky_relu: ("leaky_relu", (("input", _REQ), ("negative_slope", 0.01), ("inplace", False))),
    F.hardtanh: ("hardtanh", (("input", _REQ), ("min_val", -1.0), ("max_val", 1.0), ("inplace", False))),
    F.relu6: ("relu6", _ACT_P),
    F.elu: ("elu", (("input", _REQ), ("alpha", 1.0), ("inplace", False))),
    F.gelu: ("gelu", (("input", _REQ), ("approximate", "none"))),
    F.silu: ("silu", _ACT_P), F.hardswish: ("hardswish", _ACT_P), F.hardsigmoid: ("hardsigmoid", _ACT_P),
    torch.sigmoid: ("sigmoid", (("input", _REQ),)), F.sigmoid: ("sigmoid", (("input", _REQ),)),
    torch.tanh: ("tanh", (("input", _REQ),)), F.tanh: ("tanh", (("input", _REQ),)),
    F.softmax: ("softmax", (("input", _REQ), ("dim", _REQ), ("_stacklevel", 3), ("dtype", None))),
    F.log_softmax: ("log_softmax", (("input", _REQ), ("dim", _REQ), ("_stacklevel", 3), ("dtype", None))),
    F.max_pool2d: ("maxpool2d", (("input", _REQ), ("kernel_size", _REQ), ("stride", None), ("padding", 0),
                                 ("dilation", 1), ("ceil_mode", False), ("return_indices", False))),
    F.avg_pool2d: ("avg_pool2d", (("input", _REQ), ("kernel_size", _REQ), ("stride", None), ("padding", 0),
                                  ("ceil_mode", False), ("count_include_pad", True), ("divisor_override", None))),
    F.adaptive_avg_pool2d: ("adaptive_avg_pool2d", (("input", _REQ), ("output_size", _REQ))),
    F.adaptive_max_pool2d: ("adaptive_max_pool2d", (("input", _REQ), ("output_size", _REQ),
                                                    ("return_indices", False))),
    torch.flatten: ("flatten", (("input", _REQ), ("start_dim", 0), ("end_dim", -1))),
    torch.mean: ("mean", (("input", _REQ), ("dim", None), ("keepdim", False), ("dtype", None))),
    torch.reshape: ("reshape", (("input", _REQ), ("shape", _REQ))),
    torch.permute: ("permute", (("input", _REQ), ("dims", _REQ))),
    torch.transpose: ("transpose", (("input", _REQ), ("dim0", _REQ), ("dim1", _REQ))),
    torch.cat: ("cat", (("tensors", _REQ), ("dim", 0))), torch.concat: ("cat", (("tensors", _REQ), ("dim", 0))),
    torch.concatenate: ("cat", (("tensors", _REQ), ("dim", 0))),
    operator.add: ("add", (("input", _REQ), ("other", _REQ))),
    operator.sub: ("sub", (("input", _REQ), ("other", _REQ))),
    operator.mul: ("mul", (("input", _REQ), ("other", _REQ))),
    operator.truediv: ("div", (("input", _REQ), ("other", _REQ))),
    torch.add: ("add", (("input", _REQ), ("other", _REQ), ("alpha", 1))),
    torch.sub: ("sub", (("input", _REQ), ("other", _REQ), ("alpha", 1))),
    torch.mul: ("mul", (("input", _REQ), ("other", _REQ))), torch.div: ("div", (("input", _REQ), ("other", _REQ))),
    operator.getitem: ("getitem", (("input", _REQ), ("index", _REQ))),
}
_DROPOUT_FUNCTIONS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)
# call_method names: (op type, parameters after self); a "*" parameter takes the remaining arguments as a list
_CALL_METHODS: dict[str, tuple[str, _P]] = {
    "relu": ("relu", ()), "sigmoid": ("sigmoid", ()), "tanh": ("tanh", ()),
    "softmax": ("softmax", (("dim", _REQ), ("dtype", None))),
    "log_softmax": ("log_softmax", (("dim", _REQ), ("dtype", None))),
    "flatten": ("flatten", (("start_dim", 0), ("end_dim", -1))),
    "mean": ("mean", (("dim", None), ("keepdim", False), ("dtype", None))),
    "view": ("reshape", (("*shape", _REQ),)), "reshape": ("reshape", (("*shape", _REQ),)),
    "permute": ("permute", (("*dims", _REQ),)), "transpose": ("transpose", (("dim0", _REQ), ("dim1", _REQ))),
    "size": ("size", (("dim", None),)),
    "add": ("add", (("other", _REQ), ("alpha", 1))), "sub": ("sub", (("other", _REQ), ("alpha", 1))),
    "mul": ("mul", (("other", _REQ),)), "div": ("div", (("other", _REQ),)),
}
_IDENTITY_METHODS = ("contiguous",)
# positional arguments of a function op (the rest are attributes)
_ARGS = {"reshape": ("input", "shape"), "permute": ("input", "dims"), "cat": ("tensors",),
         "add": ("input", "other"), "sub": ("input", "other"), "mul": ("input", "other"), "div": ("input", "other"),
         "getitem": ("input", "index")}
_NOT_ATTRS = ("input", "inplace", "_stacklevel", "dtype", "return_indices")
_IDENTITY_MODULES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                     nn.FeatureAlphaDropout)


@dataclass
class Node:
    """One op of the graph: ``args`` are JSON values in which ``{"ref": name}`` names an earlier node's output;
    conv2d / linear carry their tensors in ``op`` (an :class:`dturbo.export.Op`, what compaction works on), the
    other module ops in ``tensors``."""

    name: str
    type: str
    args: list[Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    op: Op | None = None
    shape: list[int] | None = None  # output shape on the example input (tensor outputs)


@dataclass
class ExportedGraph:
    """A graph export in memory (see :func:`export_model`)."""

    nodes: list[Node]
    input_name: str
    output: Any
    input_shape: tuple[int, ...]
    num_classes: int | None
    layers: list[dict[str, Any]]
    input_norm: dict[str, Any] | None = None
    source: dict[str, Any] = field(default_factory=dict)
    check: dict[str, float] = field(default_factory=dict)

    def spec(self) -> dict[str, Any]:
        """The JSON description (everything but the tensors)."""
        ops: list[dict[str, Any]] = [{"type": "input", "name": self.input_name, "args": [],
                                      "shape": ["N", *self.input_shape]}]
        for n in self.nodes:
            entry: dict[str, Any] = {"type": n.type, "name": n.name, "args": n.args, "attrs": n.attrs}
            if n.op is not None:
                entry["attrs"] = {**n.op.attrs, "bias": n.op.bias is not None, "bias_map": n.op.bias_map is not None}
            if n.shape is not None:
                entry["shape"] = n.shape
            ops.append(entry)
        ops.append({"type": "output", "name": "output", "args": [self.output]})
        before = sum(r["params_before"] for r in self.layers)
        after = sum(r["params_after"] for r in self.layers)
        nnz = sum(r["nonzeros"] for r in self.layers)
        return {
            "format": FORMAT, "version": GRAPH_VERSION, "kind": "graph", "source": self.source,
            "input_shape": list(self.input_shape), "num_classes": self.num_classes, "input_norm": self.input_norm,
            "ops": ops, "layers": self.layers, "check": self.check,
            "totals": {"weights_before": before, "weights_after": after, "nonzeros": nnz,
                       "density_before": nnz / max(before, 1), "density_after": nnz / max(after, 1)},
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """``<op>.weight``, ``<op>.bias``, ``<op>.bias_map`` of conv2d / linear, ``<op>.<key>`` of the others."""
        out: dict[str, torch.Tensor] = {}
        for n in self.nodes:
            items = dict(n.tensors)
            if n.op is not None:
                items.update({k: getattr(n.op, k) for k in ("weight", "bias", "bias_map")
                              if getattr(n.op, k) is not None})
            for key, t in items.items():
                out[f"{n.name}.{key}"] = t.detach().float().contiguous().clone()
        return out

    def save(self, out_dir: str | Path) -> Path:
        """Write ``model.safetensors`` and ``model.json`` into ``out_dir``, as :func:`dturbo.export.save` writes
        every export."""
        return save(self, out_dir)


# ----------------------------------------------------------------------------------------------------- capture
class _Tracer(fx.Tracer):
    """torch.fx's tracer with dturbo's Bayesian layers as leaves (they become one conv / linear op each)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, BayesianLayer) or super().is_leaf_module(m, module_qualified_name)


def _bind(node: fx.Node, params: _P, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (defaults filled); ExportError naming the node when they do not fit."""
    out: dict[str, Any] = {}
    rest = list(args)
    for name, default in params:
        if name.startswith("*"):
            out[name[1:]] = rest[0] if len(rest) == 1 and isinstance(rest[0], list | tuple) else list(rest)
            rest = []
        elif rest:
            out[name] = rest.pop(0)
        elif name in kwargs:
            out[name] = kwargs[name]
        elif default is _REQ:
            raise ExportError(f"node {node.name!r} ({_target(node)}): argument {name!r} is missing")
        else:
            out[name] = default
    extra = set(kwargs) - {p.lstrip("*") for p, _ in params}
    if rest or extra:
        raise ExportError(f"node {node.name!r} ({_target(node)}): arguments export does not know: "
                          f"{rest or sorted(extra)}")
    return out


def _target(node: fx.Node) -> str:
    t = node.target
    return f"{node.op} {getattr(t, '__module__', '') or ''}.{getattr(t, '__name__', t)}".replace(" .", " ")


class _Capture:
    """Turns the traced fx graph into :class:`Node` s of the vocabulary."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.alias: dict[str, str] = {}
        self.nodes: list[Node] = []
        self.input_name = ""
        self.output: Any = None

    def name(self, n: fx.Node) -> str:
        name = n.name
        while name in self.alias:
            name = self.alias[name]
        return name

    def encode(self, v: Any, node: fx.Node) -> Any:
        if isinstance(v, fx.Node):
            return {"ref": self.name(v)}
        if isinstance(v, list | tuple):
            return [self.encode(a, node) for a in v]
        if isinstance(v, slice):
            return {"slice": [self.encode(a, node) for a in (v.start, v.stop, v.step)]}
        if v is Ellipsis:
            return {"ellipsis": True}
        if v is None or isinstance(v, bool | int | float | str):
            return v
        raise ExportError(f"node {node.name!r} ({_target(node)}): argument {v!r} of type {type(v).__name__} "
                          f"cannot be written as JSON")

    def add(self, node: fx.Node, type_: str, args: list[Any], attrs: dict[str, Any] | None = None,
            **extra: Any) -> None:
        meta = node.meta.get("tensor_meta")
        shape = [int(s) for s in meta.shape] if meta is not None and hasattr(meta, "shape") else None
        self.nodes.append(Node(node.name, type_, [self.encode(a, node) for a in args],
                               {k: self.encode(v, node) for k, v in (attrs or {}).items()}, shape=shape, **extra))

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                if self.input_name:
                    raise ExportError(f"the model takes more than one input ({self.input_name!r}, {node.name!r}); "
                                      f"export supports models of one input tensor")
                self.input_name = node.name
            elif node.op == "output":
                self.output = self.encode(node.args[0], node)
            elif node.op == "call_module":
                self.module(node, self.gm.get_submodule(node.target))
            elif node.op == "call_function":
                self.function(node)
            elif node.op == "call_method":
                self.method(node)
            elif node.op == "get_attr":
                value = operator.attrgetter(node.target)(self.gm)
                if not isinstance(value, torch.Tensor):
                    raise ExportError(f"node {node.name!r} (get_attr {node.target}): not a tensor")
                self.nodes.append(Node(node.name, "const", [], {}, {"value": value.detach().float()},
                                       shape=[int(s) for s in value.shape]))
            else:  # pragma: no cover (fx has no other kinds)
                raise ExportError(f"node {node.name!r}: unknown fx node kind {node.op!r}")

    def unknown(self, node: fx.Node, what: str) -> ExportError:
        return ExportError(f"node {node.name!r} calls {what}, which export does not know; the ops it writes: "
                           f"{', '.join(VOCABULARY)} (docs/export.md, 'Any model')")

    def module(self, node: fx.Node, m: nn.Module) -> None:
        x = node.args[0] if node.args else None
        if len(node.args) != 1 or node.kwargs or not isinstance(x, fx.Node):
            raise ExportError(f"node {node.name!r} (module {node.target}, {type(m).__name__}): export supports "
                              f"modules called on one tensor")
        t = type(m)
        if t in _IDENTITY_MODULES:
            self.alias[node.name] = self.name(x)
        elif isinstance(m, BayesConv2d) or t is nn.Conv2d:
            self.add(node, "conv2d", [x], op=_conv_op(node, m, x))
        elif isinstance(m, BayesConv1d) or t is nn.Conv1d:
            self.conv1d(node, m, x)
        elif isinstance(m, BayesLinear) or t is nn.Linear:
            w, b = _weights(node.name, m)
            attrs = {"in_features": int(w.shape[1]), "out_features": int(w.shape[0])}
            self.add(node, "linear", [x], op=Op("linear", node.name, attrs, w, b))
        elif t in (nn.BatchNorm1d, nn.BatchNorm2d):
            assert isinstance(m, nn.modules.batchnorm._BatchNorm)
            if m.running_mean is None or m.running_var is None:
                raise ExportError(f"node {node.name!r} ({node.target}, {t.__name__}): no running statistics "
                                  f"(track_running_stats=False), so it normalises with each batch's statistics "
                                  f"even in eval mode; export needs running statistics")
            tensors = {"running_mean": m.running_mean, "running_var": m.running_var}
            if m.affine:
                tensors.update(weight=m.weight, bias=m.bias)
            self.add(node, "batch_norm", [x], {"num_features": m.num_features, "eps": float(m.eps),
                                               "affine": m.affine}, tensors=_detach(tensors))
        elif t is nn.LayerNorm:
            assert isinstance(m, nn.LayerNorm)
            tensors = {k: getattr(m, k) for k in ("weight", "bias") if getattr(m, k) is not None}
            self.add(node, "layer_norm", [x], {"normalized_shape": list(m.normalized_shape), "eps": float(m.eps),
                                               "weight": m.weight is not None, "bias": m.bias is not None},
                     tensors=_detach(tensors))
        elif t is nn.GroupNorm:
            assert isinstance(m, nn.GroupNorm)
            tensors = {"weight": m.weight, "bias": m.bias} if m.affine else {}
            self.add(node, "group_norm", [x], {"num_groups": m.num_groups, "num_channels": m.num_channels,
                                               "eps": float(m.eps), "affine": m.affine}, tensors=_detach(tensors))
        elif t is nn.MaxPool2d:
            assert isinstance(m, nn.MaxPool2d)
            if m.return_indices:
                raise ExportError(f"node {node.name!r} ({node.target}): MaxPool2d with return_indices")
            self.add(node, "maxpool2d", [x], {"kernel_size": m.kernel_size, "stride": m.stride,
                                              "padding": m.padding, "dilation": m.dilation,
                                              "ceil_mode": bool(m.ceil_mode)})
        elif t in _MODULE_FUNCTIONS:
            type_, attrs = _MODULE_FUNCTIONS[t](m)
            self.add(node, type_, [x], attrs)
        else:
            raise self.unknown(node, f"module {node.target!r} of type {t.__module__}.{t.__name__}")

    def conv1d(self, node: fx.Node, m: nn.Module, x: fx.Node) -> None:
        """A 1-d convolution as the 2-d one it is on a (N, C, 1, L) view: reshape, conv2d with a 1 x k kernel,
        reshape back (so that the 2-d kernels run it)."""
        meta, out = x.meta.get("tensor_meta"), node.meta.get("tensor_meta")
        if meta is None or out is None or len(meta.shape) != 3:
            raise ExportError(f"node {node.name!r} (conv1d {node.target}): export needs a 3-D (N, C, L) input")
        (n, c, length), (_, o, length_out) = ([int(v) for v in meta.shape], [int(v) for v in out.shape])
        w, b = _weights(node.name, m)
        k, pad = int(w.shape[2]), m.padding
        dil = int(m.dilation[0])  # type: ignore[index]
        if pad == "valid":
            pad = (0,)
        elif pad == "same" and dil == 1 and k % 2:
            pad = (k // 2,)
        flat, conv = f"{node.name}__as_2d", f"{node.name}__conv2d"
        taken = {v.name for v in self.gm.graph.nodes} | {v.name for v in self.nodes}
        if flat in taken or conv in taken:
            raise ExportError(f"node {node.name!r} (conv1d): the names {flat!r} and {conv!r} are taken")
        attrs = {"in_channels": c, "out_channels": o, "kernel_size": [1, k],
                 "stride": [1, int(m.stride[0])],  # type: ignore[index]
                 "padding": pad if isinstance(pad, str) else [0, int(pad[0])], "dilation": [1, dil],
                 "groups": int(m.groups), "padding_mode": str(m.padding_mode),  # type: ignore[arg-type]
                 "input_hw": [1, length]}
        self.nodes.append(Node(flat, "reshape", [{"ref": self.name(x)}, [-1, c, 1, length]], shape=[n, c, 1, length]))
        self.nodes.append(Node(conv, "conv2d", [{"ref": flat}], op=Op("conv2d", conv, attrs, w.unsqueeze(2), b),
                               shape=[n, o, 1, length_out]))
        self.nodes.append(Node(node.name, "reshape", [{"ref": conv}, [-1, o, length_out]], shape=[n, o, length_out]))

    def function(self, node: fx.Node) -> None:
        f = node.target
        if f in _DROPOUT_FUNCTIONS:
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if training and p:
                raise ExportError(f"node {node.name!r} ({_target(node)}) drops values even in eval mode "
                                  f"(training=True); pass training=self.training")
            self.alias[node.name] = self.name(node.args[0])
            return
        if f is builtins.getattr and len(node.args) == 2 and node.args[1] == "shape":
            self.add(node, "size", [node.args[0]], {"dim": None})
            return
        if f not in _CALL_FUNCTIONS:
            raise self.unknown(node, f"function {_target(node).split(' ', 1)[1]}")
        type_, params = _CALL_FUNCTIONS[f]
        bound = _bind(node, params, node.args, dict(node.kwargs))
        self.emit(node, type_, bound)

    def method(self, node: fx.Node) -> None:
        if node.target in _IDENTITY_METHODS:
            self.alias[node.name] = self.name(node.args[0])
            return
        if node.target not in _CALL_METHODS:
            raise self.unknown(node, f"tensor method .{node.target}()")
        type_, params = _CALL_METHODS[str(node.target)]
        bound = _bind(node, params, tuple(node.args[1:]), dict(node.kwargs))
        bound["input"] = node.args[0]
        self.emit(node, type_, bound)

    def emit(self, node: fx.Node, type_: str, bound: dict[str, Any]) -> None:
        if bound.get("dtype") is not None or bound.get("return_indices") or (
                type_ in ("add", "sub") and bound.pop("alpha", 1) != 1):
            raise ExportError(f"node {node.name!r} ({_target(node)}): dtype, return_indices and alpha (of add / sub) "
                              f"are not supported")
        if type_ == "relu6":
            type_, bound = "hardtanh", {**bound, "min_val": 0.0, "max_val": 6.0}
        if type_ in ("maxpool2d", "avg_pool2d") and bound["stride"] is None:
            bound["stride"] = bound["kernel_size"]
        names = _ARGS.get(type_, ("input",))
        args = [bound[k] for k in names]
        attrs = {k: v for k, v in bound.items() if k not in names and k not in _NOT_ATTRS}
        self.add(node, type_, args, attrs)


_MODULE_FUNCTIONS: dict[type, Callable[[Any], tuple[str, dict[str, Any]]]] = {
    nn.ReLU: lambda m: ("relu", {}),
    nn.ReLU6: lambda m: ("hardtanh", {"min_val": 0.0, "max_val": 6.0}),
    nn.Hardtanh: lambda m: ("hardtanh", {"min_val": float(m.min_val), "max_val": float(m.max_val)}),
    nn.LeakyReLU: lambda m: ("leaky_relu", {"negative_slope": float(m.negative_slope)}),
    nn.ELU: lambda m: ("elu", {"alpha": float(m.alpha)}),
    nn.GELU: lambda m: ("gelu", {"approximate": m.approximate}),
    nn.Sigmoid: lambda m: ("sigmoid", {}), nn.Tanh: lambda m: ("tanh", {}), nn.SiLU: lambda m: ("silu", {}),
    nn.Hardswish: lambda m: ("hardswish", {}), nn.Hardsigmoid: lambda m: ("hardsigmoid", {}),
    nn.Softmax: lambda m: ("softmax", {"dim": m.dim}), nn.LogSoftmax: lambda m: ("log_softmax", {"dim": m.dim}),
    nn.AvgPool2d: lambda m: ("avg_pool2d", {"kernel_size": m.kernel_size, "stride": m.stride, "padding": m.padding,
                                            "ceil_mode": bool(m.ceil_mode),
                                            "count_include_pad": bool(m.count_include_pad),
                                            "divisor_override": m.divisor_override}),
    nn.AdaptiveAvgPool2d: lambda m: ("adaptive_avg_pool2d", {"output_size": m.output_size}),
    nn.AdaptiveMaxPool2d: lambda m: ("adaptive_max_pool2d", {"output_size": m.output_size}),
    nn.Flatten: lambda m: ("flatten", {"start_dim": m.start_dim, "end_dim": m.end_dim}),
}


def _detach(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in tensors.items()}


def _weights(name: str, m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The effective weight and bias: ``weight_mu * mask`` for a Bayesian layer, ``weight`` otherwise."""
    if isinstance(m, BayesianLayer):
        return masked_weights(name, m.weight_mu, m.mask, m.bias)
    return masked_weights(name, m.weight, None, m.bias)  # type: ignore[arg-type]


def _conv_op(node: fx.Node, m: nn.Module, x: fx.Node) -> Op:
    w, b = _weights(node.name, m)
    pad = m.padding
    dil = as_pair(m.dilation)  # type: ignore[arg-type]
    kh, kw = (int(s) for s in w.shape[2:])
    if pad == "valid":
        pad = (0, 0)
    elif pad == "same" and dil == (1, 1) and kh % 2 and kw % 2:
        pad = (kh // 2, kw // 2)
    meta = x.meta.get("tensor_meta")
    if meta is None or len(meta.shape) != 4:
        raise ExportError(f"node {node.name!r} (conv2d {node.target}): export needs a 4-D (N, C, H, W) input")
    attrs = {"in_channels": int(w.shape[1]) * int(m.groups), "out_channels": int(w.shape[0]),  # type: ignore[arg-type]
             "kernel_size": [kh, kw], "stride": list(as_pair(m.stride)),  # type: ignore[arg-type]
             "padding": pad if isinstance(pad, str) else list(as_pair(pad)), "dilation": list(dil),
             "groups": int(m.groups), "padding_mode": str(m.padding_mode),  # type: ignore[arg-type]
             "input_hw": [int(s) for s in meta.shape[2:]]}
    return Op("conv2d", node.name, attrs, w, b)


# ------------------------------------------------------------------------------------------ folding, compaction
def _users(nodes: list[Node], output: Any) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {n.name: [] for n in nodes}
    for n in nodes:
        for ref in _refs(n.args):
            users.setdefault(ref, []).append(n.name)
    for ref in _refs(output):
        users.setdefault(ref, []).append("output")
    return users


def _refs(v: Any) -> list[str]:
    if isinstance(v, dict):
        return [v["ref"]] if "ref" in v else [r for a in v.values() for r in _refs(a)]
    if isinstance(v, list):
        return [r for a in v for r in _refs(a)]
    return []


def _rename(v: Any, old: str, new: str) -> Any:
    if isinstance(v, dict):
        return {"ref": new} if v.get("ref") == old else {k: _rename(a, old, new) for k, a in v.items()}
    if isinstance(v, list):
        return [_rename(a, old, new) for a in v]
    return v


def fold_batch_norms(nodes: list[Node], output: Any) -> tuple[list[Node], Any]:
    """Fold each batch_norm whose input is a conv2d / linear used by nothing else into that layer (exact up to
    float rounding: computed in float64); returns the nodes left and the output."""
    users = _users(nodes, output)
    by_name = {n.name: n for n in nodes}
    kept: list[Node] = []
    for n in nodes:
        src = by_name.get(_refs(n.args)[0]) if n.type == "batch_norm" else None
        if src is None or src.op is None or users[src.name] != [n.name] or n.shape is None:
            kept.append(n)
            continue
        if src.op.type == "linear" and len(n.shape) != 2:  # BatchNorm1d over (N, C, L): channels are dim 1
            kept.append(n)
            continue
        t = {k: v.double() for k, v in n.tensors.items()}
        scale = t.get("weight", torch.ones_like(t["running_var"])) / torch.sqrt(t["running_var"] + n.attrs["eps"])
        shift = t.get("bias", torch.zeros_like(scale)) - t["running_mean"] * scale
        op = src.op
        assert op.weight is not None
        view = (-1,) + (1,) * (op.weight.dim() - 1)
        op.weight = (op.weight.double() * scale.reshape(view)).float().contiguous()
        bias = shift if op.bias is None else op.bias.double() * scale + shift
        op.bias = bias.float().contiguous()
        src.shape = n.shape
        output = _rename(output, n.name, src.name)
        for m in nodes:
            m.args = _rename(m.args, n.name, src.name)
    return kept, output


def _link_ops(n: Node, batch: int) -> list[Op] | None:
    """The channel-wise ops of :mod:`dturbo.export`'s compaction that node ``n`` is, or None when it is not one
    (``batch``: the example's batch size, the first dimension of a flattening reshape)."""
    if n.type in ACTIVATIONS:
        return [Op(n.type, n.name, dict(n.attrs))]
    if n.type in ("maxpool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d"):
        return [Op(n.type, n.name)]
    if n.type == "avg_pool2d" and (not any(as_pair(n.attrs["padding"])) or not n.attrs["count_include_pad"]) \
            and n.attrs["divisor_override"] is None:
        return [Op("adaptive_avg_pool2d", n.name)]  # an average of a constant is that constant
    if n.type == "flatten" and n.attrs.get("start_dim") == 1 and n.attrs.get("end_dim") == -1:
        return [Op("flatten", n.name)]
    if n.type == "reshape" and n.shape is not None and len(n.shape) == 2 and n.shape[0] == batch:
        return [Op("flatten", n.name)]  # (N, everything else): flatten's order
    if n.type == "mean" and n.attrs.get("dim") in ([2, 3], [-2, -1], [3, 2], [-1, -2]) and not n.attrs["keepdim"]:
        return [Op("adaptive_avg_pool2d", n.name), Op("flatten", n.name)]
    return None


def graph_links(nodes: list[Node], output: Any, batch: int) -> list[tuple[Op, Op, list[Op]]]:
    """(producer, consumer, ops between) for each conv2d / linear whose output feeds only channel-wise ops, each
    used once, into exactly one next conv2d / linear (its first argument)."""
    users = _users(nodes, output)
    by_name = {n.name: n for n in nodes}
    links = []
    for n in nodes:
        if n.op is None or n.shape is None or len(n.shape) != (4 if n.type == "conv2d" else 2):
            continue
        prev, between = n.name, []
        while len(users[prev]) == 1 and users[prev][0] in by_name:
            cur = by_name[users[prev][0]]
            if _refs(cur.args) != [prev]:
                break
            if cur.op is not None:
                if cur.type == "conv2d" and not _conv_takes_units(cur.op):
                    break
                links.append((n.op, cur.op, between))
                break
            ops = _link_ops(cur, batch)
            if ops is None:
                break
            between = [*between, *ops]
            prev = cur.name
    return links


def _conv_takes_units(op: Op) -> bool:
    """Whether compaction may fold constant inputs into this convolution (zero padding, ints, dilation 1)."""
    a = op.attrs
    return a["padding_mode"] == "zeros" and not isinstance(a["padding"], str) and tuple(a["dilation"]) == (1, 1)


# ------------------------------------------------------------------------------------------------------ export
def export_model(
    model: nn.Module, out_dir: str | Path | None = None, *, example_input: torch.Tensor, compaction: bool = True,
    input_norm: dict[str, Any] | None = None, source: dict[str, Any] | None = None,
) -> ExportedGraph:
    """Export ``model`` (any module torch.fx can trace: a bayesianized model of one's own, a built-in one, a
    plain one) as a graph; write it to ``out_dir`` when given (``model.json`` + ``model.safetensors``, format
    version 4), to be loaded by :func:`dturbo.export.load` without the model's code.

    Args:
        model: the model; traced in eval mode (its mode is restored). Bayesian layers export ``weight_mu * mask``.
        example_input: a batch of inputs ``(N, *sample_shape)``; the export records the sample shape, the shape
            at every op, and checks its result on it against the model (relative error <= :data:`CHECK_TOL`).
        compaction: remove units across the links of the graph that allow it (see the module docstring);
            False keeps every unit (the masked dense model).
        input_norm: the data's normalisation (``dturbo.data.Dataset.input_norm``), so that ``load(...,
            inputs="raw")`` applies it; None: the export takes normalised inputs only.
        source: free-form provenance written into model.json.

    Raises:
        ExportError: the graph cannot be captured (torch.fx fails: data-dependent control flow, ...), a node
            calls a function, method or module outside the vocabulary (named, with its target), a tensor holds
            NaN or Inf, or the written graph does not reproduce the model on ``example_input``.
    """
    if not isinstance(model, nn.Module):
        raise ExportError(f"export_model takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 2:
        raise ExportError("example_input must be a batch tensor (N, *sample_shape)")
    x = example_input.detach().to("cpu", torch.float32)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                graph = _Tracer().trace(model)
            except Exception as err:  # noqa: BLE001 (fx raises many kinds: a trace error is what to report)
                raise ExportError(f"cannot capture the graph of {type(model).__name__} with torch.fx: "
                                  f"{type(err).__name__}: {err}") from None
            gm = fx.GraphModule(model, graph)
            from torch.fx.passes.shape_prop import ShapeProp

            ShapeProp(gm).propagate(x)
            expected = model(x)
            capture = _Capture(gm)
            capture.run()
    finally:
        model.train(training)
    nodes, output = fold_batch_norms(capture.nodes, capture.output)
    params = [n.op for n in nodes if n.op is not None]
    before = {op.name: (tuple(op.weight.shape), int(op.weight.numel())) for op in params if op.weight is not None}
    if compaction:
        compact_links(graph_links(nodes, output, int(x.shape[0])))
    update_shapes(params)
    input_shape = tuple(int(s) for s in x.shape[1:])
    out_shape = expected.shape if isinstance(expected, torch.Tensor) else None
    num_classes = int(out_shape[-1]) if out_shape is not None and len(out_shape) == 2 else None
    if input_norm is not None:
        input_norm = check_input_norm(input_norm, input_shape, "input_norm")
    exported = ExportedGraph(nodes, capture.input_name, output, input_shape, num_classes,
                             layer_stats(params, before), input_norm, dict(source or {}))
    exported.check = _check(exported, x, expected)
    if out_dir is not None:
        exported.save(out_dir)
    return exported


def _check(exported: ExportedGraph, x: torch.Tensor, expected: Any) -> dict[str, float]:
    """Run the written graph (through JSON) on ``x``; ExportError when it differs from the model's ``expected``."""
    spec = json.loads(json.dumps(exported.spec()))
    net, _ = build_graph_net(spec, exported.tensors())
    net.record = {}
    with torch.no_grad():
        got = net.eval()(x)
    for n in exported.nodes:  # the shapes after compaction
        n.shape = net.record.get(n.name, n.shape)
    flat_e, flat_g = _flat(expected), _flat(got)
    if len(flat_e) != len(flat_g) or any(a.shape != b.shape for a, b in zip(flat_e, flat_g, strict=True)):
        raise ExportError("the exported graph's output does not have the model's shape on example_input")
    err = max((float((a.float() - b.float()).abs().max()) for a, b in zip(flat_e, flat_g, strict=True)
               if a.numel()), default=0.0)
    scale = max([1.0, *(float(a.float().abs().max()) for a in flat_e if a.numel())])
    if not err <= CHECK_TOL * scale:
        raise ExportError(f"the exported graph differs from the model on example_input by {err:.3g} (allowed "
                          f"{CHECK_TOL * scale:.3g}): the model does something export does not capture (e.g. "
                          f"randomness in eval mode, or shapes fixed at the example's batch size)")
    return {"max_abs_err": err, "batch": int(x.shape[0])}


def _flat(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, list | tuple):
        return [t for a in v for t in _flat(a)]
    if isinstance(v, dict):
        return [t for a in v.values() for t in _flat(a)]
    raise ExportError(f"the model returns a {type(v).__name__}; export supports tensors, tuples and lists of them")


# -------------------------------------------------------------------------------------------------------- load
class EvalBatchNorm(nn.Module):
    """Batch normalisation with fixed statistics (eval mode), any input ``(N, C, ...)``."""

    def __init__(self, running_mean: torch.Tensor, running_var: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("running_mean", running_mean.float())
        self.register_buffer("running_var", running_var.float())
        self.register_buffer("weight", None if weight is None else weight.float())
        self.register_buffer("bias", None if bias is None else bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class Const(nn.Module):
    """A stored tensor (a parameter or buffer the model used directly)."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("value", value)

    def forward(self) -> torch.Tensor:
        return self.value


@dataclass
class _Step:
    name: str
    type: str
    args: list[Any]
    attrs: dict[str, Any]
    free: list[str]  # values no later step reads


_GRAPHNET_ATTRS = ("input_name", "steps", "output", "bias_maps", "record")


class GraphNet(nn.Module):
    """The exported graph as a module: its module ops are children named as the ops (so that
    :class:`dturbo.export.InferenceModel` can swap their kernels), the rest run as ``torch`` functions."""

    def __init__(self, input_name: str, steps: list[_Step], output: Any, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, m in modules.items():
            self.add_module(name, m)
        self.input_name = input_name
        self.steps = steps
        self.output = output
        self.bias_maps = {name[: -len("__bias_map")] for name in modules if name.endswith("__bias_map")}
        self.record: dict[str, list[int]] | None = None  # when a dict: each op's output shape is put in it


    def forward(self, x: torch.Tensor) -> Any:
        env: dict[str, Any] = {self.input_name: x}
        record = self.record
        for s in self.steps:
            args = _decode(s.args, env)
            if s.type in _FUNCTIONS:
                env[s.name] = _FUNCTIONS[s.type](*args, **s.attrs)
            elif s.type == "const":
                env[s.name] = getattr(self, s.name)()
            else:
                y = getattr(self, s.name)(*args)
                if s.name in self.bias_maps:
                    y = getattr(self, f"{s.name}__bias_map")(y)
                env[s.name] = y
            if record is not None and isinstance(env[s.name], torch.Tensor):
                record[s.name] = [int(d) for d in env[s.name].shape]
            for name in s.free:
                del env[name]
        return _decode(self.output, env)


def _decode(v: Any, env: dict[str, Any]) -> Any:
    if isinstance(v, dict):
        if "ref" in v:
            return env[v["ref"]]
        if "slice" in v:
            return slice(*(_decode(a, env) for a in v["slice"]))
        return Ellipsis
    if isinstance(v, list):
        return tuple(_decode(a, env) for a in v)
    return v


def _check_value(v: Any, defined: set[str], where: str) -> None:
    """Every ``{"ref"}`` names an earlier op; only the documented encodings appear."""
    if isinstance(v, dict):
        if set(v) == {"ref"} and isinstance(v["ref"], str):
            if v["ref"] not in defined:
                raise ExportError(f"{SPEC_FILE}: {where} reads {v['ref']!r}, which no earlier operation defines")
        elif set(v) == {"slice"} and isinstance(v["slice"], list) and len(v["slice"]) == 3:
            for a in v["slice"]:
                _check_value(a, defined, where)
        elif v != {"ellipsis": True}:
            raise ExportError(f"{SPEC_FILE}: {where} holds an argument export does not know: {v!r}")
    elif isinstance(v, list):
        for a in v:
            _check_value(a, defined, where)
    elif not (v is None or isinstance(v, bool | int | float | str)):
        raise ExportError(f"{SPEC_FILE}: {where} holds an argument export does not know: {v!r}")


def _tensor(tensors: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    return stored_tensor(tensors, key, shape).float()


def _module(name: str, type_: str, a: dict[str, Any], tensors: Mapping[str, torch.Tensor],
            shape: list[int] | None) -> dict[str, nn.Module]:
    """The module(s) of a module op (a conv2d with a bias map gives two). Every tensor is checked against the sizes
    model.json claims before a module of those sizes is made: nothing is allocated beyond the tensors present."""
    if type_ == "conv2d":
        cin, cout, g = a["in_channels"], a["out_channels"], a["groups"]
        weight = _tensor(tensors, f"{name}.weight", (cout, cin // g, *a["kernel_size"]))
        bias = _tensor(tensors, f"{name}.bias", (cout,)) if a["bias"] else None
        bias_map = (_tensor(tensors, f"{name}.bias_map", None if shape is None else (cout, *shape[2:]))
                    if a.get("bias_map") else None)  # (out, H, W): the spatial size is the recorded output's
        conv = nn.Conv2d(cin, cout, tuple(a["kernel_size"]), stride=tuple(a["stride"]),
                         padding=a["padding"] if isinstance(a["padding"], str) else tuple(a["padding"]),
                         dilation=tuple(a["dilation"]), groups=g, bias=a["bias"], padding_mode=a["padding_mode"],
                         device="meta")
        conv.weight = nn.Parameter(weight)
        if bias is not None:
            conv.bias = nn.Parameter(bias)
        out: dict[str, nn.Module] = {name: conv}
        if bias_map is not None:
            out[f"{name}__bias_map"] = BiasMap(bias_map)
        return out
    if type_ == "linear":
        fi, fo = a["in_features"], a["out_features"]
        b = _tensor(tensors, f"{name}.bias", (fo,)) if a["bias"] else None
        return {name: dense_linear(_tensor(tensors, f"{name}.weight", (fo, fi)), b)}
    if type_ == "batch_norm":
        c = (a["num_features"],)
        w, b = ((_tensor(tensors, f"{name}.weight", c), _tensor(tensors, f"{name}.bias", c)) if a["affine"]
                else (None, None))
        return {name: EvalBatchNorm(_tensor(tensors, f"{name}.running_mean", c),
                                    _tensor(tensors, f"{name}.running_var", c), w, b, float(a["eps"]))}
    if type_ == "layer_norm":
        affine = {key: _tensor(tensors, f"{name}.{key}", tuple(a["normalized_shape"])) for key in ("weight", "bias")
                  if a[key]}
        ln = nn.LayerNorm(a["normalized_shape"], eps=a["eps"], elementwise_affine=a["weight"], bias=a["bias"],
                          device="meta")
        for key, value in affine.items():
            setattr(ln, key, nn.Parameter(value))
        return {name: ln}
    if type_ == "group_norm":
        affine = ({key: _tensor(tensors, f"{name}.{key}", (a["num_channels"],)) for key in ("weight", "bias")}
                  if a["affine"] else {})
        gn = nn.GroupNorm(a["num_groups"], a["num_channels"], eps=a["eps"], affine=a["affine"], device="meta")
        for key, value in affine.items():
            setattr(gn, key, nn.Parameter(value))
        return {name: gn}
    if type_ == "maxpool2d":
        return {name: nn.MaxPool2d(a["kernel_size"], a["stride"], a["padding"], a["dilation"],
                                   ceil_mode=a["ceil_mode"])}
    assert type_ == "const"
    return {name: Const(_tensor(tensors, f"{name}.value"))}


def build_graph_net(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[GraphNet, list[tuple]]:
    """The :class:`GraphNet` of a version-4 ``model.json`` and its tensors, and (name, weight, bias) of each
    linear op (for :func:`dturbo.export.load`'s kernel choice). :class:`ExportError` naming the problem."""
    ops = spec["ops"]
    if not isinstance(ops, list) or len(ops) < 2 or not all(isinstance(e, dict) for e in ops) \
            or ops[0].get("type") != "input" or ops[-1].get("type") != "output":
        raise ExportError(f"{SPEC_FILE}: 'ops' must be a list of objects from an 'input' to an 'output'")
    input_name = ops[0].get("name")
    if not isinstance(input_name, str):
        raise ExportError(f"{SPEC_FILE}: the input has no name")
    defined = {input_name}
    steps: list[_Step] = []
    modules: dict[str, nn.Module] = {}
    linears = []
    for entry in ops[1:-1]:
        t, name, args, attrs = entry.get("type"), entry.get("name"), entry.get("args"), entry.get("attrs")
        if t not in VOCABULARY or not isinstance(name, str) or not name.isidentifier() or name in defined \
                or name in modules or hasattr(GraphNet, name) or name in _GRAPHNET_ATTRS:
            raise ExportError(f"{SPEC_FILE}: unknown or duplicate operation {t!r} named {name!r} (the ops export "
                              f"writes: {', '.join(VOCABULARY)})")
        if not isinstance(args, list) or not isinstance(attrs, dict):
            raise ExportError(f"{SPEC_FILE}: operation {name!r} ({t}) needs 'args' (a list) and 'attrs' (an object)")
        _check_value(args, defined, f"operation {name!r}")
        _check_value(list(attrs.values()), set(), f"operation {name!r}")  # constants only
        if t in _MODULE_OPS:
            try:
                made = _module(name, t, attrs, tensors, entry.get("shape"))
            except ExportError:
                raise
            except (KeyError, TypeError, ValueError, RuntimeError, ArithmeticError, IndexError, AttributeError) as err:
                raise ExportError(f"{SPEC_FILE}: operation {name!r} ({t}) is malformed: {err!r}") from None
            if any(k in modules or k in defined for k in made):
                raise ExportError(f"{SPEC_FILE}: duplicate operation named {sorted(made)!r}")
            modules.update(made)
            shape = entry.get("shape")
            if t == "linear" and isinstance(shape, list) and len(shape) == 2:  # sparse kernels take (N, in) only
                layer = made[name]
                linears.append((name, layer.weight.detach(), None if layer.bias is None else layer.bias.detach()))
        # lists of attributes (kernel sizes, dims) as tuples, as torch takes them
        steps.append(_Step(name, t, args, {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}, []))
        defined.add(name)
    output = ops[-1].get("args", [None])[0]
    _check_value(output, defined, "the output")
    last: dict[str, int] = {}
    for i, s in enumerate(steps):
        for ref in _refs(s.args):
            last[ref] = i
    kept = set(_refs(output))
    for ref, i in last.items():
        if ref not in kept:
            steps[i].free.append(ref)
    return GraphNet(input_name, steps, output, modules), linears
