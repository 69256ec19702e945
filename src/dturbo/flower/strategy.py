"""D-Turbo-VBI (and STC, FedDST) as a Flower strategy for a user's own ServerApp (docs/flower-strategy.md).

A Flower user swaps ``FedAvg`` for :class:`DTurboVBI` and keeps their app::

    strategy = DTurboVBI(model, preset="recommended", fraction_evaluate=0.5)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=10)

The strategy is Flower's Message-API :class:`~flwr.serverapp.strategy.Strategy`: :meth:`DturboStrategy.start` runs
Flower's own loop (``Strategy.start``) and returns its ``Result``; :meth:`~DturboStrategy.configure_train` selects
the clients and codes each one's downlink, :meth:`~DturboStrategy.aggregate_train` decodes the uploads and runs
the algorithm's server step, :meth:`~DturboStrategy.configure_evaluate` / :meth:`~DturboStrategy.aggregate_evaluate`
run federated evaluation. The server side is the runner's (``dturbo run``): the server half of
:data:`dturbo.algorithms.registry.ALGORITHMS` on the user's model; the ClientApp runs the client half through
:func:`dturbo.flower.fit` (:mod:`dturbo.flower.client`). What crosses is :mod:`dturbo.flower.protocol`'s layout.

Arrays: the ArrayRecord that ``Strategy.start`` hands from round to round, passes to ``evaluate_fn`` and returns
as ``Result.arrays`` is the global model's ``state_dict()`` (the Bayesian model: ``weight_mu`` zero off the support,
``mask``, ``bias``, ...; ``model.load_state_dict(result.arrays.to_torch_state_dict())`` loads it). What travels is
never that: each train message carries the algorithm's coded downlink, each reply its coded upload.

Settings: an experiment configuration (:class:`dturbo.Config`) from a preset (``preset="recommended"``), a
configuration (``config=``), the library's defaults otherwise; the keys of the algorithm's own section
(``[dturbo]``, ``[stc]``, ``[feddst]``) as keyword arguments (a sub-table as a dict, merged:
``sparsity={"target_density": 0.1}``); any other key through ``overrides`` (``{"train.lr": 0.003}``). The
strategy sets what the Flower run decides: ``experiment.rounds`` = ``num_rounds``, ``federation.clients`` = the
nodes, ``federation.clients_per_round`` from ``fraction_train`` / ``min_train_nodes``; ``[data]`` and ``[model]``
are not read (the model is the user's, the data the ClientApp's).

n, the total number of training samples (E6's KL weight beta * KL / n, the pace of the pruning schedule, the bound
on an upload's n_t): ``total_samples=`` when the server knows it; otherwise, before the first round, the strategy
sends every node a query (:data:`dturbo.flower.protocol.QUERY`) that the ClientApp answers with
:func:`dturbo.flower.count_samples`, and n is the sum of the answers.

Clients: the nodes connected when :meth:`~DturboStrategy.start` begins (after ``min_available_nodes`` are) are the
federation, for the whole run. Each node gets a dturbo client id 0..N-1 (it seeds the client's minibatches and
noise, and keys its private state): the ``partition-id`` its query answer names when those are 0..N-1 exactly
(Flower's simulation engine, or node configs that set them), else its rank among the sorted node ids. Each round
dturbo's seeded selection (``federation.clients_per_round`` = max(int(N * fraction_train), min_train_nodes), all of
them when that reaches N) picks the clients, so a run is reproducible. A node that fails, answers with an error or
does not answer within ``timeout`` counts as failed / dropped for the round, which goes on with the others.

Restarts: with ``checkpoint=FOLDER`` the strategy saves the server's state after every round (the runner's
checkpoint format, its checksum over the whole file); a strategy started again with the same folder, settings and
nodes continues from the round after the last one saved, as ``dturbo run --resume`` does. The clients' own state
stays on their nodes.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from torch import nn

from .. import rounds
from ..algorithms.base import ServerAlgorithm, State
from ..algorithms.statistics import Statistics, calibrate
from ..checkpoint import CheckpointError, config_fingerprint, continued, save_checkpoint
from ..config import Config, ConfigError
from ..ledger import Traffic
from ..nn.models import record_input_shape
from ..settings import load_config, merged
from ..transport import Reply
from . import protocol, wire
from .client import bayesian_model

log = logging.getLogger("flwr")

ModelSource = nn.Module | Callable[[], nn.Module]
MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


@dataclass
class _Pending:
    """What one round's :meth:`DturboStrategy.configure_train` sent, for its :meth:`aggregate_train`."""

    server_round: int
    downlinks: dict[int, bytes]  # every selected client's downlink, in the order of the selection
    sent: list[tuple[Message, int]]  # (message, client id) of those that left


