"""dturbo as a library: run a federated experiment from Python (docs/models.md).

:class:`Experiment` is ``dturbo run`` without the command line: the same :class:`dturbo.sim.Simulator`, so the
same run directory (config.toml, metrics.csv, checkpoint/, messages/, model.safetensors, events.log, figures/),
the same checkpoints every round and the same ``resume``. Data come from the config (``[data]``), or from
arrays in memory, read exactly as a ``.npz`` file's (:func:`dturbo.data.dataset_from_arrays`: the same layouts,
checks and normalisation). The model is the built-in one ``[model]`` names, or one's own (``model=``: any
``torch.nn.Module`` or a function returning one, made Bayesian by :func:`dturbo.nn.bayesianize`).
"""

from __future__ import annotations

import copy
import csv
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .algorithms.plain import DenseStateWarning
from .algorithms.registry import model_options
from .config import Config, ConfigError
from .data import DataError, Dataset, dataset_from_arrays
from .data.readers import NPZ_KEYS
from .device import resolve_device
from .nn.bayes import bayesian_layers
from .nn.convert import ModelSource, user_model_factory
from .nn.models import ID_LAYERS, SERIES_LAYERS, check_input_shape, first_layer
from .rundir import RunDir
from .settings import load_config
from .sim import ModelFactory, ProgressLine, start_run

ConfigSource = Config | Mapping[str, Any] | str | os.PathLike[str]
# (x_train, y_train, x_test, y_test) as numpy arrays or torch tensors, or a mapping with those keys (and
# optionally num_classes), e.g. what np.load gives for an .npz file
DataSource = Sequence[Any] | Mapping[str, Any]
Progress = bool | Callable[[dict[str, Any]], None]


@dataclass
class ExperimentResult:
    """What :meth:`Experiment.run` returns.

    ``metrics``: the rows of ``metrics.csv`` (one per round, also the rounds run before a resume), numbers as
    int or float, an empty cell as None. ``model``: the final global model (mean weights, pruned to the
    support; eval mode), as saved in ``model.safetensors``. ``out``: the run directory. ``config``: the
    resolved config, as written to ``config.toml``."""

    metrics: list[dict[str, Any]]
    model: nn.Module
    out: Path
    config: Config

    @property
    def accuracy(self) -> float:
        """Test accuracy of the final global model (the last round's row)."""
        return float(self.metrics[-1]["accuracy"])

    @property
    def density(self) -> float:
        """Fraction of nonzero values of the whole final model, as a user counts them: the Bayesian layers' weights
        (their means, pruned to the support) and biases, and every floating-point tensor outside those layers
        (BatchNorm's, an embedding, ...), which travels dense."""
        from .algorithms.plain import PlainState

        tensors = [t for _, layer in bayesian_layers(self.model)
                   for t in (layer.masked_weight(), layer.bias) if t is not None]
        state = self.model.state_dict()
        tensors += [state[t.key] for t in PlainState(self.model).tensors]
        total = sum(t.numel() for t in tensors)
        return sum(int(t.count_nonzero()) for t in tensors) / total if total else 1.0

    @property
    def support_density(self) -> float:
        """Fraction of the Bayesian layers' weights on the final support (the last round's ``density`` in
        metrics.csv): what the method prunes, without the biases and the state that travels dense."""
        return float(self.metrics[-1]["density"])

    def export(self, out_dir: str | os.PathLike[str], *, example_input: torch.Tensor | None = None,
               compaction: bool = True) -> Any:
        """Export the final model (a model of one's own or a built-in one) into ``out_dir`` with
        :func:`dturbo.export.export_model`, with the run's input normalisation (so that ``dturbo.export.load(out_dir,
        inputs="raw")`` takes the data as stored); returns the :class:`dturbo.export.graph.ExportedGraph`.

        ``example_input``: a batch of normalised inputs to capture and check the graph on; default 2 seeded random
        samples of the model's ``input_shape`` (integer ids below its size for a model whose first layer is an
        embedding). Raises :class:`dturbo.export.ExportError` (e.g. a model torch.fx
        cannot trace, or an op outside export's vocabulary, named)."""
        from .export import ExportError, check_input_norm, export_model

        if example_input is None:
            shape = getattr(self.model, "input_shape", None)
            if not shape:
                raise ExportError("the model records no input_shape: pass example_input (a batch of inputs)")
            seeded = torch.Generator().manual_seed(0)
            first = first_layer(self.model)
            if first is not None and isinstance(first[1], ID_LAYERS):
                example_input = torch.randint(0, first[1].num_embeddings, (2, *shape), generator=seeded)
            else:
                example_input = torch.randn(2, *shape, generator=seeded)
        norm = None
        _, meta = RunDir(self.out).read_model()
        if "input_norm" in meta:
            norm = check_input_norm(json.loads(meta["input_norm"]), tuple(example_input.shape[1:]),
                                    f"{self.out}/model.safetensors")
        source = {"run_dir": str(self.out.resolve()), "model": self.config.model.name,
                  "dataset": self.config.data.name, "algorithm": self.config.experiment.algorithm}
        exported = export_model(self.model, out_dir, example_input=example_input, compaction=compaction,
                                input_norm=norm, source=source)
        from .export import removed_nothing

        if compaction and (note := removed_nothing(exported.spec())) is not None:
            warnings.warn(note, stacklevel=2)
        return exported


