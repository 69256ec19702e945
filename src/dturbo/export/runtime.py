"""The exported model at run time, and its autotuning: :func:`load` builds the network from the files and picks, by
timing at the batch size in use, each linear layer's kernel (dense or sparse), each convolution's and max-pooling's,
channels_last and ``torch.compile``; :class:`InferenceModel` holds the network and the choices."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..kernels import (
    CONV_KERNELS,
    KERNELS,
    MARGIN,
    POOL_KERNELS,
    choose_conv_kernel,
    choose_linear_kernel,
    choose_pool_kernel,
    conv_as,
    direct_supported,
    direct_worth_timing,
    fusable,
    fuse_direct,
    make_linear,
    pool_as,
    separable_supported,
    time_call,
)
from . import choices
from .format import GRAPH_VERSION, ExportError, read_spec
from .ops import BiasMap, build_net

INPUTS = ("normalised", "raw")
# The largest activation (input included) one forward pass at the load's batch size may make: larger ones are
# refused before anything runs (load with a smaller batch_size).
MAX_ACTIVATION_BYTES = 256 << 20


class InferenceModel(nn.Module):
    """An exported network: ``net`` (an :class:`torch.nn.Sequential` of torch layers, or for a graph export a
    :class:`dturbo.export.graph_load.GraphNet`) plus the execution
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
        self.pools: dict[str, str] = {}  # max-pooling layer -> kernel (dturbo.kernels.POOL_KERNELS), or "fused"
        self.fused: dict[str, list[str]] = {}  # direct conv -> the layers it computes too (left out of ``net``)
        self.channels_last = False
        self.compiled = False
        self.info: dict[str, Any] = {}
        # (graph, static input, static output) of the forward pass captured at one input shape (set_graphed)
        self._graph: tuple[Any, torch.Tensor, torch.Tensor] | None = None
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
        if self._graph is not None and self._graph[1].shape == x.shape and self._graph[1].device == x.device:
            graph, static_in, static_out = self._graph
            static_in.copy_(x)
            graph.replay()
            # A copy: the next replay overwrites the static output, and a caller may hold two results.
            return static_out.clone()
        if self._compiled_fn is not None:
            return self._compiled_fn(x)
        return self.net(x)

    @property
    def graphed(self) -> bool:
        """Whether inputs of the captured shape run as one CUDA graph replay (:meth:`set_graphed`)."""
        return self._graph is not None

    @torch.no_grad()
    def set_graphed(self, x: torch.Tensor | None) -> None:
        """Capture the forward pass at ``x``'s shape as one CUDA graph (``None``: drop it). A small network's
        GPU time is mostly kernel launches: a replay launches them all at once. Inputs of another shape run
        without it. Changing the kernels, the memory format or compilation drops it (it holds the kernels of
        its capture): capture again after."""
        if x is None:
            self._graph = None
            return
        if x.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a model and inputs on a CUDA device, got inputs on {x.device}")
        if self._compiled_fn is not None:
            raise ValueError("a compiled model makes its own CUDA graphs (torch.compile's mode "
                             "'reduce-overhead'); set_compiled(False) first")
        self._graph = None
        static_in = self.prepare(x).clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires (cuDNN's choices)
            for _ in range(3):
                self.net(static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.net(static_in)
        self._graph = (graph, static_in, static_out)

    def set_channels_last(self, on: bool) -> None:
        """Convert the conv weights (and the inputs at each call) to channels_last, or back."""
        fmt = torch.channels_last if on else torch.contiguous_format
        self._graph = None
        for m in self.net.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.data = m.weight.data.contiguous(memory_format=fmt)
            elif isinstance(m, BiasMap):
                m.set_memory_format(fmt)
        self.channels_last = on

    def set_conv_kernels(self, kinds: dict[str, str]) -> None:
        """Run convolution ``name`` with kernel ``kinds[name]`` (see :data:`dturbo.kernels.CONV_KERNELS`); the
        module of each kind is kept, so switching back needs no recompilation."""
        self._graph = None
        for name, kind in kinds.items():
            if name in self.fused and kind != "direct":
                raise ValueError(f"{name} is fused with {', '.join(self.fused[name])} into the direct kernel; "
                                 f"it cannot run the {kind!r} kernel")
            variants = self._conv_variants.setdefault(name, {})
            current = getattr(self.net, name)
            variants.setdefault(self.kernels.get(name, "default"), current)
            if kind not in variants:
                variants[kind] = conv_as(kind, current)
            setattr(self.net, name, variants[kind])
            self.kernels[name] = kind

    def fuse(self, name: str, layers: list[str]) -> None:
        """Run convolution ``name`` and the ``layers`` after it (maybe a :class:`BiasMap`, a leaky ReLU, then
        maybe a max-pooling) as one direct kernel (:func:`dturbo.kernels.fuse_direct`); those layers become
        identities. For good: the fused convolution keeps no other kernel (:meth:`set_conv_kernels` would drop
        the layers it computes)."""
        self._graph = None
        fused = _fused(getattr(self.net, name), [getattr(self.net, n) for n in layers])
        setattr(self.net, name, fused)
        for n in layers:
            setattr(self.net, n, nn.Identity())
            if n in self.pools:
                self.pools[n] = "fused"
        self._conv_variants[name] = {"direct": fused}
        self.kernels[name] = "direct"
        self.fused[name] = list(layers)

    def set_compiled(self, on: bool) -> None:
        """Run ``net`` through ``torch.compile`` (compiled lazily at the first call; kept when switched off
        and on again), or eagerly."""
        self._graph = None
        if on and self._compiled_cache is None:
            # object.__setattr__: not registered as a submodule (it wraps ``net``, already one)
            object.__setattr__(self, "_compiled_cache", torch.compile(self.net))
        object.__setattr__(self, "_compiled_fn", self._compiled_cache if on else None)
        self.compiled = on


def load(
    model_dir: str | Path, *, batch_size: int = 256, kernels: str = "auto", channels_last: bool | None = None,
    compile: bool | None = False, conv: str = "auto", pool: str = "auto", device: str | torch.device = "cpu",
    inputs: str = "normalised", cuda_graph: bool | None = None,
) -> InferenceModel:
    """Load an exported model as an :class:`InferenceModel` (a ``torch.nn.Module``) in eval mode.

    Args:
        model_dir: the folder written by ``dturbo export``.
        batch_size: the batch size the model will mostly run at; the kernel and setting timings use it.
        kernels: ``"auto"`` (time the candidate kernels per linear layer, keep the fastest: sparse only where
            it beats dense) or one of ``dense``/``panel``/``bsr``/``csr`` for every linear layer.
        channels_last: ``None`` (auto: for networks with convolutions, time both memory formats and keep the
            faster), ``True`` or ``False``.
        compile: ``False`` (the default: eager, so a load takes well under a second), ``True``, or ``None``
            (auto: for networks with convolutions, compile with ``torch.compile`` and keep it if a timing shows it
            faster; falls back to eager when compilation fails; compiling takes seconds to tens of seconds).
        conv: ``"auto"`` (per convolution, time oneDNN against PyTorch's native CPU kernels and, for thin
            layers, dturbo's direct kernel (:mod:`dturbo.native`) on the layer's real input; keep another than
            oneDNN only where faster: they are for thin layers; then, with ``pool="auto"`` too, fuse a
            convolution with the bias map, leaky ReLU and max-pooling after it where the direct kernel doing
            all of them is faster), ``"default"`` (oneDNN on a CPU), ``"native"`` or ``"direct"`` (where the
            layer has stride 1 and a square kernel; oneDNN elsewhere).
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
        cuda_graph: on a CUDA device, run inputs of ``batch_size`` rows as one CUDA graph replay
            (:meth:`InferenceModel.set_graphed`): ``None`` (auto: capture on a GPU and keep it if a timing shows
            it faster; never with ``compile``), ``True`` (captured; ``compile=None`` then leaves torch.compile
            off instead of timing it) or ``False``. Inputs of other sizes run eagerly.

    The choices are in the returned model's ``kernels``, ``pools``, ``channels_last``, ``compiled``,
    ``graphed`` and ``info``.

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
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"cuda_graph=True needs device='cuda', got device={str(dev)!r}")
    if cuda_graph and compile:
        raise ValueError("cuda_graph=True and compile=True together: torch.compile makes its own CUDA graphs "
                         "(mode 'reduce-overhead'); choose one")
    spec, tensors = read_spec(model_dir)
    if spec["version"] == GRAPH_VERSION:
        from .graph_load import build_graph_net

        net, linears = build_graph_net(spec, tensors)
    else:
        net, linears = build_net(spec, tensors)
    check_activations(net, tuple(spec["input_shape"]), batch_size)
    model = InferenceModel(net, spec)
    model.set_inputs(inputs)
    # With every choice left to timing on a CPU, a previous load's choices for this machine and batch size apply.
    timed = (kernels, conv, pool) == ("auto", "auto", "auto") and channels_last is None and not compile \
        and dev.type == "cpu"
    at = choices.key(spec, tensors, batch_size) if timed else ""
    kept = choices.read(model_dir, at) if timed else None
    if kept is not None and not choices.fits(kept, net, [name for name, _, _ in linears]):
        kept = None
    layer_info: dict[str, dict[str, Any]] = {}
    for name, w, b in linears:
        if kept is not None:
            layer = make_linear(kept.linears[name], w.to(dev), None if b is None else b.to(dev), batch_size)
            kind, times = kept.linears[name], {}
        elif kernels == "auto":
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
    if kept is not None:
        _apply(model, kept)
        model.info["choices"] = f"as timed by an earlier load ({model_dir / choices.FILE})"
        return model
    has_conv = any(isinstance(m, nn.Conv2d) for m in net.modules())
    x = _example_input(model, batch_size, dev)
    if channels_last is None:
        channels_last = _channels_last_faster(model, x) if has_conv else False
    model.set_channels_last(bool(channels_last))
    _choose_layer_kernels(model, x, conv, pool)
    if conv == "auto" and pool == "auto":
        _fuse_direct_blocks(model, x)
    if compile or (compile is None and has_conv and not cuda_graph):
        _settle_compile(model, x, auto=compile is None, conv=conv)
    if dev.type == "cuda" and not model.compiled and cuda_graph is not False:
        _settle_graph(model, x, auto=cuda_graph is None)
    if timed:
        lin = {name for name, _, _ in linears}
        choices.write(model_dir, at, choices.Choices(
            linears={n: model.kernels[n] for n in lin},
            convs={n: k for n, k in model.kernels.items() if n not in lin and n not in model.fused},
            pools=dict(model.pools),
            channels_last=model.channels_last, fused=dict(model.fused)))
    return model


def _apply(model: InferenceModel, kept: choices.Choices) -> None:
    """Set the memory format, convolution and pooling kernels and fusions a timed load chose."""
    model.set_channels_last(kept.channels_last)
    model.set_conv_kernels(kept.convs)
    for name, kind in kept.pools.items():
        if kind != "fused":  # a fused one becomes an identity below
            setattr(model.net, name, pool_as(kind, getattr(model.net, name)))
        model.pools[name] = kind
    for name, layers in kept.fused.items():
        model.fuse(name, layers)


def largest_activation(net: nn.Module, input_shape: tuple[int, ...]) -> int:
    """The elements of the largest tensor (the input included) one sample makes in a forward pass of ``net``, found
    on the meta device (shapes only: nothing is allocated); ExportError when the network does not run on inputs of
    ``input_shape``."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(net.parameters(), net.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    shadow = copy.deepcopy(net, memo)
    sizes = [math.prod(input_shape)]
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel() if isinstance(out, torch.Tensor)
                                                                       else 0)) for m in shadow.children()]
    if hasattr(shadow, "record"):  # a graph: every op's output shape
        shadow.record = {}
    try:
        with torch.no_grad():
            shadow(torch.empty(1, *input_shape, device="meta"))
    except Exception as err:  # noqa: BLE001 (any failure of the network on its own input is the export's fault)
        raise ExportError(f"the exported network does not run on inputs of shape (N, "
                          f"{', '.join(map(str, input_shape))}): {type(err).__name__}: {err}") from None
    finally:
        for hook in hooks:
            hook.remove()
    sizes += [math.prod(shape) for shape in (getattr(shadow, "record", None) or {}).values()]
    return max(sizes)