@dataclass
class _Session:
    """One run of the strategy (:meth:`DturboStrategy.setup`)."""

    cfg: Config
    server: ServerAlgorithm
    state: State
    node_of: dict[int, int]  # client id -> node id
    total_samples: int
    settings: str
    layers: list[protocol.ModelLayer]
    cum_bits: int = 0
    grid: Grid | None = None
    timeout: float = 3600.0
    statistics: Statistics | None = None  # the model's BatchNorm layers, when their statistics are calibrated
    pending: _Pending | None = None
    eval_sent: list[tuple[Message, int]] = field(default_factory=list)
    done: int = 0  # rounds of an earlier start, continued from the checkpoint: Flower's round r is round done + r

    @property
    def client_of(self) -> dict[int, int]:
        return {node: cid for cid, node in self.node_of.items()}


class DturboStrategy(Strategy):
    """One of dturbo's algorithms (``algorithm``: ``"dturbo"``, ``"stc"``, ``"feddst"``, ``"fedavg"``, ...: any
    registered method whose client loads a downlink without training, :func:`dturbo.flower.protocol.algorithms`) as
    a Flower strategy (module docstring).

    Args:
        model: the network: a ``torch.nn.Module`` (copied; made Bayesian with :func:`dturbo.bayesianize` and the
            configuration's ``sigma_mode`` / ``sigma_init_ratio`` when it is not yet) or a zero-argument function
            returning one (called with torch's RNG seeded by ``experiment.seed``). The server needs it for each
            layer's grid and prior; ``initial_arrays`` of :meth:`start`, when not empty, replace its weights.
        algorithm: which of dturbo's algorithms.
        preset: a preset shipped with dturbo (:func:`dturbo.presets.names`) of this algorithm.
        config: instead of a preset, a configuration (a :class:`dturbo.Config`, a mapping shaped like the TOML or a
            TOML path).
        overrides: dotted config keys to set (``{"train.lr": 0.003, "experiment.seed": 1}``).
        total_samples: n, the training samples of all clients together; None: asked from the nodes (module
            docstring).
        fraction_train, min_train_nodes: the clients a round trains, as Flower's FedAvg counts them.
        fraction_evaluate, min_evaluate_nodes: the nodes of federated evaluation (0: none).
        min_available_nodes: :meth:`start` waits until this many nodes are connected.
        weighted_by_key: the MetricRecord key that weighs the clients' metrics.
        train_metrics_aggr_fn, evaluate_metrics_aggr_fn: as Flower's FedAvg's (default: the weighted mean).
        query_timeout: seconds the query for the sample counts waits for answers.
        checkpoint: a folder for the server's state after every round; a checkpoint there is continued from
            (module docstring). None: nothing is saved.
        input_shape: one sample's shape, recorded on the model where it records none (as ``dturbo.bayesianize``
            records it): what ``dead_units = "cut"`` and ``sparsity.budget = "flops"`` read the model's graph with.
        **settings: keys of the algorithm's config section (``[dturbo]``, ``[stc]``, ``[feddst]``).

    Raises :class:`dturbo.ConfigError` for an unknown key or a bad value, at once.
    """

    def __init__(self, model: ModelSource, *, algorithm: str = "dturbo", preset: str | None = None,
                 config: Any = None, overrides: Mapping[str, Any] | Sequence[str] | None = None,
                 total_samples: int | None = None, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 2, min_evaluate_nodes: int = 2, min_available_nodes: int = 2,
                 weighted_by_key: str = protocol.NUM_EXAMPLES,
                 train_metrics_aggr_fn: MetricsAggregation | None = None,
                 evaluate_metrics_aggr_fn: MetricsAggregation | None = None, query_timeout: float = 120.0,
                 checkpoint: str | Path | None = None, input_shape: Sequence[int] | None = None,
                 **settings: Any) -> None:
        if algorithm not in (known := protocol.algorithms()):
            raise ValueError(f"algorithm {algorithm!r}: the strategy runs {', '.join(known)}")
        if not (isinstance(model, nn.Module) or callable(model)):
            raise TypeError(f"model must be a torch.nn.Module or a function returning one, not {type(model).__name__}")
        if total_samples is not None and (isinstance(total_samples, bool) or int(total_samples) < 1):
            raise ValueError(f"total_samples must be a positive number of samples, got {total_samples!r}")
        for name, value in (("fraction_train", fraction_train), ("fraction_evaluate", fraction_evaluate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        self.algorithm = algorithm
        self.preset = preset
        self.base_config = self._base_config(preset, config, overrides, settings)
        self.model_source = model
        self.total_samples = None if total_samples is None else int(total_samples)
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = 0 if fraction_train == 0.0 else min_train_nodes
        self.min_evaluate_nodes = 0 if fraction_evaluate == 0.0 else min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.weighted_by_key = weighted_by_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn or aggregate_metricrecords
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn or aggregate_metricrecords
        self.query_timeout = query_timeout
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self.session: _Session | None = None

    # ----------------------------------------------------------------------------------- configuration
    def _base_config(self, preset: str | None, config: Any, overrides: Mapping[str, Any] | Sequence[str] | None,
                     settings: dict[str, Any]) -> Config:
        if preset is not None and config is not None:
            raise ConfigError("give a preset or a config, not both")
        if preset is not None:
            cfg = load_config(preset=preset)
        elif config is not None:
            cfg = load_config(config)
        else:
            cfg = load_config({"experiment": {"algorithm": self.algorithm}})
        if cfg.experiment.algorithm != self.algorithm:
            where = f"preset {preset!r}" if preset is not None else "the config"
            raise ConfigError(f"{where} is for experiment.algorithm = {cfg.experiment.algorithm!r}, this strategy "
                              f"runs {self.algorithm!r}")
        data = cfg.to_dict()
        data[self.algorithm] = merged(data.get(self.algorithm, {}), settings)
        return load_config(data, overrides)

    def config_for(self, num_rounds: int, clients: int) -> Config:
        """The run's configuration: the strategy's settings with the rounds and clients of the Flower run."""
        per_round = max(int(clients * self.fraction_train), self.min_train_nodes, 1)
        return load_config(self.base_config, {
            "experiment.rounds": int(num_rounds), "federation.clients": clients,
            "federation.clients_per_round": None if per_round >= clients else per_round,
            "federation.min_clients": min(self.base_config.federation.min_clients, clients),
            "model.name": "custom", "data.name": "arrays", "data.path": None,
        })

    def initial_model(self, cfg: Config, arrays: ArrayRecord | None = None) -> nn.Module:
        """The Bayesian model the run starts from: the strategy's model (seeded by ``experiment.seed`` when it is a
        function), with ``arrays`` loaded when they hold its ``state_dict()`` (of the Bayesian model, or of the
        model before :func:`dturbo.bayesianize`)."""
        src = self.model_source
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.experiment.seed)
            base = copy.deepcopy(src) if isinstance(src, nn.Module) else src()
        if not isinstance(base, nn.Module):
            raise TypeError(f"the model function returned a {type(base).__name__}, not a torch.nn.Module")
        sd = arrays.to_torch_state_dict() if arrays is not None and len(arrays) else None
        if sd is not None and set(sd) == set(base.state_dict()):
            base.load_state_dict(sd)
            sd = None
        model = bayesian_model(base, cfg)
        if self.input_shape is not None:
            record_input_shape(model, self.input_shape)
        if sd is not None:
            if set(sd) != set(model.state_dict()):
                raise ValueError("initial_arrays do not hold the strategy's model: pass "
                                 "ArrayRecord(model.state_dict()) of the model given to the strategy (before or after "
                                 "dturbo.bayesianize)")
            model.load_state_dict(sd)
        return model.cpu().float()

    # ------------------------------------------------------------------------------------------ the run
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run ``num_rounds`` rounds on ``grid`` (Flower's ``Strategy.start``, after :meth:`setup`), or those left
        after the rounds of ``checkpoint``. The arrays it passes to ``evaluate_fn`` and returns in ``Result.arrays``
        are the global model's ``state_dict()``; the train MetricRecords hold the server's metrics and the round's
        bits (dturbo's ledger and Flower's bytes). ``Result``'s rounds are the run's (a continued run's first is
        the one after the checkpoint's)."""
        self.setup(grid, initial_arrays, num_rounds)
        run = self._need_session()
        run.timeout = timeout
        done = run.done = self._continue(run)
        shifted = None if evaluate_fn is None else (lambda r, arrays: evaluate_fn(r + done, arrays))
        result = super().start(grid, self.global_arrays(), num_rounds - done, timeout, train_config,
                               evaluate_config, shifted)
        if done:
            result.arrays = self.global_arrays()
            for name in ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp"):
                setattr(result, name, {r + done: m for r, m in getattr(result, name).items()})
        return result

    def _continue(self, run: _Session) -> int:
        """The rounds done by the checkpoint in ``checkpoint`` (0: none there), its state and bits put into
        ``run``; CheckpointError when it is corrupt, of another configuration or model, or beyond the run."""
        found = None if self.checkpoint is None else continued(self.checkpoint, config_fingerprint(run.cfg.to_dict()),
                                                                run.state)
        if found is None:
            return 0
        run.state, done, cum_bits = found
        if done > run.cfg.experiment.rounds:
            raise CheckpointError(f"checkpoint in {self.checkpoint} holds {done} rounds, more than num_rounds = "
                                  f"{run.cfg.experiment.rounds}; it was left untouched")
        run.cum_bits = int(cum_bits)
        log.info("dturbo: continuing from the checkpoint of round %d in %s", done, self.checkpoint)
        return done

    def _save(self, run: _Session, server_round: int) -> None:
        if self.checkpoint is not None:
            save_checkpoint(self.checkpoint, run.state, {"rounds_done": server_round, "cum_bits": run.cum_bits,
                                                         "fingerprint": config_fingerprint(run.cfg.to_dict())})

    def setup(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int) -> None:
        """Fix the federation (the connected nodes, their client ids and n), the configuration and the server's
        initial state (:meth:`start` calls it; call it yourself to drive the rounds by hand)."""
        nodes = self._wait_for_nodes(grid)
        node_of, total, samples = self._connect(grid, nodes)
        cfg = self.config_for(num_rounds, len(node_of))
        from ..algorithms.registry import ALGORITHMS

        model = self.initial_model(cfg, initial_arrays)

        def factory() -> nn.Module:
            return copy.deepcopy(model)

        spec = ALGORITHMS[self.algorithm]
        server = spec.server(cfg, factory, total)
        if samples:  # the n_t an upload may claim: its sender's own count (algorithms.bounds)
            server.partitions = [samples[cid] for cid in range(len(node_of))]
        # The nodes' sample counts are unknown here: the warnings that need them stay silent.
        for warning in spec.run_warnings(cfg, SimpleNamespace(total_samples=total, clients=None)):
            log.warning("dturbo: %s", warning)
        statistics = Statistics(model) if cfg.federation.batchnorm == "calibrated" else None
        self.session = _Session(cfg, server, server.init(), node_of, total, protocol.settings_text(cfg),
                                protocol.model_layers(model), grid=grid, statistics=statistics or None)
        log.info("dturbo %s: %d clients, n = %d training samples, %d rounds, %s clients a round", self.algorithm,
                 len(node_of), total, num_rounds, cfg.federation.clients_per_round or "all")

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        while len(nodes := list(grid.get_node_ids())) < self.min_available_nodes:
            log.info("Waiting for nodes to connect: %d connected (minimum required: %d).", len(nodes),
                     self.min_available_nodes)
            time.sleep(1)
        return sorted(nodes)

    def _connect(self, grid: Grid, nodes: list[int]) -> tuple[dict[int, int], int, dict[int, int]]:
        """(client id -> node id, n, client id -> its n_t): from ``total_samples`` and the node order (no n_t), or
        from the nodes' answers."""
        if self.total_samples is not None:
            return dict(enumerate(nodes)), self.total_samples, {}
        msgs = [Message(RecordDict({wire.TASK: ConfigRecord({"algorithm": self.algorithm})}), dst_node_id=node,
                        message_type=protocol.QUERY) for node in nodes]
        counts: dict[int, int] = {}
        pids: dict[int, int] = {}
        for reply in grid.send_and_receive(msgs, timeout=self.query_timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("node %d did not answer the dturbo query: %s", node, reply.error.reason)
                continue
            try:
                n_t = int(reply.content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES])
                pid = int(reply.content.config_records[wire.TASK][wire.PARTITION_ID])
            except (KeyError, TypeError, ValueError) as err:
                log.warning("node %d: malformed answer to the dturbo query (%s); left out", node, err)
                continue
            if n_t < 1:
                log.warning("node %d holds no training sample; left out", node)
                continue
            counts[node], pids[node] = n_t, pid
        if not counts:
            raise RuntimeError(
                f"no node answered the strategy's query for its training sample count within query_timeout = "
                f"{self.query_timeout:g} s: register it in the ClientApp (@app.query(\"dturbo\") returning "
                f"dturbo.flower.count_samples(msg, context, trainloader)) or give the strategy total_samples=; nodes "
                f"that answer it but start slowly need a longer query_timeout")
        left = sorted(set(nodes) - set(counts))
        if left:
            log.warning("nodes %s did not answer the dturbo query and are left out of the federation", left)
        answered = sorted(counts)
        if sorted(pids.values()) == list(range(len(answered))):
            node_of = {pids[node]: node for node in answered}
        else:
            node_of = dict(enumerate(answered))
            log.info("dturbo: the nodes' partition-ids are not 0..%d; client ids follow the node ids' order",
                     len(answered) - 1)
        return node_of, sum(counts.values()), {cid: counts[node] for cid, node in node_of.items()}

    def _need_session(self) -> _Session:
        if self.session is None:
            raise RuntimeError(f"{type(self).__name__} has no run: start() (or setup()) comes first")
        return self.session

    def global_model(self) -> nn.Module:
        """The current global model (mean weights on the support), in eval mode."""
        run = self._need_session()
        return run.server.global_model(run.state)

    def global_arrays(self) -> ArrayRecord:
        """The current global model's ``state_dict()`` as an ArrayRecord."""
        return ArrayRecord(self.global_model().state_dict())

    def summary(self) -> None:
        """Log the strategy's settings."""
        cfg = self.session.cfg if self.session is not None else self.base_config
        log.info("\t├──> dturbo algorithm: %s%s", self.algorithm, f" (preset {self.preset})" if self.preset else "")
        log.info("\t├──> settings sent to the clients: %s", protocol.settings_text(cfg).strip().replace("\n", "; "))
        log.info("\t├──> Sampling:")
        log.info("\t│\t├──Fraction: train (%.2f) | evaluate ( %.2f)", self.fraction_train, self.fraction_evaluate)
        log.info("\t│\t├──Minimum nodes: train (%d) | evaluate (%d)", self.min_train_nodes, self.min_evaluate_nodes)
        log.info("\t│\t└──Minimum available nodes: %d", self.min_available_nodes)
        n = self.session.total_samples if self.session is not None else self.total_samples
        log.info("\t└──> total samples n: %s", n if n is not None else "asked from the nodes")

    # ---------------------------------------------------------------------------------------- training
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """The train messages of round ``server_round`` (1-based): dturbo's seeded selection, each selected client's
        coded downlink of the current global model. ``arrays`` is not sent (it is that model's state_dict)."""
        run = self._need_session()
        server_round += run.done
        run.pending = None
        if self.fraction_train == 0.0:
            return []
        rnd = server_round - 1
        downlinks = rounds.downlinks(run.server, run.state, rnd)
        config["server-round"] = server_round
        sent = self._train_messages(rnd, downlinks, config, grid)
        run.pending = _Pending(server_round, downlinks, sent)
        log.info("configure_train: %d clients selected (out of %d)", len(downlinks), len(run.node_of))
        return [m for m, _ in sent]

    def _train_messages(self, rnd: int, downlinks: Mapping[int, bytes], config: ConfigRecord, grid: Grid
                        ) -> list[tuple[Message, int]]:
        """A train message to each client of ``downlinks`` whose node is connected (the others count as dropped),
        with its client id."""
        online = set(grid.get_node_ids())
        node_of = self._need_session().node_of
        return [(self._train_message(rnd, cid, down, config), cid) for cid, down in downlinks.items()
                if node_of[cid] in online]

    def _matched(self, sent: list[tuple[Message, int]], replies: Iterable[Message]) -> dict[int, Message]:
        """Each client's reply to ``sent``, matched by the message it answers, else by its node, in client id
        order; a client answered twice keeps its first answer, a reply to no message sent is left out."""
        by_message = {m.metadata.message_id: cid for m, cid in sent if m.metadata.message_id}
        sent_to = {cid for _, cid in sent}
        client_of = self._need_session().client_of
        out: dict[int, Message] = {}
        for reply in replies:
            cid = by_message.get(reply.metadata.reply_to_message_id, client_of.get(reply.metadata.src_node_id))
            if cid is None or cid not in sent_to or cid in out:
                log.info("\t> a reply from node %s that answers no message sent; ignored", reply.metadata.src_node_id)
                continue
            out[cid] = reply
        return dict(sorted(out.items()))

    def _replies(self, rnd: int, matched: Mapping[int, Message]) -> dict[int, Reply]:
        """Each client's matched reply (:meth:`_matched`) as the runner's reply: its upload (one over the server's
        size bound cut to the bound and a byte: it is refused, and booked at the bound), or why none."""
        bound = self._need_session().server.max_uplink_bytes
        return {cid: wire.reply_upload(reply, cid, rnd, bound) for cid, reply in matched.items()}

    def _train_message(self, rnd: int, cid: int, down: bytes, config: ConfigRecord) -> Message:
        """The train message to client ``cid`` of round ``rnd`` (0-based) carrying ``down``."""
        run = self._need_session()
        task = protocol.Task(self.algorithm, rnd, cid, run.settings, run.layers)
        content = RecordDict({wire.DOWN: wire.bytes_record(down), protocol.CONFIG: config, wire.TASK: task.record()})
        return Message(content=content, dst_node_id=run.node_of[cid], message_type=MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The runner's round (:func:`dturbo.rounds.fit_round`) on the replies: each selected client's upload
        checked against its sender and partition and booked within the size bound, the algorithm's server step,
        again with fresh train messages while fewer than ``federation.min_clients`` uploads are valid
        (``on_too_few = "retry"``); the new global model's state_dict with the round's metrics. Raises
        :class:`dturbo.rounds.TooFewClientsError` when the round cannot be completed."""
        run = self._need_session()
        server_round += run.done
        pending = run.pending
        if pending is None or pending.server_round != server_round:
            return None, None
        rnd = server_round - 1
        replies = list(replies)
        matched = self._matched(pending.sent, replies)
        messages = [m for m, _ in pending.sent]  # every train message and reply of the round, retries' too
        replied = list(replies)
        assert run.grid is not None
        grid = run.grid

        def send(downlinks: Mapping[int, bytes]) -> tuple[list[bytes], dict[int, Reply]]:
            sent = self._train_messages(rnd, downlinks, ConfigRecord({"server-round": server_round}), grid)
            answers = list(grid.send_and_receive([m for m, _ in sent], timeout=run.timeout))
            messages.extend(m for m, _ in sent)
            replied.extend(answers)
            return [downlinks[cid] for _, cid in sent], self._replies(rnd, self._matched(sent, answers))

        first = rounds.Sent(pending.downlinks, [pending.downlinks[cid] for _, cid in pending.sent],
                            self._replies(rnd, matched))
        try:
            outcome = rounds.fit_round(run.server, run.state, rnd, run.cfg.federation, send, first)
        except rounds.TooFewClientsError as err:
            for event in err.events:
                log.warning("round %d: %s", server_round, event)
            raise
        for event in outcome.events:
            log.info("\t> %s", event)
        run.state = outcome.result.state
        traffic = outcome.traffic
        metrics: dict[str, float] = {"participants": float(outcome.attempt.participants), **outcome.attempt.counts,
                                     "retries": outcome.retries, **outcome.result.metrics}
        log.info("aggregate_train: %d valid uploads of %d clients", int(outcome.result.metrics["clients_ok"]),
                 outcome.attempt.participants)
        if run.statistics is not None and self._evaluated(server_round):
            run.state = self._calibrate(server_round, traffic)
            metrics["calibration_bits"] = traffic.calibration_bits
        run.cum_bits += traffic.up_bits + traffic.down_bits
        self._save(run, server_round)
        metrics |= {"up_bits": traffic.up_bits, "down_bits": traffic.down_bits, "cum_bits": run.cum_bits,
                    **traffic.parts,
                    "flower_down_bytes": sum(protocol.message_bytes(m.content) for m in messages),
                    "flower_up_bytes": sum(protocol.message_bytes(r.content) for r in replied if not r.has_error())}
        record = MetricRecord({k: n for k, v in metrics.items() if (n := protocol.metric_number(v)) is not None})
        contents = [reply.content for cid, reply in matched.items() if isinstance(first.replies[cid], bytes)]
        try:
            if contents:
                for key, value in self.train_metrics_aggr_fn(contents, self.weighted_by_key).items():
                    record.setdefault(key, value)
        except (KeyError, TypeError, ValueError, StopIteration) as err:
            log.warning("round %d: the clients' MetricRecords do not aggregate (%s)", server_round, err)
        return self.global_arrays(), record

    def _evaluated(self, server_round: int) -> bool:
        """Whether the runner evaluates round ``server_round`` (``experiment.eval_every``, and the last)."""
        cfg = self._need_session().cfg
        return server_round % cfg.experiment.eval_every == 0 or server_round == cfg.experiment.rounds

    def _calibrate(self, server_round: int, traffic: Traffic) -> State:
        """The state with its BatchNorm statistics measured by the next round's clients, as the runner's
        (:func:`dturbo.algorithms.statistics.calibrate`): each gets a train message carrying its ``calibrate``
        message, which :func:`dturbo.flower.fit` answers."""
        run = self._need_session()
        assert run.statistics is not None and run.grid is not None
        grid = run.grid

        def send(requests: dict[int, bytes]) -> dict[int, object]:
            sent = self._train_messages(server_round, requests, ConfigRecord({"server-round": server_round + 1}),
                                        grid)
            replies = list(grid.send_and_receive([m for m, _ in sent], timeout=run.timeout))
            out: dict[int, object] = {cid: "lost" for _, cid in sent}
            out.update(self._replies(server_round, self._matched(sent, replies)))
            return out

        events: list[str] = []
        state = calibrate(run.statistics, run.server, run.state, server_round, send, traffic, events)
        for event in events:
            log.warning("round %d: %s", server_round, event)
        return state

    # -------------------------------------------------------------------------------------- evaluation
    def evaluation_downlink(self, server_round: int) -> bytes:
        """The current global model coded so that any node decodes it without client state
        (:meth:`dturbo.protocol.ServerAlgorithm.evaluation_downlink`)."""
        run = self._need_session()
        return run.server.evaluation_downlink(run.state, server_round)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """Evaluate messages to max(int(N * fraction_evaluate), min_evaluate_nodes) of the connected clients (a
        seeded choice), each carrying :meth:`evaluation_downlink`."""
        run = self._need_session()
        server_round += run.done
        run.eval_sent = []
        if self.fraction_evaluate == 0.0:
            return []
        online = set(grid.get_node_ids())
        clients = [cid for cid, node in sorted(run.node_of.items()) if node in online]
        k = min(max(int(len(clients) * self.fraction_evaluate), self.min_evaluate_nodes), len(clients))
        if k == 0:
            return []
        rng = np.random.default_rng([run.cfg.experiment.seed, server_round, 0xE7])
        chosen = sorted(rng.choice(clients, size=k, replace=False).tolist())
        down = wire.bytes_record(self.evaluation_downlink(server_round))
        config["server-round"] = server_round
        for cid in chosen:
            task = protocol.Task(self.algorithm, server_round, cid, run.settings, run.layers)
            content = RecordDict({wire.DOWN: down, protocol.CONFIG: config, wire.TASK: task.record()})
            run.eval_sent.append((Message(content=content, dst_node_id=run.node_of[cid],
                                          message_type=MessageType.EVALUATE), cid))
        log.info("configure_evaluate: %d clients selected (out of %d)", k, len(clients))
        return [m for m, _ in run.eval_sent]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The clients' evaluation metrics, weighted by ``weighted_by_key``, with the bits the evaluate messages
        cost (``eval_down_bits``: the coded global model, 8 x its bytes per node; Flower's bytes both ways)."""
        run = self._need_session()
        replies = list(replies)
        valid = [r for r in replies if not r.has_error() and self.weighted_by_key in
                 next(iter(r.content.metric_records.values()), {})]
        log.info("aggregate_evaluate: received %d results and %d failures", len(valid), len(replies) - len(valid))
        if not valid:
            return None
        record = self.evaluate_metrics_aggr_fn([r.content for r in valid], self.weighted_by_key)
        sent = [m for m, _ in run.eval_sent]
        record["eval_down_bits"] = 8 * sum(len(wire.record_bytes(m.content, wire.DOWN)) for m in sent)
        record["flower_down_bytes"] = sum(protocol.message_bytes(m.content) for m in sent)
        record["flower_up_bytes"] = sum(protocol.message_bytes(r.content) for r in replies if not r.has_error())
        return record


class DTurboVBI(DturboStrategy):
    """D-Turbo-VBI (docs/algorithm.md) as a Flower strategy: keyword arguments are ``[dturbo]`` keys
    (``beta=0.01``, ``sparsity={"target_density": 0.15}``, ``transmission={"up_bits": 4}``); see
    :class:`DturboStrategy` for the rest."""

    def __init__(self, model: ModelSource, **kwargs: Any) -> None:
        super().__init__(model, algorithm="dturbo", **kwargs)


class STC(DturboStrategy):
    """STC, sparse ternary compression both ways (:mod:`dturbo.algorithms.stc`): keyword arguments are ``[stc]``
    keys (``p_up=0.04``, ``p_down=0.04``). Every client trains every round (``fraction_train`` = 1)."""

    def __init__(self, model: ModelSource, **kwargs: Any) -> None:
        super().__init__(model, algorithm="stc", **kwargs)


class FedDST(DturboStrategy):
    """FedDST, federated dynamic sparse training (:mod:`dturbo.algorithms.feddst`): keyword arguments are
    ``[feddst]`` keys (``density=0.2``, ``readjust_every=3``)."""

    def __init__(self, model: ModelSource, **kwargs: Any) -> None:
        super().__init__(model, algorithm="feddst", **kwargs)