class Experiment:
    """A federated experiment into the run directory ``out``, as ``dturbo run CONFIG --out OUT`` makes it.

    Args:
        config: a :class:`Config`, a dict shaped like the TOML, or a TOML path (read by
            :func:`dturbo.load_config`).
        data: arrays in memory instead of the config's ``[data]`` files: ``(x_train, y_train, x_test, y_test)``
            (numpy arrays or torch tensors; images ``N,H,W``, ``N,C,H,W`` or ``N,H,W,C``, or flat ``N,D``; labels
            ``(N,)`` integers in ``0..K-1``), or a mapping with those keys (e.g. ``np.load("d.npz")``). They are
            checked and normalised as an ``.npz`` file is; the run records ``data.name = "arrays"`` (replacing
            the config's data name and path; ``limit_train``, ``limit_test`` and ``validation`` still apply).
            To resume such a run, pass the same arrays again.
        model: a network of one's own instead of the config's ``[model]``: a ``torch.nn.Module`` (copied at once;
            every client and the server start from that copy's weights) or a zero-argument function that returns
            one (called with torch's RNG seeded by ``experiment.seed``, so the same weights every time). Without
            Bayesian layers it goes through :func:`dturbo.nn.bayesianize` (every ``nn.Linear`` / ``nn.Conv2d``
            becomes Bayesian, with ``[dturbo] sigma_mode`` and ``sigma_init_ratio``); its other state (BatchNorm,
            ...) is trained and travels dense. Its output must be one logit per class. The run records
            ``model.name = "custom"``; to resume it, pass the same model again.
        out: the run directory (new or empty; with ``resume``, a run directory to continue).
        num_classes: the number of classes (labels must lie below it); default the largest label + 1. With a
            mapping ``data``, its ``num_classes`` entry is used when this is None.
        resume: continue from the run directory's checkpoint (the same metrics as an uninterrupted run);
            ``"unverified"`` also from one without a checksum of the whole file (an older dturbo's).
        progress: True prints a line per round to stderr (as ``dturbo run`` does in a log); a callable is
            called with each round's metrics row instead; False is silent.
        figures: draw the run's figures into ``out/figures`` at the end, as ``dturbo run`` does.

    Raises (at construction, before any round runs; :meth:`run` raises the same as ``dturbo run``):
        ConfigError: a bad config key or value, or ``experiment.device = "cuda"`` without a GPU.
        DataError: unusable data arrays; the message names the array and the problem.
        BayesianizeError: a ``model`` with no Linear or Conv2d layer, or with layers dturbo cannot grid
            (``UnsupportedLayerError``, naming each; :mod:`dturbo.nn.convert`).
        ModelInputError, ModelOutputError (for data read from files: at :meth:`run`): the data's samples do not
            pass through the model, or its output is not one logit per class (both numbers named).
        ConfigError: a method's setting that does not fit the model (``dturbo.sparsity.layer_targets`` naming a
            layer the model lacks, or more than the global target allows), for arrays and the built-in datasets.
    """

    def __init__(self, config: ConfigSource, *, data: DataSource | None = None, out: str | os.PathLike[str],
                 num_classes: int | None = None, resume: bool | Literal["unverified"] = False,
                 progress: Progress = True,
                 figures: bool = True, model: ModelSource | None = None) -> None:
        cfg = load_config(config)
        if model is not None:
            cfg = load_config(cfg, {"model.name": "custom"})
        elif cfg.model.name == "custom":
            raise ConfigError("config key 'model.name': 'custom' needs the model: Experiment(..., model=...)")
        if model is not None and cfg.data.layout == "auto" and _takes_series(model):
            # a Conv1d first: N, C, L series, whatever auto would make of a 3-d array (N, H, W images)
            cfg = load_config(cfg, {"data.layout": "channels_first"})
        self.dataset: Dataset | None = None
        if data is not None:
            cfg = load_config(cfg, {"data.name": "arrays", "data.path": None})
            arrays, stored_nc = _unpack(data)
            self.dataset = dataset_from_arrays(
                *arrays, num_classes=num_classes if num_classes is not None else stored_nc,
                limit_train=cfg.data.limit_train, limit_test=cfg.data.limit_test, seed=cfg.experiment.seed,
                standardize=cfg.data.standardize, layout=cfg.data.layout)
        elif num_classes is not None:
            raise ValueError("num_classes goes with data=...; for data read from files it comes from the files")
        resolve_device(cfg.experiment.device)  # "cuda" without a GPU: say so now
        self.config = cfg
        self.model = copy.deepcopy(model) if isinstance(model, nn.Module) else model  # later changes do not leak in
        if model is not None:  # an unusable model: say so now (with data read from files, its fit is checked at run)
            made = self._model_factory(self.dataset)()
            if self.dataset is not None:
                with torch.random.fork_rng(devices=[]):
                    check_input_shape(made, self.dataset.input_shape, type(made).__name__, self.dataset.num_classes,
                                      self.dataset.input_dtype)
        self._check_algorithm()
        self.out = Path(out)
        self.resume = resume
        self.progress = progress
        self.figures = figures

    def run(self) -> ExperimentResult:
        """Run (or, with ``resume``, continue) every round of ``experiment.rounds``; returns the metrics and the
        final global model. Raises what ``dturbo run`` reports: ConfigError, DataError, CheckpointError,
        FileExistsError (``out`` holds another run), TooFewClientsError, PoisonedStateError."""
        sim = start_run(self.config, self.out, (lambda line: print(line, file=sys.stderr)) if self.progress is True
                        else None, resume=self.resume, dataset=self.dataset, on_round=self._on_round(),
                        model=self._model_factory if self.model is not None else None)
        sim.run()
        if self.figures:
            from .report import draw_run

            draw_run(self.out)
        assert sim.final_model is not None  # set by run()
        return ExperimentResult(read_metrics_rows(self.out), sim.final_model, self.out, self.config)

    def _check_algorithm(self) -> None:
        """Build the algorithm's server on the run's model, as a run does before its first round, so that its
        settings (``dturbo.sparsity.layer_targets`` naming a missing layer or over budget, a method's own limits)
        are refused now. Needs the samples' shape: from the arrays, or the built-in datasets' known one; a model
        on data read from other files is checked at :meth:`run`."""
        from .algorithms.registry import ALGORITHMS, model_factory
        from .data.readers import MNIST_SHAPE

        cfg = self.config
        known = {"fashion-mnist": (MNIST_SHAPE, 10), "mnist": (MNIST_SHAPE, 10), "cifar10": ((3, 32, 32), 10),
                 "cifar100": ((3, 32, 32), 100)}
        if self.dataset is not None:
            shape, classes = self.dataset.input_shape, self.dataset.num_classes
        elif cfg.data.name in known:
            shape, classes = known[cfg.data.name]
        else:
            return
        if self.model is not None:
            factory = self._model_factory(self.dataset)
        else:
            factory = model_factory(cfg, shape, classes)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", DenseStateWarning)  # said once, when the run starts
            ALGORITHMS[cfg.experiment.algorithm].server(cfg, factory, 1)

    def _model_factory(self, dataset: Dataset | None) -> ModelFactory:
        """The factory of ``model`` for the run on ``dataset`` (its sample shape recorded on the model)."""
        assert self.model is not None
        return user_model_factory(self.model, **model_options(self.config), seed=self.config.experiment.seed,
                                  input_shape=dataset.input_shape if dataset is not None else ())

    def _on_round(self) -> Callable[[dict[str, Any]], None] | None:
        if callable(self.progress):
            return self.progress
        if not self.progress:
            return None
        line = ProgressLine(self.config.experiment.rounds)

        def show(row: dict[str, Any]) -> None:
            print(line(row), file=sys.stderr)

        return show


