"""Inference kernels for the layers of an exported model, and the timing that picks one per layer.

Convolutions: ``default`` (oneDNN on a CPU), ``native`` (PyTorch's own CPU kernels, faster for thin
layers) or ``direct`` (dturbo's kernel for thin layers, :mod:`dturbo.native`), see
:class:`NativeConv2d`, :class:`DirectConv2d` and :func:`choose_conv_kernel`. Max-pooling: ``default``
(:class:`torch.nn.MaxPool2d`) or ``separable`` (strided elementwise maxima, the same values, much faster for
few channels), see :class:`SeparableMaxPool2d` and :func:`choose_pool_kernel`. Linear layers, below.

A layer's weight has already been compacted (all-zero rows and columns removed, see :mod:`dturbo.export`);
what is left is in-layer sparsity. The kernels (REFERENCE.md, "Inference on CPU"):

* ``dense``: :class:`torch.nn.Linear` on the compacted weight (zeros included): one GEMM.
* ``panel``: the rows are cut into bands of 32; per band, one dense GEMM per run of input columns that hold
  a nonzero (gaps of up to ``max_gap`` zero columns are bridged). Clustered sparsity makes few, large runs.
* ``bsr``: block-sparse rows (8x8 blocks, int32 indices) through ``torch.addmm`` with the activations kept
  features x batch (``F.linear`` with a sparse weight is slow). Pays off at small batches.
* ``csr``: compressed sparse rows with int32 indices; only ever wins at batch 1.

Which one is fastest depends on the batch size and the machine, so :func:`choose_linear_kernel` times them
briefly and keeps a sparse kernel only where it beats dense by a margin. The sparse kernels are excluded from
``torch.compile`` (it would break the graph there anyway); the dense layers around them are compiled.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from . import native

_Conv = TypeVar("_Conv", bound=nn.Conv2d)

KERNELS = ("dense", "panel", "bsr", "csr")
# Above this density (of the compacted weight) a sparse kernel is not even tried.
SPARSE_MAX_DENSITY = 0.6
# A sparse kernel must be at least this much faster than dense to be chosen (timing noise, and the
# compiled dense path often gains a little more than the eager timing shows).
MARGIN = 0.9


class PanelLinear(nn.Module):
    """y = x W^T + b from dense GEMMs over bands of ``band`` output rows and the column runs each band needs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, band: int = 32, max_gap: int = 8) -> None:
        super().__init__()
        out_f, in_f = weight.shape
        self.in_features, self.out_features = int(in_f), int(out_f)
        self.spans: list[tuple[int, int, int, int]] = []
        self._piece_names: list[str] = []
        for r0 in range(0, out_f, band):
            r1 = min(out_f, r0 + band)
            used = (weight[r0:r1] != 0).any(0).tolist()
            for c0, c1 in column_runs(used, max_gap):
                name = f"piece{len(self.spans)}"
                # stored (columns x rows): the right operand of x[:, c0:c1] @ piece, contiguous
                self.register_buffer(name, weight[r0:r1, c0:c1].t().contiguous())
                self.spans.append((r0, r1, c0, c1))
                self._piece_names.append(name)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.bias is None:
            out = x.new_zeros(x.shape[0], self.out_features)
        else:
            out = self.bias.expand(x.shape[0], self.out_features).contiguous()
        for (r0, r1, c0, c1), name in zip(self.spans, self._piece_names, strict=True):
            out[:, r0:r1].addmm_(x[:, c0:c1], self._buffers[name])
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pieces={len(self.spans)}"


def column_runs(used: list[bool], max_gap: int) -> list[tuple[int, int]]:
    """Half-open runs ``(c0, c1)`` covering every True of ``used``; runs separated by at most ``max_gap``
    False entries are merged."""
    runs: list[tuple[int, int]] = []
    for c, u in enumerate(used):
        if not u:
            continue
        if runs and c - runs[-1][1] <= max_gap:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return runs


class _SparseAddmmLinear(nn.Module):
    """Common part of the BSR and CSR kernels: ``addmm(bias, W_sparse, x^T)^T`` on a padded weight."""

    in_features: int
    out_features: int
    padded_in: int

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.padded_in == self.in_features:
            xt = x.t()
        else:
            xt = x.new_zeros(self.padded_in, x.shape[0])
            xt[: self.in_features].copy_(x.t())
        y = torch.addmm(self.bias_col, self.weight, xt)  # (padded out, batch)
        return y[: self.out_features].t().reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.weight.values().numel()}"


