"""A graph export built back as ``torch.nn`` layers and ``torch`` functions, without the model's code
(:mod:`dturbo.export.graph`)."""


from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import dense_linear
from .format import SPEC_FILE, ExportError, stored_tensor
from .graph_fold import _refs
from .graph_spec import _FUNCTIONS, _MODULE_OPS, VOCABULARY
from .ops import BiasMap


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

