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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..kernels import as_pair
from ..nn.bayes import BayesConv1d, BayesConv2d, BayesianLayer, BayesLinear
from .compaction import compact_links, layer_stats, link_units, update_shapes
from .format import ExportError, check_input_norm
from .graph_fold import fold_batch_norms, graph_links
from .graph_load import build_graph_net
from .graph_spec import (
    _ARGS,
    _CALL_FUNCTIONS,
    _CALL_METHODS,
    _DROPOUT_FUNCTIONS,
    _IDENTITY_METHODS,
    _IDENTITY_MODULES,
    _NOT_ATTRS,
    _P,
    _REQ,
    CHECK_TOL,
    VOCABULARY,
    ExportedGraph,
    Node,
)
from .ops import Op, masked_weights


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
    x = _as_input(example_input)
    capture, expected = _capture(model, x)
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


def _as_input(example_input: torch.Tensor) -> torch.Tensor:
    """The example batch on the CPU, in float32; ids (an embedding's input) stay integers."""
    x = example_input.detach().to("cpu")
    return x.float() if x.is_floating_point() else x


def _capture(model: nn.Module, x: torch.Tensor) -> tuple[_Capture, Any]:
    """The model's graph as :class:`Node` s, captured in eval mode on ``x`` (its mode is restored), and the model's
    output on ``x``."""
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

            try:
                ShapeProp(gm).propagate(x)
            except RuntimeError as err:
                raise ExportError(f"{type(model).__name__} cannot run on example_input of shape {tuple(x.shape)} "
                                  f"and dtype {x.dtype}: {str(err).splitlines()[0]}") from None
            expected = model(x)
            capture = _Capture(gm)
            capture.run()
    finally:
        model.train(training)
    return capture, expected


def unit_links(model: nn.Module, example_input: torch.Tensor) -> list[tuple[str, str, int]]:
    """The links compaction works on, by the modules' paths: ``(producer, consumer, units)`` for each conv / linear
    layer whose output feeds only channel-wise ops (activations, max / adaptive pooling, flatten; BatchNorm folded)
    into exactly one next conv / linear layer, ``units`` output units of the producer being the consumer's input
    units (each a run of ``in_features // units`` consecutive inputs of the consumer: a channel's positions after
    a flatten). Raises ExportError where :func:`export_model` would not capture the graph."""
    x = _as_input(example_input)
    capture, _ = _capture(model, x)
    nodes, output = fold_batch_norms(capture.nodes, capture.output)
    paths = {n.name: str(n.target) for n in capture.gm.graph.nodes if n.op == "call_module"}
    out = []
    for prod, cons, between in graph_links(nodes, output, int(x.shape[0])):
        units = link_units(prod, cons, between)
        if units is not None and prod.name in paths and cons.name in paths:
            out.append((paths[prod.name], paths[cons.name], units))
    return out


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