class BsrLinear(_SparseAddmmLinear):
    """Block-sparse weight (``block`` x ``block`` blocks; the shape is padded to a multiple of ``block``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, block: int = 8) -> None:
        super().__init__()
        out_f, in_f = weight.shape
        self.in_features, self.out_features, self.block = int(in_f), int(out_f), block
        po, pi = math.ceil(out_f / block) * block, math.ceil(in_f / block) * block
        self.padded_in = pi
        wp = weight.new_zeros(po, pi)
        wp[:out_f, :in_f] = weight
        with warnings.catch_warnings():  # "sparse BSR support is in beta state"
            warnings.simplefilter("ignore", UserWarning)
            b = wp.to_sparse_bsr((block, block))
            w = torch.sparse_bsr_tensor(b.crow_indices().to(torch.int32), b.col_indices().to(torch.int32),
                                        b.values().contiguous(), size=b.shape, check_invariants=False)
        self.register_buffer("weight", w)
        bc = weight.new_zeros(po, 1)
        if bias is not None:
            bc[:out_f, 0] = bias
        self.register_buffer("bias_col", bc)


class CsrLinear(_SparseAddmmLinear):
    """Compressed-sparse-row weight with int32 indices."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_f, in_f = weight.shape
        self.in_features, self.out_features = int(in_f), int(out_f)
        self.padded_in = int(in_f)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            c = weight.to_sparse_csr()
            w = torch.sparse_csr_tensor(c.crow_indices().to(torch.int32), c.col_indices().to(torch.int32),
                                        c.values().contiguous(), size=c.shape, check_invariants=False)
        self.register_buffer("weight", w)
        bc = weight.new_zeros(out_f, 1)
        if bias is not None:
            bc[:, 0] = bias
        self.register_buffer("bias_col", bc)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ordinary :class:`torch.nn.Linear` holding ``weight`` and ``bias``."""
    out_f, in_f = weight.shape
    layer = nn.Linear(int(in_f), int(out_f), bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def panel_gap(batch_size: int) -> int:
    """Zero columns a panel run may bridge: one GEMM call costs about as much as a few thousand multiply-adds
    per row, i.e. many columns at a small batch and about one at a large batch."""
    return max(1, min(64, 2048 // max(batch_size, 1)))


def make_linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, batch_size: int = 256) -> nn.Module:
    """The linear layer ``kind`` (one of :data:`KERNELS`) for ``weight`` (out x in) and ``bias``; ``batch_size``
    tunes the panel kernel's run merging."""
    if kind == "dense":
        return dense_linear(weight, bias)
    if kind == "panel":
        return PanelLinear(weight, bias, max_gap=panel_gap(batch_size))
    if kind == "bsr":
        return BsrLinear(weight, bias)
    if kind == "csr":
        return CsrLinear(weight, bias)
    raise ValueError(f"unknown linear kernel {kind!r}; choose one of {', '.join(KERNELS)}")


class NativeConv2d(nn.Conv2d):
    """A convolution run by PyTorch's own CPU kernels instead of oneDNN (mkldnn). oneDNN is slow for thin
    layers (few input and output channels, e.g. a first layer on one-channel images, or any layer that export
    has cut down to a few channels): 3000 28x28 images through a 1->2 channel 7x7 conv take ~90 ms with oneDNN
    and ~25 ms without on a 2-core CPU. The switch is process-global for the duration of the call."""

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        previous = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return super().forward(x)
        finally:
            torch._C._set_mkldnn_enabled(previous)


