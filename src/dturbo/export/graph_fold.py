"""BatchNorm folding and the links compaction works on, on a captured graph (:mod:`dturbo.export.graph`)."""


from __future__ import annotations

from typing import Any

import torch

from ..kernels import as_pair
from .graph_spec import Node
from .ops import ACTIVATIONS, Op


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


