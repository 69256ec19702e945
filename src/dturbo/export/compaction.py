"""Compaction: units (conv channels, dense neurons) that carry nothing are removed across the layers they join,
their constant contributions folded exactly into the next layer (see :mod:`dturbo.export`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .ops import ACTIVATIONS, CHANNELWISE, PARAM_TYPES, Op

# Drop unused input features only when that removes at least this fraction (the gather costs a copy).
MIN_INPUT_DROP = 0.05


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


def link_units(prod: Op, cons: Op, between: list[Op]) -> int | None:
    """How many units join producer and consumer, or None when units cannot be carried across."""
    if any(op.type not in CHANNELWISE for op in between):
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
    params = [i for i, op in enumerate(ops) if op.type in PARAM_TYPES]
    compact_links([(ops[a], ops[b], ops[a + 1 : b]) for a, b in zip(params[:-1], params[1:], strict=True)])
    out = _select_inputs(ops, params[0]) if params else ops
    update_shapes(out)
    return out


def compact_links(links: list[tuple[Op, Op, list[Op]]]) -> None:
    """Remove units across the links (producer, consumer, the ops between them) until nothing changes; a link
    whose ops between are not all channel-wise (or whose layers cannot carry units) is left alone."""
    links = [link for link in links if link_units(*link) is not None]
    changed = True
    while changed:
        changed = False
        for prod, cons, between in links:
            units = link_units(prod, cons, between)
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