class DirectConv2d(nn.Conv2d):
    """A convolution run by dturbo's direct kernel (:func:`dturbo.native.conv_direct`), for thin layers: its cost
    follows the channels, where oneDNN's 7x7 conv1 stays that of a 6-channel layer when export has cut it to 2 or
    3 (docs/export.md#the-direct-kernel). The same sums in another order: outputs equal oneDNN's within float32
    rounding. Only
    for stride 1, dilation 1, groups 1, a square kernel, the same zero padding on every side, float32 on the CPU
    (:func:`direct_supported`); any other input runs PyTorch's convolution."""

    # Fused with the layers that follow (:func:`fuse_direct`): a per-position bias (C, H, W) added first, a leaky
    # ReLU's negative slope, a max-pooling's (kernel, stride); those layers are then left out of the network.
    bias_map: torch.Tensor | None
    slope: float | None = None
    pool: tuple[int, int] | None = None

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 (nn.Conv2d's)
        super().__init__(*args, **kwargs)
        self.register_buffer("bias_map", None)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            y = super().forward(x)
            if self.bias_map is not None:
                y = y + self.bias_map
            if self.slope is not None:
                y = F.leaky_relu(y, self.slope)
            return y if self.pool is None else F.max_pool2d(y, self.pool[0], self.pool[1])
        bias = self.bias if self.bias is not None else self.weight.new_zeros(self.out_channels)
        return native.conv_direct(x, self.weight, bias, as_pair(self.padding)[0],  # type: ignore[arg-type]
                                  bias_map=self.bias_map, slope=self.slope, pool=self.pool)

    @property
    def is_fused(self) -> bool:
        """Whether it computes layers after the convolution too."""
        return self.bias_map is not None or self.slope is not None or self.pool is not None

    def extra_repr(self) -> str:
        fused = (["bias_map"] if self.bias_map is not None else []) + (
            [f"leaky_relu({self.slope})"] if self.slope is not None else []) + (
            [f"max_pool(kernel={self.pool[0]}, stride={self.pool[1]})"] if self.pool else [])
        return super().extra_repr() + (f", fused=[{', '.join(fused)}]" if fused else "")


def fusable(conv: nn.Conv2d, act: nn.Module, pool: nn.Module | None, bias_map: torch.Tensor | None = None) -> bool:
    """Whether :func:`fuse_direct` can take ``conv`` (:func:`direct_supported`), ``bias_map`` (None, or one value
    per output channel and position: ``(C, H, W)`` or ``(1, C, H, W)``), ``act`` (a leaky ReLU) and ``pool`` (a
    max-pooling with a square kernel and stride, no padding, dilation, ceil mode or indices; or None)."""
    if not isinstance(act, nn.LeakyReLU) or not direct_supported(conv):
        return False
    if bias_map is not None and (bias_map.dim() not in (3, 4) or bias_map.shape[-3] != conv.out_channels
                                 or bias_map.numel() != conv.out_channels * bias_map.shape[-2] * bias_map.shape[-1]):
        return False
    if pool is None:
        return True
    return (isinstance(pool, nn.MaxPool2d) and separable_supported(pool)
            and len(set(as_pair(pool.kernel_size))) == 1 and len(set(as_pair(pool.stride or pool.kernel_size))) == 1)


def fuse_direct(conv: nn.Conv2d, act: nn.LeakyReLU, pool: nn.MaxPool2d | None,
                bias_map: torch.Tensor | None = None) -> DirectConv2d:
    """``conv`` (parameters shared) run by the direct kernel with ``bias_map`` added, ``act`` and then ``pool``
    applied in the same pass (:func:`fusable`): the same values as the layers (the pooling's maxima of the same
    floats), one write of the pooled output instead of a pass over the convolution's output per layer."""
    if not fusable(conv, act, pool, bias_map):
        raise ValueError(f"cannot fuse {conv}, {act} and {pool} into the direct conv kernel")
    new = _rebuilt(DirectConv2d, conv)  # a new module even from a DirectConv2d: the fusion must not change it
    if bias_map is not None:
        new.bias_map = bias_map.detach().reshape(bias_map.shape[-3:]).contiguous()
    new.slope = float(act.negative_slope)
    if pool is not None:
        new.pool = (as_pair(pool.kernel_size)[0], as_pair(pool.stride or pool.kernel_size)[0])
    return new


def direct_supported(conv: nn.Conv2d) -> bool:
    """Whether :class:`DirectConv2d` computes ``conv``: its shape (stride 1, dilation 1, groups 1, a square
    kernel, equal integer zero padding) and the native kernels built on this machine."""
    (kh, kw), pad = as_pair(conv.kernel_size), conv.padding
    shape_ok = (conv.groups == 1 and kh == kw and as_pair(conv.stride) == (1, 1)
                and as_pair(conv.dilation) == (1, 1) and conv.padding_mode == "zeros"
                and not isinstance(pad, str) and len(set(as_pair(pad))) == 1)
    return shape_ok and native.available()


# The direct kernel is timed only for layers of at most this many input and output channels: on wider ones
# oneDNN's blocking wins, and timing a slow kernel there would only slow loading.
DIRECT_MAX_CHANNELS = 64


def direct_worth_timing(conv: nn.Conv2d) -> bool:
    """Whether the automatic choices time the direct kernel for ``conv``: :func:`direct_supported`, and thin
    (at most :data:`DIRECT_MAX_CHANNELS` input and output channels)."""
    return max(conv.in_channels, conv.out_channels) <= DIRECT_MAX_CHANNELS and direct_supported(conv)


# "default": PyTorch's own choice (oneDNN on a CPU, cuDNN on CUDA); "native": PyTorch's CPU kernels, no oneDNN;
# "direct": dturbo's kernel for thin layers (DirectConv2d).
CONV_KERNELS = ("default", "native", "direct")
_CONV_CLASSES: dict[str, type[nn.Conv2d]] = {"default": nn.Conv2d, "native": NativeConv2d, "direct": DirectConv2d}


def conv_as(kind: str, conv: nn.Conv2d) -> nn.Conv2d:
    """``conv`` (its parameters shared) as the conv kernel ``kind`` (one of :data:`CONV_KERNELS`)."""
    if kind not in CONV_KERNELS:
        raise ValueError(f"unknown conv kernel {kind!r}; choose one of {', '.join(CONV_KERNELS)}")
    if isinstance(conv, DirectConv2d) and conv.is_fused:
        if kind == "direct":
            return conv
        raise ValueError(f"{conv} computes the layers after it too: it cannot run the {kind!r} kernel")
    if kind == "direct" and not direct_supported(conv):
        why = native.unavailable_reason() or "it needs stride 1, dilation 1, groups 1, a square kernel"
        raise ValueError(f"the direct conv kernel cannot run {conv}: {why}")
    target = _CONV_CLASSES[kind]
    return conv if type(conv) is target else _rebuilt(target, conv)


def _rebuilt(target: type[_Conv], conv: nn.Conv2d) -> _Conv:
    """A ``target`` module with ``conv``'s shape, sharing its parameters, in its train/eval mode."""
    new = target(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,  # type: ignore[arg-type]
                 conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode, device="meta")
    new.weight, new.bias = conv.weight, conv.bias
    return new.train(conv.training)


@torch.no_grad()
def choose_conv_kernel(conv: nn.Conv2d, x: torch.Tensor) -> tuple[nn.Conv2d, str, dict[str, float]]:
    """Time ``conv`` on its input ``x`` with the default kernel (oneDNN), PyTorch's native CPU kernels and, for a
    thin layer (:func:`direct_worth_timing`), dturbo's direct kernel; keep the fastest other than default only
    where it is faster by :data:`MARGIN`. Off the CPU (or without oneDNN) nothing is timed."""
    if x.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return conv_as("default", conv), "default", {}
    times: dict[str, float] = {}
    for kind in CONV_KERNELS:
        if kind == "direct" and (not direct_worth_timing(conv) or x.dtype != torch.float32):
            continue
        layer = conv_as(kind, conv)
        times[kind] = 1000 * time_call(lambda layer=layer: layer(x), x.device, repeats=5, warmup=1)
    other = min((k for k in times if k != "default"), key=lambda k: times[k])
    kind = other if times[other] < MARGIN * times["default"] else "default"
    return conv_as(kind, conv), kind, times


POOL_KERNELS = ("default", "separable")


class SeparableMaxPool2d(nn.MaxPool2d):
    """Max-pooling as strided elementwise maxima: first along the width (k shifted strided views), then along
    the height. Max is exact and associative, so the output equals :class:`torch.nn.MaxPool2d`'s bit for bit;
    PyTorch's CPU max-pooling kernel vectorises over channels and is slow when there are few of them
    (:func:`choose_pool_kernel` times both on the real input; ``benchmarks/bench_inference.py``). Only for
    padding 0, dilation 1, no ceil mode and no indices (:func:`separable_supported`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (sh, sw) = as_pair(self.kernel_size), as_pair(self.stride or self.kernel_size)
        h, w = x.shape[-2:]
        ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
        y = x[..., :, 0 : (wo - 1) * sw + 1 : sw]
        for j in range(1, kw):
            y = torch.maximum(y, x[..., :, j : j + (wo - 1) * sw + 1 : sw])
        z = y[..., 0 : (ho - 1) * sh + 1 : sh, :]
        for j in range(1, kh):
            z = torch.maximum(z, y[..., j : j + (ho - 1) * sh + 1 : sh, :])
        return z


def as_pair(v: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    """A layer size argument (int, or a pair as tuple or JSON list) as (height, width)."""
    return (int(v[0]), int(v[1])) if isinstance(v, tuple | list) else (int(v), int(v))


def separable_supported(pool: nn.MaxPool2d) -> bool:
    """Whether :class:`SeparableMaxPool2d` computes ``pool`` (no padding, dilation, ceil mode or indices)."""
    return (as_pair(pool.padding) == (0, 0) and as_pair(pool.dilation) == (1, 1) and not pool.ceil_mode
            and not pool.return_indices)


def pool_as(kind: str, pool: nn.MaxPool2d) -> nn.MaxPool2d:
    """``pool`` as the pooling kernel ``kind`` (one of :data:`POOL_KERNELS`)."""
    if kind not in POOL_KERNELS:
        raise ValueError(f"unknown pooling kernel {kind!r}; choose one of {', '.join(POOL_KERNELS)}")
    if kind == "separable" and not separable_supported(pool):
        raise ValueError(f"{pool} has padding, dilation, ceil mode or indices: the separable kernel cannot run it")
    target = SeparableMaxPool2d if kind == "separable" else nn.MaxPool2d
    if type(pool) is target:
        return pool
    return target(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.return_indices, pool.ceil_mode)


def choose_pool_kernel(pool: nn.MaxPool2d, x: torch.Tensor) -> tuple[nn.MaxPool2d, str, dict[str, float]]:
    """Time ``pool`` on its input ``x`` with both kernels where the separable one applies; keep separable only
    where it is faster by :data:`MARGIN`."""
    if not separable_supported(pool):
        return pool_as("default", pool), "default", {}
    times = {kind: 1000 * time_call(lambda m=pool_as(kind, pool): m(x), x.device, repeats=5, warmup=1)
             for kind in POOL_KERNELS}
    kind = "separable" if times["separable"] < MARGIN * times["default"] else "default"
    return pool_as(kind, pool), kind, times


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(limit_bytes: int = 1 << 30) -> bool:
    """Have glibc's allocator keep freed blocks of up to ``limit_bytes`` for reuse, for the rest of the
    process. Returns False where this is not glibc (nothing changed).

    Why: glibc serves every block above its mmap threshold (32 MiB at most by default) with fresh pages from
    the kernel, zeroed and page-faulted in on first touch, and hands them back on free. At batch 3000 a dense
    alexnet-small's first activations are 56 MiB each, so every pass pays that again (its first activation took
    26 ms where an exported one, below the threshold, took 2). Timing with the default threshold measures the
    allocator, not the network: benchmarks/bench_allocator.py measures both (dense 198 -> 111 ms, 2 threads).
    Not fully understood: a single 64 MiB block refilled in a loop still page-faults in most refills with this
    setting (and with mmap off altogether), so the mechanism is more than the threshold. ``MALLOC_MMAP_THRESHOLD_``
    and ``MALLOC_TRIM_THRESHOLD_`` in the environment do the same as this call for a whole process."""
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, limit_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, limit_bytes))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_call(fn: Callable[[], object], device: torch.device, *, repeats: int = 7, warmup: int = 2,
              budget_s: float = 1.0) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls; stops early once the
    calls have taken ``budget_s`` (at least 3 timed calls). CUDA calls are timed with CUDA events."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    spent = 0.0
    for i in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1000.0
        else:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        if spent > budget_s and i >= 2:
            break
    return statistics.median(times)


@torch.no_grad()
def choose_linear_kernel(
    weight: torch.Tensor, bias: torch.Tensor | None, batch_size: int, *, kernels: tuple[str, ...] = KERNELS,
    device: torch.device | None = None,
) -> tuple[nn.Module, str, dict[str, float]]:
    """Time the candidate kernels for one layer at ``batch_size`` and return (layer, kernel name, times in ms).

    Sparse kernels are tried only below :data:`SPARSE_MAX_DENSITY`; each must reproduce the dense output
    (to 1e-4 relative) and beat dense by :data:`MARGIN` to be chosen. ``kernels`` limits the candidates
    (``("dense",)`` times nothing)."""
    device = device or weight.device
    dense = dense_linear(weight, bias).to(device).eval()
    density = float((weight != 0).float().mean()) if weight.numel() else 1.0
    sparse = [k for k in kernels if k != "dense"]
    if not sparse or density > SPARSE_MAX_DENSITY or weight.numel() == 0:
        return dense, "dense", {}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, weight.shape[1], generator=gen).to(device)
    ref = dense(x)
    scale = float(ref.abs().max()) + 1.0
    times = {"dense": 1000 * time_call(lambda: dense(x), device)}
    best, best_name = dense, "dense"
    for name in sparse:
        try:
            layer = make_linear(name, weight, bias, batch_size).to(device).eval()
            if (layer(x) - ref).abs().max() > 1e-4 * scale:
                continue
        except (RuntimeError, NotImplementedError):  # a format this torch build lacks on this device
            continue
        times[name] = 1000 * time_call(lambda layer=layer: layer(x), device)
        if times[name] < MARGIN * times["dense"] and times[name] < times[best_name]:
            best, best_name = layer, name
    return best, best_name, times