def _takes_series(model: ModelSource) -> bool:
    """Whether ``model`` (a module, or a class built without arguments) meets its inputs with a Conv1d."""
    if not isinstance(model, nn.Module):
        try:
            with torch.random.fork_rng(devices=[]):
                model = model()  # type: ignore[operator]
        except Exception:  # noqa: BLE001 -- a model that needs arguments: no inference, the error says what to set
            return False
    first = first_layer(model) if isinstance(model, nn.Module) else None
    return first is not None and isinstance(first[1], SERIES_LAYERS)


def _unpack(data: DataSource) -> tuple[tuple[Any, Any, Any, Any], Any]:
    """The four arrays of ``data`` and its stored class count (None if absent)."""
    if isinstance(data, Mapping):
        missing = [k for k in NPZ_KEYS if k not in data]
        if missing:
            raise DataError(f"data: missing {', '.join(missing)} (a mapping needs the keys {', '.join(NPZ_KEYS)})")
        return (data["x_train"], data["y_train"], data["x_test"], data["y_test"]), data.get("num_classes")
    if isinstance(data, str | bytes | os.PathLike) or not isinstance(data, Sequence) or len(data) != 4:
        what = f"a sequence of {len(data)}" if isinstance(data, Sequence) and not isinstance(data, str) else (
            type(data).__name__)
        raise DataError(f"data must be (x_train, y_train, x_test, y_test) or a mapping with those keys, got {what}; "
                        f"for data in a file, set data.name and data.path in the config instead")
    return (data[0], data[1], data[2], data[3]), None


def _number(text: str) -> int | float | str | None:
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_metrics_rows(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a run directory's ``metrics.csv``, numbers as int or float and empty cells as None."""
    with open(RunDir(run_dir).metrics_path, newline="") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