def check_activations(net: nn.Module, input_shape: tuple[int, ...], batch_size: int) -> None:
    """ExportError when a forward pass at ``batch_size`` would make a tensor over :data:`MAX_ACTIVATION_BYTES`."""
    largest = largest_activation(net, input_shape)
    need = 4 * largest * batch_size
    if need > MAX_ACTIVATION_BYTES:
        raise ExportError(f"the exported network makes a tensor of {largest} values per sample: "
                          f"{need / 2**20:.0f} MiB at batch_size {batch_size}, more than the "
                          f"{MAX_ACTIVATION_BYTES >> 20} MiB a load allows; load it with a smaller batch_size")


@torch.no_grad()
def _settle_graph(model: InferenceModel, x: torch.Tensor, *, auto: bool) -> None:
    """Capture the CUDA graph, or (``auto``) time eager against the replay and keep the faster."""
    model.set_graphed(x)
    if not auto:
        return
    captured, model._graph = model._graph, None
    timings = {"eager": 1000 * time_call(lambda: model(x), x.device, repeats=5, warmup=1)}
    model._graph = captured
    timings["graph"] = 1000 * time_call(lambda: model(x), x.device, repeats=5, warmup=1)
    chosen = timings["graph"] < timings["eager"]
    model._graph = captured if chosen else None
    model.info["cuda_graph"] = {"times_ms": timings, "chosen": chosen}


