"""The graph format of an export (:mod:`dturbo.export.graph`): its vocabulary of ops, how each runs, and a graph
in memory (:class:`Node`, :class:`ExportedGraph`)."""


from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .format import FORMAT, GRAPH_VERSION, save
from .ops import ACTIVATIONS, Op

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


