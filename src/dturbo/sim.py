"""The federated runner: one linear loop of rounds over a transport, into a run directory.

Shaped like Flower's ``Strategy.start``: each round (:func:`dturbo.rounds.fit_round`, the round every runner runs)
the server algorithm selects clients and makes the downlink, the transport (:mod:`dturbo.transport`) carries it to
the clients and brings their uplinks back, the server aggregates, the runner evaluates the global model and the run
directory (:class:`dturbo.rundir.RunDir`) records the round. Nothing about an algorithm lives here
(:mod:`dturbo.protocol`), nor how bytes travel: in process (:class:`~dturbo.transport.InProcessClients`, the
default) or over Flower (:mod:`dturbo.flower`), with injected faults (:mod:`dturbo.faults`) wrapped around either.
Bits are 8 x the bytes of the messages really exchanged (:mod:`dturbo.ledger`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .algorithms.registry import ALGORITHMS, ModelFactory, build_algorithm
from .algorithms.statistics import Statistics, calibrate
from .checkpoint import CheckpointError, check_state, config_fingerprint, data_fingerprint
from .config import Config
from .data import Dataset
from .device import CPU, machine, resolve_device
from .faults import CORRUPTIONS, corrupt, draw_faults, with_faults
from .federation import Federation, build_federation
from .ledger import LEDGER_COLUMNS, Traffic
from .protocol import ScheduleWarning
from .rounds import PoisonedStateError, Round, TooFewClientsError, check_finite, fit_round
from .rundir import RunDir, RunDirError
from .transport import ClientLost, Downlinks, InProcessClients, Reply, Transport

# The runner's names, importable from here (tests, users' scripts).
__all__ = [
    "ALGORITHMS", "BASE_COLUMNS", "CLIENT_STATE_PREFIX", "CORRUPTIONS", "LEDGER_COLUMNS", "ClientLost", "Federation",
    "ModelFactory", "PoisonedStateError", "ScheduleWarning", "Simulator", "TooFewClientsError", "build_algorithm",
    "build_federation", "check_finite", "corrupt", "draw_faults", "evaluate", "format_bits", "round_summary",
]

BASE_COLUMNS = ["round", "accuracy", "loss", "density", "up_bits", "down_bits", "cum_bits", "seconds"]
# Private state a client algorithm keeps between rounds (STC's residuals and model copy): its ``export_state()``
# arrays go into the same atomic checkpoint file as the server state, under this prefix, and back through
# ``import_state(arrays)`` on --resume, so that a resumed run is identical to an uninterrupted one.
CLIENT_STATE_PREFIX = "clients/"


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2000,
             device: torch.device = CPU) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of a model in eval mode (mean weights), computed on ``device`` (the model is
    moved there; on the CPU nothing moves)."""
    model.eval().to(device)
    correct = 0
    loss = 0.0
    for i in range(0, len(y), batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        logits = model(xb)
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    return correct / len(y), loss / len(y)


def format_bits(b: float) -> str:
    """A bit count in Gbit / Mbit / kbit / bit, two decimals."""
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} bit"


def round_summary(row: dict[str, Any]) -> str:
    """A metrics row in one line, as progress shows it: accuracy, density and the bits so far."""
    return (f"acc {float(row['accuracy']):.4f}  density {float(row['density']):.3f}  "
            f"bits {format_bits(float(row['cum_bits']))}")


def duration(seconds: float) -> str:
    """A duration in words: "40 s", "12 min", "2.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def run_header(cfg: Config, out: Path, round_seconds: float | None = None) -> str:
    """A run's first line: what runs, where it writes, and (``round_seconds``: an estimate of a round,
    :meth:`Simulator.estimate_round_seconds`) about how long its rounds will take."""
    head = (f"dturbo {cfg.experiment.name}: {cfg.experiment.algorithm} on {cfg.data.name}, {cfg.model.name}, "
            f"{cfg.federation.clients} clients, {cfg.experiment.rounds} rounds -> {out}")
    if round_seconds is None:
        return head
    return f"{head}  (about {duration(round_seconds * cfg.experiment.rounds)} from a timed training step)"


def start_run(cfg: Config, out: str | Path, say: Callable[[str], None] | None = None, **kwargs: Any) -> Simulator:
    """A :class:`Simulator` (``kwargs``: its own) for ``dturbo run`` and :meth:`dturbo.Experiment.run`: ``say`` gets
    the run's first line (:func:`run_header`, with its estimate unless it resumes) before the warnings that building
    it gave (a schedule that ends after the run, labels with gaps, an unverifiable checkpoint), which are warned
    again after it, so that they follow the line that says what runs."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        sim = Simulator(cfg, out, **kwargs)
    if say is not None:
        say(run_header(cfg, Path(out), None if kwargs.get("resume") else sim.estimate_round_seconds()))
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return sim