@torch.no_grad()
def _settle_compile(model: InferenceModel, x: torch.Tensor, *, auto: bool, conv: str) -> None:
    """Compile, or (``auto``) time eager against compiled and keep the faster. Inductor fuses oneDNN convolutions
    with what follows while a native or direct one breaks the graph, so where the per-layer choice picked such
    kernels the compiled model is also timed with oneDNN everywhere."""
    convs = {n: k for n, k in model.kernels.items() if k in CONV_KERNELS}
    variants: list[tuple[str, dict[str, str], bool]] = [("compiled", convs, True)]
    if conv == "auto" and any(k != "default" for n, k in convs.items() if n not in model.fused):
        variants.append(("compiled-default-convs", {n: k if n in model.fused else "default"
                                                    for n, k in convs.items()}, True))
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
    layers = [(name, m) for name, m in model.net.named_children() if isinstance(m, nn.Conv2d | nn.MaxPool2d)]
    inputs = _record_inputs(model, x, [name for name, _ in layers])
    for name, m in layers:
        h = inputs.get(name)
        if h is None:  # not reached by the example input: default kernels
            continue
        if isinstance(m, nn.Conv2d):
            if conv == "auto":
                _, kind, times = choose_conv_kernel(m, h)
                model.info["layers"][name] = {"kernel": kind, "times_ms": times}
            else:  # the direct kernel only where it applies (stride 1, a square kernel), like separable pooling
                kind = conv if conv != "direct" or direct_supported(m) else "default"
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


