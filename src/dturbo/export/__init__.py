"""Export a run's global model as a compact inference model, and load it back.

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
:func:`export_model` as a graph (:mod:`dturbo.export.graph`, format version 4), with the same compaction
mechanics on the links of the graph that allow it; :func:`load` reads both formats.

The package, one job per module (this file: exporting a run or a state, and the public names):

* :mod:`~dturbo.export.ops`: the op vocabulary of the built-in format, a built-in model as ops, ops as modules;
* :mod:`~dturbo.export.compaction`: removing units across layers (the first bullet above);
* :mod:`~dturbo.export.format`: the two files, their versions, writing and reading them;
* :mod:`~dturbo.export.runtime`: the loaded model and its autotuning (kernel choice by timing, the second bullet);
* :mod:`~dturbo.export.graph`: any model as a graph of ops (torch.fx).

A run's architecture comes from the run itself (:meth:`dturbo.rundir.RunDir.build_model`), not from tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..rundir import RunDir, RunDirError, classifier_rows
from .compaction import MIN_INPUT_DROP, compact, compact_links, layer_stats, update_shapes
from .format import (
    FORMAT,
    GRAPH_VERSION,
    READS_VERSIONS,
    SPEC_FILE,
    VERSION,
    WEIGHTS_FILE,
    ExportError,
    check_input_norm,
    read_spec,
    save,
)
from .graph import ExportedGraph, export_model
from .graph_load import GraphNet
from .ops import (
    ACTIVATIONS,
    BiasMap,
    Exported,
    IndexSelect,
    Op,
    built_in_layout,
    masked_weights,
    ops_from_model,
    ops_from_state,
)
from .runtime import INPUTS, InferenceModel, load

__all__ = [
    "ACTIVATIONS", "FORMAT", "GRAPH_VERSION", "INPUTS", "MIN_INPUT_DROP", "READS_VERSIONS", "SPEC_FILE", "VERSION",
    "WEIGHTS_FILE", "BiasMap", "ExportError", "Exported", "ExportedGraph", "GraphNet", "IndexSelect",
    "InferenceModel", "Op", "built_in_layout", "check_input_norm", "compact", "compact_links", "export_model",
    "export_ops", "export_run", "export_state", "layer_stats", "load", "masked_weights", "ops_from_model",
    "ops_from_state", "read_run", "read_spec", "removed_nothing", "save", "update_shapes",
]


# ----------------------------------------------------------------------------------------------- reading a run
def removed_nothing(spec: dict[str, Any]) -> str | None:
    """What to say when export kept every weight (no whole all-zero row, column or channel: the model runs at
    dense speed), with how to train for speed; None when it removed some."""
    totals = spec["totals"]
    if totals["weights_after"] < totals["weights_before"]:
        return None
    return ("export removed nothing: no row, column or channel of the model is all zero, so it runs as fast as the "
            "dense network. To train a faster model, let training remove whole channels: `dturbo run --preset "
            "speed`, or [dturbo.prior.conv] tie_rows = true with the convolutions' own layer_targets "
            "(docs/export.md#train-for-speed)")


def read_run(run_dir: str | Path) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """(config, model tensors, metadata) of a run directory; :class:`ExportError` naming the problem."""
    run = RunDir(run_dir)
    try:
        cfg = run.config()
        state, meta = run.read_model()
    except RunDirError as err:
        raise ExportError(str(err)) from None
    return cfg, state, meta



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
        probe = built_in_layout(model_name, input_shape, 1, hidden=hidden, width=width)
        try:
            num_classes = classifier_rows(probe, state)
        except RunDirError as err:
            raise ExportError(str(err)) from None
    model = built_in_layout(model_name, input_shape, num_classes, hidden=hidden, width=width)
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
                          f"example_input=...) (docs/export.md, 'Any model')")
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

    from ..data import DataError, load_dataset

    try:
        with warnings.catch_warnings():  # label remarks were made when the run started
            warnings.simplefilter("ignore")
            ds = load_dataset(cfg.data.name, cfg.data.path, limit_train=cfg.data.limit_train, limit_test=1,
                              seed=cfg.experiment.seed, standardize=cfg.data.standardize)
    except (DataError, ValueError, OSError):
        return None
    if ds.input_shape != tuple(input_shape) or ds.input_norm is None:
        return None
    return check_input_norm(ds.input_norm, input_shape, f"data {cfg.data.name!r}")