class ProgressLine:
    """A run's progress in a log, one line a round: the round, :func:`round_summary`, its seconds and the time left
    at the mean pace of the rounds seen so far."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.seconds: list[float] = []

    def __call__(self, row: dict[str, Any]) -> str:
        self.seconds.append(float(row["seconds"]))
        left = (self.rounds - int(row["round"])) * sum(self.seconds) / len(self.seconds)
        return (f"round {row['round']}/{self.rounds}  {round_summary(row)}  ({row['seconds']} s, about "
                f"{duration(left)} left)")


class Simulator:
    """Runs an experiment into a run directory (docs/rundir.md)."""

    def __init__(self, cfg: Config, out: Path, *, resume: bool | Literal["unverified"] = False,
                 federation: Federation | None = None, dataset: Dataset | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 model: Callable[[Dataset], ModelFactory] | None = None, transport: Transport | None = None) -> None:
        """``federation``: clients already split (tests); else ``dataset`` (data already loaded, e.g. a library
        user's arrays: :func:`dturbo.data.dataset_from_arrays`) is split among the clients; else the config's
        data is read. ``model``: given the dataset, the factory of a model of one's own (``dturbo.Experiment``'s
        ``model=``) that replaces the built-in model of ``[model]``. ``transport``: how the round's messages reach
        the clients (default: the clients in this process); ``[faults]`` are injected around it. ``resume``:
        continue the checkpoint in ``out``; ``"unverified"``: also one without a checksum of the whole file (an
        older dturbo's)."""
        self.cfg = cfg
        self.out = Path(out)
        self.run_dir = RunDir(self.out)
        self.resume = bool(resume)
        self.unverified = resume == "unverified"
        self.on_round = on_round
        if cfg.experiment.threads:  # before anything is built: reductions depend on the thread count
            torch.set_num_threads(cfg.experiment.threads)
        self.device = resolve_device(cfg.experiment.device)  # "cuda" without a GPU fails here, before any work
        self.fed = federation or build_federation(cfg, dataset)
        for warning in ALGORITHMS[cfg.experiment.algorithm].run_warnings(cfg, self.fed):
            warnings.warn(warning, stacklevel=2)
        factory = model(self.fed.dataset) if model is not None else None
        self.server, self.client = build_algorithm(cfg, self.fed, factory)
        # calibration goes through the faults too, which leave it as it is but for a hostile client's reply
        # (FaultyTransport._calibration)
        self.transport = with_faults(transport or InProcessClients(self.client, self.fed.clients), cfg, self.server)
        self._statistics: Statistics | None = None
        self.fingerprint = config_fingerprint(cfg.to_dict())
        self.data_fingerprint = data_fingerprint(self.fed.dataset)
        self.final_model: nn.Module | None = None  # the global model saved at the end of run(), in eval mode

    def estimate_round_seconds(self, steps: int = 5) -> float:
        """A rough time of one round, before the first: ``steps`` forward and backward passes of a copy of the
        client's model on one minibatch, timed after a first untimed one, times the local steps of a round (every
        client's, scaled to ``clients_per_round``), the evaluation's forward passes on top. Server work is not
        counted. The global RNG is left as it was, so the run itself is unchanged."""
        import copy

        from .algorithms.local import num_local_steps

        cfg = self.cfg
        data = self.fed.clients[0]
        bs = min(cfg.train.batch_size, len(data))
        model = copy.deepcopy(self.client.model).to(self.device).train()
        x, y = data.x[:bs].to(self.device), data.y[:bs].to(self.device)
        with torch.random.fork_rng(devices=[]):
            times = []
            for _ in range(steps + 1):
                t0 = time.perf_counter()
                F.cross_entropy(model(x), y).backward()
                times.append(time.perf_counter() - t0)
        step = float(np.median(times[1:]))
        local = sum(num_local_steps(cfg.train, len(c)) for c in self.fed.clients)
        local *= (cfg.federation.clients_per_round or cfg.federation.clients) / cfg.federation.clients
        evals = len(self.fed.y_test) + (len(self.fed.y_val) if self.fed.y_val is not None else 0)
        return step * (local + evals / bs / 3 / cfg.experiment.eval_every)  # a forward pass: about a third

    # ---------------------------------------------------------------- the loop
    def run(self) -> list[dict[str, Any]]:
        """Every round from the first (or, resuming, the checkpointed one) to ``experiment.rounds``; the rows of
        metrics.csv. Each round is checkpointed before the next starts. The run directory's lock is held throughout
        (:meth:`dturbo.rundir.RunDir.lock`: another run into it is refused)."""
        self.run_dir.lock()
        try:
            return self._run()
        finally:
            self.run_dir.unlock()

    def _run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        state, start, cum_bits, rows = self._open()
        self.run_dir.record_environment(start, machine(self.device))
        acc = loss = float("nan")
        val = (float("nan"), float("nan"))
        if rows:
            acc, loss = float(rows[-1]["accuracy"]), float(rows[-1]["loss"])
            if "val_accuracy" in rows[-1]:
                val = (float(rows[-1]["val_accuracy"]), float(rows[-1]["val_loss"]))
        for rnd in range(start, cfg.experiment.rounds):
            t0 = time.perf_counter()
            outcome = self.fit_round(state, rnd)
            result, traffic = outcome.result, outcome.traffic
            state = result.state
            last = rnd == cfg.experiment.rounds - 1
            if (rnd + 1) % cfg.experiment.eval_every == 0 or last:
                state = self.calibrate(state, rnd + 1, traffic, outcome.events)
                model = self.server.global_model(state)
                acc, loss = evaluate(model, self.fed.x_test, self.fed.y_test, device=self.device)
                if self.fed.x_val is not None:
                    val = evaluate(model, self.fed.x_val, self.fed.y_val, device=self.device)
            cum_bits += traffic.up_bits + traffic.down_bits  # the calibration's too
            row: dict[str, Any] = {
                "round": rnd + 1, "accuracy": acc, "loss": loss,
                **({"val_accuracy": val[0], "val_loss": val[1]} if self.fed.x_val is not None else {}),
                "density": result.metrics.pop("density"),
                "up_bits": traffic.up_bits, "down_bits": traffic.down_bits, "cum_bits": cum_bits,
                "seconds": round(time.perf_counter() - t0, 3),
                **({"calibration_bits": traffic.calibration_bits} if traffic.calibration_bits else {}),
                **traffic.parts,
                "participants": outcome.attempt.participants,
                **outcome.attempt.counts,
                "retries": outcome.retries,
                **{k: _fmt(v) for k, v in result.metrics.items()},
            }
            rows.append(row)
            self._record(rnd + 1, state, rows, cum_bits, outcome.events)
            if self.on_round:
                self.on_round(row)
        self.final_model = self.server.global_model(state).eval()
        try:
            self.run_dir.save_model(self.final_model, cfg, self.fed.dataset.input_norm)
        except OSError as err:
            raise RunDirError(f"cannot write {err.filename or self.run_dir.model_path}: {err.strerror or err}; every "
                              f"round is checkpointed: fix the cause and continue with --resume") from None
        return rows

    def fit_round(self, state: dict[str, Any], rnd: int) -> Round:
        """One round (:func:`dturbo.rounds.fit_round`): select, send the downlink, gather the uplinks, aggregate;
        run again (``federation.on_too_few = "retry"``) while fewer than ``min_clients`` updates are valid. Raises
        TooFewClientsError when the round cannot be completed; nothing saved is touched."""

        def send(downlinks: Downlinks) -> tuple[list[bytes], dict[int, Reply]]:
            return list(downlinks.values()), self.transport(downlinks, rnd)

        try:
            return fit_round(self.server, state, rnd, self.cfg.federation, send)
        except TooFewClientsError as err:
            self.run_dir.append_events(rnd + 1, err.events)
            then = (f"the checkpoint of round {rnd} is intact: fix the cause and continue with --resume" if rnd else
                    f"no round was saved, so there is nothing to --resume: fix the cause, delete {self.out} and run "
                    f"again, or run into another --out")
            raise TooFewClientsError(f"{err} (see {self.run_dir.events_path}); {then}", err.events,
                                     err.attempts) from None

    def calibrate(self, state: dict[str, Any], next_round: int, traffic: Traffic, events: list[str]
                  ) -> dict[str, Any]:
        """``state`` with BatchNorm's running statistics measured on its model by the clients of ``next_round``
        (:mod:`dturbo.algorithms.statistics`); itself when there is nothing to calibrate. Its messages are booked
        in ``traffic``; a refused or missing reply is an event, and with no valid reply the averaged statistics
        stay."""
        if self.cfg.federation.batchnorm != "calibrated":
            return state
        if self._statistics is None:
            self._statistics = Statistics(self.server.global_model(state))
            if self._statistics and not self.client.can_receive():
                warnings.warn(f"{self.cfg.experiment.algorithm} cannot calibrate BatchNorm statistics: they are the "
                              f"clients' averaged ones (federation.batchnorm = 'averaged')", UserWarning,
                              stacklevel=3)
        if not self._statistics or not self.client.can_receive():
            return state
        return calibrate(self._statistics, self.server, state, next_round,
                         lambda requests: self.transport(requests, next_round), traffic, events)

    # ---------------------------------------------------------------- the run directory
    def _open(self) -> tuple[dict[str, Any], int, float, list[dict[str, Any]]]:
        """Start the run directory, or go back to its checkpoint: (state, first round, cumulative bits, rows)."""
        if not self.resume:
            self.run_dir.create(self.cfg)
            return self.server.init(), 0, 0.0, []
        state, counters = self.run_dir.checkpoint_to_resume(self.fingerprint, self.cfg, self.data_fingerprint,
                                                            unverified=self.unverified)
        state = self._restore_client_state(state)
        check_state(state, self.server.init(), self.run_dir.checkpoint_dir)
        done = int(counters["rounds_done"])
        return state, done, float(counters["cum_bits"]), self.run_dir.rewind(done)

    def _record(self, round_no: int, state: dict[str, Any], rows: list[dict[str, Any]], cum_bits: float,
                events: list[str]) -> None:
        """A finished round into the run directory: its events, Module B's messages (for the heat maps, Fig. 3),
        metrics.csv, and last the checkpoint, which makes the round count as done."""
        try:
            self.run_dir.append_events(round_no, events)
            if (messages := self.server.support_messages(state)) is not None:
                self.run_dir.save_messages(round_no, messages)
            self.run_dir.write_rows(rows)
            self.run_dir.save_checkpoint({**state, **self._client_state()}, {
                "rounds_done": round_no, "cum_bits": cum_bits, "fingerprint": self.fingerprint,
                "data": self.data_fingerprint,
            })
        except OSError as err:  # a full disk: the files are written atomically, so the last checkpoint is whole
            kept = f"the checkpoint of round {round_no - 1} is intact" if round_no > 1 else "no round was saved"
            raise RunDirError(f"round {round_no}: cannot write {err.filename or self.run_dir.path}: "
                              f"{err.strerror or err}; {kept}: fix the cause (free space) and continue with "
                              f"--resume") from None

    def _client_state(self) -> dict[str, Any]:
        """The client algorithm's private state to checkpoint (CLIENT_STATE_PREFIX), if it keeps any."""
        if not self.client.keeps_state:
            return {}
        return {CLIENT_STATE_PREFIX + k: v for k, v in self.client.export_state().items()}

    def _restore_client_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Hand the checkpointed client state back to the client algorithm; returns the server state alone."""
        private = {k[len(CLIENT_STATE_PREFIX):]: v for k, v in state.items() if k.startswith(CLIENT_STATE_PREFIX)}
        if self.client.keeps_state:
            try:
                self.client.import_state(private)
            except ValueError as err:
                raise CheckpointError(f"checkpoint in {self.run_dir.checkpoint_dir}: {err}; left untouched") from None
        return {k: v for k, v in state.items() if not k.startswith(CLIENT_STATE_PREFIX)}


def _fmt(v: float) -> float | str:
    return "" if isinstance(v, float) and math.isnan(v) else v