def _record_inputs(model: InferenceModel, x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """The input of each child layer in ``names`` at one pass of ``x`` through ``net``."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = [model.net.get_submodule(name).register_forward_pre_hook(
        lambda _m, args, name=name: inputs.setdefault(name, args[0])) for name in names]
    try:
        model.net(model.prepare(x))
    finally:
        for hook in hooks:
            hook.remove()
    return inputs


def _fused(conv: nn.Conv2d, layers: list[nn.Module]) -> nn.Conv2d:
    """``conv`` and ``layers`` (maybe a :class:`BiasMap`, a leaky ReLU, maybe a max-pooling) as one direct
    kernel."""
    bias_map = layers[0].bias_map if isinstance(layers[0], BiasMap) else None
    act, *pool = layers[bias_map is not None:]
    return fuse_direct(conv, act, pool[0] if pool else None, bias_map)


def _fusable_block(net: nn.Sequential, names: list[str], i: int) -> list[str]:
    """The layers after ``names[i]`` that the direct kernel can compute with it: [bias map,] leaky ReLU[, max
    pooling]; [] where it cannot."""
    conv = getattr(net, names[i])
    if not isinstance(conv, nn.Conv2d):
        return []
    after = names[i + 1: i + 4]
    bias_map = None
    if after and isinstance(getattr(net, after[0]), BiasMap):
        bias_map = getattr(net, after[0]).bias_map
    layers = after[: 1 + (bias_map is not None)]
    act = getattr(net, layers[-1]) if layers else None
    if act is None or not direct_worth_timing(conv) or not fusable(conv, act, None, bias_map):
        return []
    pool = after[len(layers)] if len(after) > len(layers) else None
    if pool is not None and isinstance(getattr(net, pool), nn.MaxPool2d) and fusable(conv, act, getattr(net, pool)):
        layers.append(pool)
    return layers


@torch.no_grad()
def _fuse_direct_blocks(model: InferenceModel, x: torch.Tensor) -> None:
    """Where a convolution the direct kernel can run is followed by a leaky ReLU (maybe after export's bias map),
    and maybe a max-pooling, in a sequential network: time those layers as chosen so far against the direct
    kernel doing all of them in one pass (:func:`dturbo.kernels.fuse_direct`) on their real input, and keep the
    fused one only where it is faster by :data:`dturbo.kernels.MARGIN`. Dense and exported networks alike."""
    if not isinstance(model.net, nn.Sequential) or x.device.type != "cpu":
        return  # a graph export's layers are not a chain to fuse; the kernel is the CPU's
    names = [n for n, _ in model.net.named_children()]
    blocks = [(name, layers) for i, name in enumerate(names) if (layers := _fusable_block(model.net, names, i))]
    if not blocks:
        return
    inputs = _record_inputs(model, x, [name for name, _ in blocks])
    for name, layers in blocks:
        h = inputs.get(name)
        if h is None:
            continue
        mods = [getattr(model.net, n) for n in [name, *layers]]
        fused = _fused(mods[0], mods[1:])
        chain = nn.Sequential(*mods)  # the bias map adds in place to the convolution's fresh output: no harm
        times = {label: 1000 * time_call(lambda f=f, h=h: f(h), h.device, repeats=5, warmup=1)
                 for label, f in (("layers", chain), ("fused", fused))}
        chosen = times["fused"] < MARGIN * times["layers"]
        model.info.setdefault("fusion", {})[name] = {"layers": layers, "times_ms": times, "fused": chosen}
        if chosen:
            model.fuse(name, layers)


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

