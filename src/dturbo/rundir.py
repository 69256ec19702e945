"""A run directory: every file a run writes, and how to build the run's model again (docs/rundir.md).

``config.toml`` (the resolved configuration), ``metrics.csv`` (one row per round), ``checkpoint/`` (the atomic
checkpoint, :mod:`dturbo.checkpoint`), ``messages/round_NNNN.safetensors`` (Module B's messages, for the heat
maps), ``model.safetensors`` (the final global model), ``events.log`` (why clients failed or were rejected),
``environment.jsonl`` (the machine and versions of each session that trained it) and ``figures/``. The runner
writes them (:class:`dturbo.sim.Simulator`); the report and the export read them, and rebuild the run's model with
:meth:`RunDir.build_model`, the one way a saved run's model is built again.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import (
    RESUMABLE_CHANGES,
    STATE_FILE,
    CheckpointError,
    atomic_write_bytes,
    data_changes,
    load_checkpoint,
    read_safetensors,
    run_counters,
    save_checkpoint,
    with_earlier_values,
)
from .config import Config, ConfigError, read_toml
from .settings import load_config

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn


class RunDirError(ValueError):
    """A run directory cannot be read or written: a file is missing or unreadable, its model cannot be built again,
    or a write failed (a full disk)."""


class RunDirLocked(RuntimeError):
    """Another run is writing into the run directory (it holds its lock)."""


LOCK_FILE = ".lock"  # held (flock) by the process running into the folder; it names that process's id


class RunDir:
    """The files of one run in ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._model_file: tuple[dict[str, torch.Tensor], dict[str, str]] | None = None
        self._architecture: tuple[tuple[int, ...], int] | None = None
        self._lock: int | None = None  # the lock file's descriptor while this process holds it

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------ the files
    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def messages_dir(self) -> Path:
        return self.path / "messages"

    @property
    def model_path(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def events_path(self) -> Path:
        return self.path / "events.log"

    @property
    def environment_path(self) -> Path:
        return self.path / "environment.jsonl"

    @property
    def figures_dir(self) -> Path:
        return self.path / "figures"

    def message_path(self, round_no: int) -> Path:
        return self.messages_dir / f"round_{round_no:04d}.safetensors"

    def message_files(self) -> list[Path]:
        """The rounds' message files, in round order."""
        return sorted(self.messages_dir.glob("round_*.safetensors"))

    def started(self) -> bool:
        """Whether the folder holds anything a run writes (a run was started there)."""
        files = (self.config_path, self.metrics_path, self.checkpoint_dir, self.events_path, self.messages_dir,
                 self.model_path)
        return any(p.exists() for p in files)

    # ------------------------------------------------------------------ the lock
    @property
    def lock_path(self) -> Path:
        return self.path / LOCK_FILE

    def lock(self) -> None:
        """Hold the folder's lock (created with the folder) until :meth:`unlock` or the process ends: one run at a
        time writes into a run directory. RunDirLocked when another process holds it; RunDirError when the folder
        cannot be written."""
        if self._lock is not None:
            return
        self._refuse_a_file()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise RunDirError(f"cannot write into --out {self.path}: {err.strerror or err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirLocked(f"another run (process {holder}) is writing into {self.path}: wait for it to end, or "
                               f"run into another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd

    def unlock(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            os.close(self._lock)
            self._lock = None

    # ------------------------------------------------------------------ starting or resuming a run
    def _refuse_a_file(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"--out {self.path} names a file; --out must be a directory (a new or empty one "
                                  f"for a new run, a run directory with --resume)")

    def create(self, cfg: Config) -> None:
        """Start a new run here: the folder must be new or hold no run (nor a symbolic link where a run file goes);
        writes ``config.toml``."""
        self._refuse_a_file()
        links = [p.name for p in (self.config_path, self.metrics_path, self.checkpoint_dir, self.events_path,
                                  self.messages_dir, self.model_path, self.environment_path) if p.is_symlink()]
        if links:
            raise FileExistsError(f"{self.path} holds a symbolic link where a run file goes ({', '.join(links)}): "
                                  f"a run never writes through one; remove it or choose another --out")
        if (self.checkpoint_dir / STATE_FILE).exists():
            raise FileExistsError(f"{self.path} already holds a run; use --resume to continue it, or another --out")
        if self.checkpoint_dir.exists() or self.metrics_path.exists():
            # Started but no round saved: nothing to resume, yet not ours to overwrite.
            raise FileExistsError(
                f"{self.path} holds a run that stopped before its first round was saved (no checkpoint, so "
                f"nothing to --resume); delete {self.path} and run again, or choose another --out"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.config_path, cfg.to_toml().encode())

    def record_environment(self, first_round: int, machine: dict[str, Any]) -> None:
        """Add a line to ``environment.jsonl`` for the session that trains from round ``first_round + 1``: the
        ``machine`` it runs on (:func:`dturbo.device.machine`). Lines of sessions that began at or after that round
        go (their rounds are trained again); a line that is not such a record is kept as it is."""
        kept = []
        if self.environment_path.is_file():
            for line in self.environment_path.read_text(errors="replace").splitlines():
                try:
                    began = json.loads(line)["first_round"]
                except (ValueError, TypeError, KeyError):
                    began = None
                if not isinstance(began, int) or began < first_round:
                    kept.append(line)
        kept.append(json.dumps({"first_round": first_round, **machine}))
        try:
            atomic_write_bytes(self.environment_path, ("\n".join(kept) + "\n").encode())
        except OSError as err:
            raise RunDirError(f"cannot write {self.environment_path}: {err.strerror or err}; nothing else was "
                              f"changed") from None

    def checkpoint_to_resume(self, fingerprint: str, config: Config | None = None,
                             data: dict[str, str] | None = None, *, unverified: bool = False
                             ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(state, counters) of the checkpoint a resumed run continues from, checked against the configuration's
        ``fingerprint`` and the ``data`` (:func:`dturbo.checkpoint.data_fingerprint`); CheckpointError naming the
        problem (nothing is modified): the keys in which ``config`` differs from the run's config.toml, the arrays
        that differ. ``unverified``: a checkpoint without a checksum of the whole file loads (an older dturbo's)."""
        self._refuse_a_file()
        if not (self.checkpoint_dir / STATE_FILE).exists() and self.started():
            raise CheckpointError(
                f"{self.path} has no checkpoint to resume (the run stopped before its first round was saved): run "
                f"again without --resume into a fresh --out, or delete {self.path} and run again"
            )
        state, counters = load_checkpoint(self.checkpoint_dir, unverified=unverified)
        counters = run_counters(self.checkpoint_dir / STATE_FILE, counters)
        if counters.get("fingerprint") != fingerprint:
            raise CheckpointError(
                f"checkpoint in {self.checkpoint_dir} belongs to another configuration "
                f"(fingerprint {counters.get('fingerprint')} != {fingerprint}{self._config_changes(config)}); "
                f"it was left untouched"
            )
        # Checkpoints written before the data were fingerprinted hold none: they resume unchecked.
        if data is not None and isinstance(counters.get("data"), dict) and (
                changed := data_changes(counters["data"], data)):
            raise CheckpointError(f"--resume: the data differ from the data the run in {self.path} trained on "
                                  f"({'; '.join(changed)}); resume with the same data, or start a new run into a "
                                  f"fresh --out; the checkpoint was left untouched")
        return state, counters

    def _config_changes(self, config: Config | None) -> str:
        """``"; differs in: key (run's -> now's), ..."`` between the run's config.toml and ``config``."""
        if config is None:
            return ""
        try:
            saved = _flat(self._saved_config().to_dict())
        except (ConfigError, OSError):
            return ""
        now = _flat(config.to_dict())
        resumable = {f"experiment.{k}" for k in RESUMABLE_CHANGES}
        keys = [k for k in dict.fromkeys([*saved, *now]) if saved.get(k) != now.get(k) and k not in resumable]
        if not keys:
            return ""
        shown = ", ".join(f"{k} ({saved.get(k, 'absent')!r} -> {now.get(k, 'absent')!r})" for k in keys[:6])
        return f"; it differs in {shown}{', ...' if len(keys) > 6 else ''}"

    def rewind(self, rounds_done: int) -> list[dict[str, Any]]:
        """Go back to the checkpoint of round ``rounds_done``: metrics.csv keeps its rows up to that round (returned)
        and events.log its events; the rounds after it will be run again. CheckpointError naming the file and line
        when either is not what a run writes (nothing is modified then)."""
        try:
            rows = [r for r in self.read_rows() if _row_round(r) <= rounds_done]
            for r in rows:
                float(r["accuracy"]), float(r["loss"])
        except (KeyError, ValueError, TypeError, csv.Error, UnicodeDecodeError) as err:
            raise CheckpointError(f"{self.metrics_path} is not the metrics a run writes ({type(err).__name__}: "
                                  f"{err}); restore it, or start the run again into a fresh --out") from None
        if len(rows) != rounds_done:
            raise CheckpointError(f"metrics.csv has {len(rows)} rows for {rounds_done} checkpointed rounds")
        kept = self._events_up_to(rounds_done)
        self.write_rows(rows)
        if kept is not None:
            atomic_write_bytes(self.events_path, "".join(kept).encode())
        return rows

    def _events_up_to(self, rounds_done: int) -> list[str] | None:
        """events.log's lines of rounds up to ``rounds_done`` (None: no file); CheckpointError for a line that is not
        ``round N: ...``."""
        if not self.events_path.exists():
            return None
        try:
            lines = self.events_path.read_text().splitlines(keepends=True)
        except UnicodeDecodeError as err:
            raise CheckpointError(f"{self.events_path} is not text ({err}); remove it, then --resume") from None
        kept = []
        for i, line in enumerate(lines, 1):
            words = line.split(maxsplit=2)
            if len(words) < 2 or words[0] != "round" or not words[1].rstrip(":").isdigit():
                raise CheckpointError(f"{self.events_path} line {i} is not an event ('round N: ...'): {line[:80]!r}; "
                                      f"fix or remove it, then --resume")
            if int(words[1].rstrip(":")) <= rounds_done:
                kept.append(line)
        return kept

    # ------------------------------------------------------------------ what each round writes
    def read_rows(self) -> list[dict[str, Any]]:
        """metrics.csv's rows as text (none when there is no file)."""
        if not self.metrics_path.exists():
            return []
        with open(self.metrics_path, newline="") as f:
            return list(csv.DictReader(f))

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        """metrics.csv, written whole and atomically: every column any row has, in the order they first appear
        (a run resumed by a dturbo that records more columns leaves the earlier rows' new cells empty)."""
        buf = io.StringIO()
        if rows:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            writer = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        atomic_write_bytes(self.metrics_path, buf.getvalue().encode())

    def append_events(self, round_no: int, events: list[str]) -> None:
        """One line per event of round ``round_no`` in events.log (metrics.csv has the counts)."""
        if events:
            try:  # never through a symbolic link
                fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as err:
                raise RunDirError(f"cannot write {self.events_path}: {err.strerror or err}") from None
            with os.fdopen(fd, "a") as f:
                f.writelines(f"round {round_no}: {e}\n" for e in events)

    def save_messages(self, round_no: int, arrays: dict[str, np.ndarray]) -> None:
        """Module B's messages of round ``round_no`` (pi and the support mask of every layer)."""
        from safetensors.numpy import save as save_numpy

        self.messages_dir.mkdir(exist_ok=True)
        atomic_write_bytes(self.message_path(round_no), save_numpy(arrays))

    def save_checkpoint(self, state: dict[str, Any], counters: dict[str, Any]) -> None:
        save_checkpoint(self.checkpoint_dir, state, counters)

    def save_model(self, model: nn.Module, cfg: Config, input_norm: dict[str, Any] | None) -> None:
        """model.safetensors: the global model's tensors, with what it is (model, dataset, algorithm) and the
        data's input normalisation (so that an export can take raw inputs) in its metadata."""
        from safetensors.torch import save as save_torch

        # clone: tied parameters (sigma_mode = "client") must be separate tensors in a safetensors file
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        meta = {"model": cfg.model.name, "dataset": cfg.data.name, "algorithm": cfg.experiment.algorithm}
        if input_norm is not None:
            meta["input_norm"] = json.dumps(input_norm)
        atomic_write_bytes(self.model_path, save_torch(tensors, metadata=meta))

    # ------------------------------------------------------------------ reading a finished run
    def config(self) -> Config:
        """The run's configuration (config.toml)."""
        if not self.path.is_dir():
            raise RunDirError(f"run directory {self.path} does not exist")
        if not self.config_path.is_file():
            raise RunDirError(f"{self.path} holds no run: config.toml is missing")
        try:
            return self._saved_config()
        except ConfigError as err:
            raise RunDirError(f"{self.config_path}: {err}") from None

    def _saved_config(self) -> Config:
        """config.toml, a key it predates read as the value the run ran with (a default that changed since)."""
        return load_config(with_earlier_values(read_toml(self.config_path)))

    def read_model(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, metadata) of model.safetensors (read once)."""
        if self._model_file is None:
            self._model_file = read_safetensors(self.model_path, what="the run's model file", error=RunDirError)
        return self._model_file

    def architecture(self, cfg: Config | None = None) -> tuple[tuple[int, ...], int]:
        """(one sample's shape, number of classes) the run's built-in model was built for.

        The shape: a named dataset's, which its format fixes (:func:`dturbo.data.sample_shape`); else, for a model
        with flat inputs (``mlp``), its first layer's input size in the saved weights; else the data's, read again.
        The classes: the rows of the model's classifier (its last layer) in the saved weights."""
        from .data import sample_shape
        from .nn.bayes import bayesian_layers

        if self._architecture is not None:
            return self._architecture
        cfg = cfg or self.config()
        tensors, _ = self.read_model()
        shape = sample_shape(cfg.data.name)
        if shape is None and cfg.model.name == "mlp":
            first, _ = bayesian_layers(_probe(cfg, (1,)))[0]
            if f"{first}.weight_mu" in tensors:
                shape = (int(tensors[f"{first}.weight_mu"].shape[1]),)
        if shape is None:
            shape = self._data_shape(cfg)
        self._architecture = shape, classifier_rows(_probe(cfg, shape), tensors)
        return self._architecture

    def _data_shape(self, cfg: Config) -> tuple[int, ...]:
        from .data import DataError, load_dataset

        try:
            ds = load_dataset(cfg.data.name, cfg.data.path, limit_train=1, limit_test=1, seed=cfg.experiment.seed)
        except (DataError, ValueError) as err:
            raise RunDirError(f"cannot tell the input shape of data {cfg.data.name!r} without reading it: "
                              f"{err}") from None
        return ds.input_shape

    def build_model(self, cfg: Config | None = None) -> nn.Module:
        """The run's built-in model as the run built it (seeded initial weights; the caller's torch RNG is left as
        it was): the architecture the saved tensors belong to."""
        import torch

        from .algorithms.registry import model_factory

        cfg = cfg or self.config()
        if cfg.model.name == "custom":
            raise RunDirError(f"{self.path} ran a model of one's own (dturbo.Experiment(model=...)), which cannot be "
                              f"built again from the run directory (it holds no code)")
        shape, classes = self.architecture(cfg)
        with torch.random.fork_rng(devices=[]):
            return model_factory(cfg, shape, classes)()

    def load_model(self, cfg: Config | None = None) -> nn.Module:
        """The run's final global model (model.safetensors) in eval mode."""
        model = self.build_model(cfg)
        tensors, _ = self.read_model()
        model.load_state_dict(tensors, strict=False)  # tied sigma (sigma_mode "client") is saved once per layer
        return model.eval()


def _row_round(row: dict[str, Any]) -> int:
    value = row["round"]
    if not isinstance(value, str) or not value.isdigit():
        raise ValueError(f"round {value!r} is not a round number")
    return int(value)


def _probe(cfg: Config, input_shape: tuple[int, ...]) -> nn.Module:
    """``[model]``'s built-in model for one class: its layers and their names, as the model's builder gives them."""
    import torch

    from .algorithms.registry import model_factory

    with torch.random.fork_rng(devices=[]):
        return model_factory(cfg, input_shape, 1)()


def classifier_rows(architecture: nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """The number of classes saved weights ``tensors`` were trained for: the rows of the classifier (the last
    Bayesian layer of ``architecture``, a model of the same layers)."""
    from .nn.bayes import bayesian_layers

    last, _ = bayesian_layers(architecture)[-1]
    if f"{last}.weight_mu" not in tensors:
        raise RunDirError(f"the model file has no tensor '{last}.weight_mu' (the model's classifier): not a dturbo "
                          f"model of this layout")
    return int(tensors[f"{last}.weight_mu"].shape[0])


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
